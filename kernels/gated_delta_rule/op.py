"""The gated delta rule through the backend switch (``model.kernels.delta_rule``): one entry point for the
mixer, which picks the reference or the Triton kernels.

- ``reference``: `delta_rule_chunked` (training, prefill) or `delta_rule_recurrent` (``algo="recurrent"``: the
  mixer asks for it when decoding one token), pure torch.
- ``triton``: `chunk_gated_delta_rule` (chunk.py: forward and backward), except when no gradient is wanted and
  only a few tokens come (decoding): `recurrent_gated_delta_rule` (recurrent.py: forward only, the state kept in
  registers over the tokens). The kernel modules import triton on first use, so this one needs none.
- ``fla``: fla-core's chunked kernels (fla_backend.py; FlashQLA's where fla dispatches to them), decoding on our
  recurrent kernel as above.
- ``auto``: on CUDA the fastest of these that agrees with the reference at the call's shape class
  (kernels/tune.py), measured for the chunked form.
"""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import pick_for, starts_from_cu_seqlens
from hybridtron.kernels.gated_delta_rule.reference import delta_rule_chunked, delta_rule_recurrent
from hybridtron.kernels.shape_classes import delta_rule_shape

DECODE_TOKENS = 16  # up to this many tokens without gradients: the recurrent kernel (one pass, no chunk systems)


def gated_delta_rule(q, k, v, g, beta, *, resets=None, initial_state=None, output_final_state=False,
                     chunk_size: int = 64, algo: str = "chunked", backend: str = "auto", cu_seqlens=None):
    """``(o, final_state or None)`` of the gated delta rule; shapes, dtypes and meaning as the reference
    (reference.py's module docstring). algo: the reference's form (model.deltanet.algo); backend:
    model.kernels.delta_rule. cu_seqlens: packed sequences in one row (B = 1) as cumulative lengths, instead of
    resets; the state is reset where each sequence after the first starts (the first continues initial_state)."""
    if cu_seqlens is not None:
        if resets is not None or q.shape[0] != 1:
            raise ValueError(f"gated_delta_rule: cu_seqlens describes one packed row (B = 1) in place of resets; got "
                             f"B={q.shape[0]}{' and resets' if resets is not None else ''}")
        resets = starts_from_cu_seqlens(cu_seqlens, q.shape[1], "gated_delta_rule")
    inputs = (q, k, v, g, beta, initial_state)
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    decoding = not wants_grad and q.shape[1] <= DECODE_TOKENS
    # A class is measured for the chunked form only: decoding steps keep our recurrent kernel whatever auto chose.
    shape = None if algo == "recurrent" or decoding else delta_rule_shape(
        q, k, v, g, beta, initial_state, output_final_state, resets is not None, chunk_size)
    chosen = pick_for("delta_rule", backend, q, k, v, shape=shape)
    if chosen == "reference":
        if algo == "recurrent":
            return delta_rule_recurrent(q, k, v, g, beta, resets=resets, initial_state=initial_state,
                                        output_final_state=output_final_state)
        return delta_rule_chunked(q, k, v, g, beta, resets=resets, initial_state=initial_state,
                                  output_final_state=output_final_state, chunk_size=chunk_size)
    if decoding:
        from hybridtron.kernels.gated_delta_rule.recurrent import recurrent_gated_delta_rule

        return recurrent_gated_delta_rule(q, k, v, g, beta, resets=resets, initial_state=initial_state,
                                          output_final_state=output_final_state)
    if chosen == "fla":
        from hybridtron.kernels.gated_delta_rule.fla_backend import fla_gated_delta_rule

        return fla_gated_delta_rule(q, k, v, g, beta, resets=resets, initial_state=initial_state,
                                    output_final_state=output_final_state, chunk_size=chunk_size)
    from hybridtron.kernels.gated_delta_rule.chunk import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g, beta, resets=resets, initial_state=initial_state,
                                  output_final_state=output_final_state, chunk_size=chunk_size)
