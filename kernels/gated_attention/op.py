"""Gated flash attention as torch custom ops (forward, backward) with fake implementations, an
autograd.Function, and the public `gated_attention` that checks its inputs and picks the backend.

The custom ops are opaque to torch.compile (it traces their fake implementations for shapes), so a compiled
model calls the Triton kernels without graph breaks, on the GPU and under the interpreter alike (as for
``kernels/norm``: ``torch.library.triton_op`` would let Inductor look inside, but its fake mode runs the
launcher, which the interpreter cannot do on fake tensors; the kernels are already fused).
"""

from __future__ import annotations

import torch

from hybridtron.kernels.backend import BackendError, pick_for
from hybridtron.kernels.gated_attention.checks import check_shapes as _check
from hybridtron.kernels.gated_attention.reference import doc_bounds, gated_attention_reference
from hybridtron.kernels.limits import FLASH_ATTN_MAX_D
from hybridtron.kernels.shape_classes import attention_shape, gate_kind

MAX_HEAD_DIM = 256  # beyond it a query tile and a key tile no longer fit in shared memory with pipelining
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("hybridtron::gated_attention_fwd", mutates_args=())
def _fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, start: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.gated_attention.triton_kernels import attn_fwd

    return attn_fwd(q, k, v, gate, start, scale)


@_fwd.register_fake
def _(q, k, v, gate, start, scale):
    N, H, D = q.shape
    attn = q.new_empty((N, H, D) if gate is not None else (0,))
    return q.new_empty((N, H, D)), attn, q.new_empty((H, N), dtype=torch.float32)


@torch.library.custom_op("hybridtron::gated_attention_bwd", mutates_args=())
def _bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
    attn: torch.Tensor, lse: torch.Tensor, start: torch.Tensor, end: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.gated_attention.triton_kernels import attn_bwd

    return attn_bwd(dout, q, k, v, gate, attn, lse, start, end, scale)


@_bwd.register_fake
def _(dout, q, k, v, gate, attn, lse, start, end, scale):
    dgate = gate.new_empty(gate.shape) if gate is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dgate


class GatedAttentionFunction(torch.autograd.Function):
    """(q (N, H, D), k, v (N, KV, D), gate None | (N, H) | (N, H, D), start, end (N,) int32, scale) -> out
    (N, H, D). Saves q, k, v, gate, the ungated attention and the log-sum-exp; nothing of size T x T."""

    @staticmethod
    def forward(ctx, q, k, v, gate, start, end, scale):
        out, attn, lse = torch.ops.hybridtron.gated_attention_fwd(q, k, v, gate, start, scale)
        ctx.save_for_backward(q, k, v, gate, out if gate is None else attn, lse, start, end)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, gate, attn, lse, start, end = ctx.saved_tensors
        dq, dk, dv, dgate = torch.ops.hybridtron.gated_attention_bwd(
            dout.contiguous(), q, k, v, gate, attn, lse, start, end, ctx.scale
        )
        return dq, dk, dv, dgate if gate is not None else None, None, None, None


def _check_kernel(q, k, v, gate) -> None:
    """What the Triton kernel supports beyond `_check`: dtypes and head dim."""
    dtypes = {t.dtype for t in (q, k, v, gate) if t is not None}
    if len(dtypes) != 1 or q.dtype not in KERNEL_DTYPES:
        names = ", ".join(f"{n} {t.dtype}" for n, t in (("q", q), ("k", k), ("v", v), ("gate", gate)) if t is not None)
        raise ValueError(
            f"gated_attention (triton): inputs must share one dtype of float16, bfloat16, float32; got {names}. "
            f"Cast them (or run under autocast), or use backend='reference' (e.g. for float64)"
        )
    D = q.shape[-1]
    if D > MAX_HEAD_DIM:
        raise ValueError(
            f"gated_attention (triton): head_dim={D} is above the kernel's maximum {MAX_HEAD_DIM} (a query tile and "
            f"the key tiles would not fit in shared memory); use a head_dim <= {MAX_HEAD_DIM} or "
            f"model.kernels.attention=reference"
        )


def _autocast(*ts):
    """Under autocast, attention runs in the autocast dtype (as SDPA does there); custom ops are not cast."""
    dev = ts[0].device.type
    if not torch.is_autocast_enabled(dev):
        return ts
    dt = torch.get_autocast_dtype(dev)
    return tuple(None if t is None else t.to(dt) for t in ts)


def _tokens(t: torch.Tensor | None, n: int, tail: int) -> torch.Tensor | None:
    """(B, T, ...) or (N, ...) -> (N, ...) as a view where strides allow; the last dim contiguous."""
    if t is None:
        return None
    t = t.reshape(n, *t.shape[t.dim() - tail:])
    return t if t.stride(-1) == 1 else t.contiguous()


