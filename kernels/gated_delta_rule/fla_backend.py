"""The gated delta rule on fla-core's chunked kernels (flash-linear-attention 0.6): the ``fla`` backend of
``model.kernels.delta_rule``, an adapter with exactly the semantics and shapes of `delta_rule_chunked`
(reference.py's module docstring).

Gated DeltaNet (n_h = 1) runs on ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (which fla itself may
hand to FlashQLA's kernels on Hopper/Blackwell at Dk = Dv = 128), DeltaProduct (n_h > 1) on
``fla.ops.gated_delta_product.chunk_gated_delta_product``. How our conventions map onto fla's:

- q, k L2-normalised and q scaled by Dk^-0.5: fla's ``use_qk_l2norm_in_kernel=True`` and ``scale``. fla's
  l2norm is x / sqrt(sum x^2 + 1e-6), the eps placement of our `l2_normalize` (they agree to rounding); fla
  stores the normalised q, k in the inputs' dtype before its kernels read them.
- Grouped value heads: fla's kernels read key head ``i_hv // (HV // H)`` for value head ``i_hv`` (GVA), the
  grouping of ours (key head h serves value heads h*r .. h*r + r - 1), so q, k pass as they are. fla's
  DeltaProduct has no GVA (its k must have v's heads): there q, k are repeated to the value heads first.
- DeltaProduct's sub-steps: fla takes k, v, beta of length T * n_h, token i's sub-step j at i * n_h + j, the
  decay once before a token's sub-steps and the query after its last: our (B, T, n_h, ...) layout flattened.
- Documents: fla takes packed sequences in one row (B = 1) with cumulative lengths ``cu_seqlens`` and one
  initial state per sequence. The B rows are flattened into one row of B * T tokens whose sequences start at
  every row start and every reset; row b's first sequence gets initial_state[b], the others zeros, and row b's
  final state is that of its last sequence. Without resets inside the rows they pass as a plain batch. A reset at
  t = 0 (callers do not set one: a row's first document continues the state) zeroes that row's initial state,
  as the reference's does.

Decoding (the recurrent form) is not here: our recurrent kernel keeps it.
"""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import BackendError
from hybridtron.kernels.gated_delta_rule.inputs import check_inputs
from hybridtron.kernels.limits import FLA_CHUNK_SIZES, FLA_MAX_DK

_INSTEAD = "choose model.kernels.delta_rule=triton or reference"


def _refuse(q, k, v, g, beta, initial_state, chunk_size) -> None:
    """BackendError, one line, for what fla-core 0.6 cannot take (its own checks are asserts or arrive late,
    inside a backward)."""
    n_h, Dk, Dv = k.shape[2], k.shape[-1], v.shape[-1]
    if chunk_size not in FLA_CHUNK_SIZES:
        raise BackendError(f"fla's chunked gated delta rule takes chunk_size 16, 32 or 64, not {chunk_size}; "
                           f"{_INSTEAD}")
    if Dk > FLA_MAX_DK:
        raise BackendError(f"fla's chunked gated delta rule takes key head dims up to {FLA_MAX_DK}, not Dk={Dk}; "
                           f"{_INSTEAD}")
    if n_h > 1 and q.dtype == torch.float32:
        raise BackendError(f"fla's chunk_gated_delta_product (DeltaProduct, n_h={n_h}) refuses float32 q; run it "
                           f"in bfloat16 (e.g. under autocast) or {_INSTEAD}")
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    if wants_grad and q.dtype in (torch.float16, torch.bfloat16) and (Dk % 2 or Dv % 2):
        # fla's chunk_bwd_dv asserts this (Triton miscompiles odd 16-bit tails there): refuse before the forward.
        raise BackendError(f"fla's gated delta rule backward takes even head dims in {q.dtype}, not Dk={Dk}, "
                           f"Dv={Dv}; {_INSTEAD}")


