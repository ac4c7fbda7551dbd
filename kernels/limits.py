"""What each backend of a fused op takes, as plain numbers: the one place the kernels' size limits are written.

The op modules refuse a call outside these limits (by the same constants, imported from here); the job's layout
check (train/parallel/layout.py, through `backend.admissible`) refuses a config whose model a backend it would
run cannot take, before anything is allocated. No torch here: a limit is a function of the model's sizes.

``sizes`` (what `refusal` reads; a key an op does not need may be absent):

- attention: ``head_dim``; ``dtype`` the op computes in ("bf16" under bf16 autocast, "fp32").
- delta_rule: ``chunk_size``, ``k_head_dim``, ``v_head_dim``, ``n_householder`` (DeltaProduct's n_h), ``dtype``,
  ``grad`` (training: a backward runs).
- conv: ``width`` (the filter width, model.deltanet.conv_size).
"""

from __future__ import annotations

from collections.abc import Mapping

# The gated delta rule, our Triton kernels (kernels/gated_delta_rule/chunk.py).
CHUNK_SIZES = (16, 32, 64)
MAX_DK = 256  # the kernels keep a whole key row (the L2 norm needs it) in one register tile
# fla-core's chunked gated delta rule (kernels/gated_delta_rule/fla_backend.py).
FLA_CHUNK_SIZES = (16, 32, 64)  # what chunk_gated_delta_rule accepts; its DeltaProduct always runs 64
FLA_MAX_DK = 256  # fla's state kernels hold the (Dk, BV) state in at most four 64-row register blocks
# The short convolution: our Triton kernel's filter widths (its K-1 row window lives in registers) and
# causal_conv1d_fn's (its kernels are instantiated for these widths only). fla's takes any width.
MAX_K = 4
CAUSAL_CONV1D_WIDTHS = (2, 3, 4)
# flash-attn's head dims: a multiple of 8 up to 256; it computes in float16/bfloat16 only.
FLASH_ATTN_MAX_D = 256


def _attention(backend: str, s: Mapping) -> str | None:
    if backend != "flash-attn":
        return None
    D = s.get("head_dim")
    if D is not None and (D > FLASH_ATTN_MAX_D or D % 8):
        return f"flash-attn takes head dims that are multiples of 8 up to {FLASH_ATTN_MAX_D}, not {D} (model.head_dim)"
    if s.get("dtype") == "fp32":
        return "flash-attn computes in float16/bfloat16 only, and this run computes in float32 (train.dtype)"
    return None


def _delta_rule(backend: str, s: Mapping) -> str | None:
    chunk, dk, dv = s.get("chunk_size"), s.get("k_head_dim"), s.get("v_head_dim")
    if backend == "triton":
        if chunk is not None and chunk not in CHUNK_SIZES:
            return (f"our Triton delta rule runs chunks of {', '.join(map(str, CHUNK_SIZES))} steps, not "
                    f"model.deltanet.chunk_size={chunk}")
        if dk is not None and not 0 < dk <= MAX_DK:
            return f"our Triton delta rule takes key head dims up to {MAX_DK}, not model.deltanet.k_head_dim={dk}"
    if backend == "fla":
        if chunk is not None and chunk not in FLA_CHUNK_SIZES:
            return (f"fla's chunked delta rule runs chunks of {', '.join(map(str, FLA_CHUNK_SIZES))} steps, not "
                    f"model.deltanet.chunk_size={chunk}")
        if dk is not None and dk > FLA_MAX_DK:
            return f"fla's delta rule takes key head dims up to {FLA_MAX_DK}, not model.deltanet.k_head_dim={dk}"
        if s.get("n_householder", 1) > 1 and s.get("dtype") == "fp32":
            return "fla's DeltaProduct (model.deltanet.n_householder > 1) refuses float32 (train.dtype)"
        if s.get("grad") and s.get("dtype") == "bf16" and ((dk or 0) % 2 or (dv or 0) % 2):
            return (f"fla's delta rule backward takes even head dims in bfloat16, not k_head_dim={dk}, "
                    f"v_head_dim={dv} (model.deltanet)")
    return None


def _conv(backend: str, s: Mapping) -> str | None:
    K = s.get("width")
    if K is None:
        return None
    if backend == "triton" and not 1 <= K <= MAX_K:
        return f"our Triton short convolution takes filter widths 1-{MAX_K}, not model.deltanet.conv_size={K}"
    if backend == "causal-conv1d" and K not in CAUSAL_CONV1D_WIDTHS:
        return (f"causal-conv1d takes filter widths {CAUSAL_CONV1D_WIDTHS[0]}-{CAUSAL_CONV1D_WIDTHS[-1]}, not "
                f"model.deltanet.conv_size={K}")
    return None


_RULES = {"attention": _attention, "delta_rule": _delta_rule, "conv": _conv}


def refusal(op: str, backend: str, sizes: Mapping) -> str | None:
    """None when ``backend`` takes ``op`` at ``sizes``, else why not (naming the config field). The reference
    takes everything."""
    rule = _RULES.get(op)
    return None if rule is None or backend == "reference" else rule(backend, sizes)