def cu_seqlens_from_bounds(start: torch.Tensor) -> torch.Tensor:
    """int32 cu_seqlens from `doc_bounds`' per-token starts (reads the tensor: a host sync)."""
    n = start.numel()
    firsts = (start == torch.arange(n, device=start.device, dtype=start.dtype)).nonzero().flatten()
    return torch.cat([firsts, firsts.new_tensor([n])]).to(torch.int32)


def _flash_attn(q, k, v, gate, cu_seqlens, doc_ids, scale, B, T):
    """flash-attn's causal (varlen) kernel, then the gate in one fused pass (gate.py)."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    from hybridtron.kernels.gated_attention.gate import sigmoid_gate

    D = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or {k.dtype, v.dtype} != {q.dtype}:
        raise BackendError(
            f"gated_attention (flash-attn): flash-attn computes in float16/bfloat16 only; got q {q.dtype}, k {k.dtype}, "
            f"v {v.dtype}. Run under autocast, or use model.kernels.attention=triton or reference"
        )
    if D > FLASH_ATTN_MAX_D or D % 8:
        raise BackendError(f"gated_attention (flash-attn): head_dim={D} is not supported by flash-attn (a multiple of "
                           f"8 up to {FLASH_ATTN_MAX_D}); use model.kernels.attention=triton or reference")
    if q.dim() == 4 and cu_seqlens is None and doc_ids is None:
        attn = flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    else:
        N = B * T
        if cu_seqlens is None:
            start, _ = doc_bounds(B, T, doc_ids=doc_ids, device=q.device)
            cu_seqlens = cu_seqlens_from_bounds(start)
        cu = cu_seqlens.to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())  # flash-attn sizes its grid by it: a host sync
        attn = flash_attn_varlen_func(
            *(t.reshape(N, *t.shape[-2:]) for t in (q, k, v)), cu, cu, max_len, max_len,
            softmax_scale=scale, causal=True,
        ).view(q.shape)
    return sigmoid_gate(attn, gate)


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal grouped-query attention within documents, times sigmoid(gate): ``sigmoid(g) * softmax(s q k^T) v``.

    q (B, T, H, D) or packed (N, H, D); k, v (..., KV, D) with H a multiple of KV (query head h reads kv head
    h // (H // KV)); gate None, (..., H) headwise or (..., H, D) elementwise. Documents: ``doc_ids`` (B, T)
    (runs of equal ids within a row), or ``cu_seqlens`` (n_docs + 1,) over the flattened tokens as in
    flash-attn's varlen API; neither: each batch row (the whole packed sequence) is one document.
    scale: default 1 / sqrt(D). backend: model.kernels.attention (reference | triton | sdpa | flex | flash-attn |
    auto: on CUDA the fastest correct one at this call's shape class, measured by kernels/tune.py).
    Returns (..., H, D) in q's dtype (the autocast dtype under autocast, except on the reference backend).
    """
    B, T = _check(q, k, v, gate, cu_seqlens, doc_ids)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    docs = cu_seqlens is not None or doc_ids is not None
    chosen = pick_for("attention", backend, q, k, v, shape=attention_shape(q, k, v, gate_kind(q, gate), docs))
    if chosen == "reference":
        return gated_attention_reference(q, k, v, gate, cu_seqlens=cu_seqlens, doc_ids=doc_ids, scale=scale)
    q, k, v, gate = _autocast(q, k, v, gate)
    if chosen == "flash-attn":
        return _flash_attn(q, k, v, gate, cu_seqlens, doc_ids, scale, B, T)
    if chosen == "sdpa":
        from hybridtron.kernels.gated_attention.sdpa import sdpa_gated_attention

        return sdpa_gated_attention(q, k, v, gate, doc_ids=doc_ids, cu_seqlens=cu_seqlens, scale=scale)
    if chosen == "flex":
        from hybridtron.kernels.gated_attention.flex import flex_gated_attention

        return flex_gated_attention(q, k, v, gate, doc_ids=doc_ids, cu_seqlens=cu_seqlens, scale=scale)
    _check_kernel(q, k, v, gate)
    N = B * T
    start, end = doc_bounds(B, T, cu_seqlens=cu_seqlens, doc_ids=doc_ids, device=q.device)
    g = None if gate is None else _tokens(gate, N, gate.dim() - q.dim() + 2)
    out = GatedAttentionFunction.apply(_tokens(q, N, 2), _tokens(k, N, 2), _tokens(v, N, 2), g, start, end, scale)
    return out.view(q.shape)