def _sequences(resets: torch.Tensor):
    """Packed sequences of the B rows flattened into one: (cu_seqlens_cpu int64 [0, ..., B*T], first, last)
    with first[b] / last[b] the index of row b's first / last sequence, or None when no reset falls inside a
    row (the rows are then a plain batch). One device-to-host copy: fla needs the chunk indices on the host
    anyway, and with cu_seqlens_cpu it computes them without a second one."""
    starts = resets.detach().to("cpu", torch.bool).clone()
    if not starts[:, 1:].any():
        return None
    starts[:, 0] = True  # every row starts a sequence (a reset at t = 0 zeroes the row's initial state instead)
    B, T = starts.shape
    cu = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([B * T])])
    per_row = starts.sum(1).cumsum(0)
    return cu.to(torch.int64), per_row - starts.sum(1), per_row - 1


@torch.compiler.disable
def fla_gated_delta_rule(q, k, v, g, beta, *, resets=None, initial_state=None, output_final_state=False,
                         chunk_size=64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o, final_state or None)`` of the chunked gated delta rule on fla-core's kernels, with the shapes and
    meaning of `delta_rule_chunked` (reference.py): q (B, T, Hk, Dk); k (B, T, n_h, Hk, Dk); v (B, T, n_h, Hv,
    Dv); g (B, T, Hv) log decays; beta (B, T, n_h, Hv); resets (B, T) bool or None; initial_state (B, Hv, Dk,
    Dv) or None. o is (B, T, Hv, Dv) in q's dtype; the final state (B, Hv, Dk, Dv) is float32. Differentiable
    in q, k, v, g, beta and initial_state. chunk_size: fla's chunk for Gated DeltaNet (16, 32 or 64); its
    DeltaProduct kernels always use 64. What fla cannot take is refused with a BackendError.

    torch.compile does not trace this: the host copy of the resets breaks a graph anyway, and fla's
    autograd.Functions launch Triton kernels through autotuners and host-side index preparation that dynamo
    cannot trace (fla disables compilation of its entry points itself), so one graph break here is the price."""
    check_inputs("fla_gated_delta_rule", q, k, v, g, beta, resets, initial_state)
    _refuse(q, k, v, g, beta, initial_state, chunk_size)
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise BackendError(f"fla-core is not installed ({e}; pip install fla-core); {_INSTEAD}") from e

    B, T, n_h, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if resets is not None and initial_state is not None:  # a reset before a row's first token drops its state
        initial_state = initial_state * (~resets[:, 0]).to(initial_state.dtype)[:, None, None, None]
    seqs = None if resets is None else _sequences(resets)
    if seqs is None:
        cu = cu_cpu = None
        rows, length, h0 = B, T, initial_state
    else:
        cu_cpu, first, last = seqs
        cu = cu_cpu.to(q.device, non_blocking=True)
        rows, length, h0 = 1, B * T, None
        if initial_state is not None:  # row b's first sequence continues initial_state[b], the others start at 0
            h0 = initial_state.new_zeros(len(cu_cpu) - 1, Hv, Dk, Dv).index_copy(
                0, first.to(initial_state.device), initial_state)
    L = length * n_h
    q = q.reshape(rows, length, Hk, Dk)
    k, v, beta = k.reshape(rows, L, Hk, Dk), v.reshape(rows, L, Hv, Dv), beta.reshape(rows, L, Hv)
    g = g.reshape(rows, length, Hv)
    common = dict(scale=Dk**-0.5, initial_state=h0, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    if n_h == 1:
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **common)
    else:
        if Hv != Hk:  # no GVA in fla's DeltaProduct: give each value head its own copy of its key head
            r = Hv // Hk
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        o, final = chunk_gated_delta_product(q, k, v, g, beta, num_householder=n_h, **common)
    o = o.reshape(B, T, Hv, Dv)
    if not output_final_state:
        return o, None
    if seqs is not None:
        final = final.index_select(0, last.to(final.device))  # each row's last sequence
    return o, final.float()
