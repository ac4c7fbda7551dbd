"""The chunked gated delta rule on Triton kernels (chunk_kernels.py): torch custom ops with fake
implementations, an autograd.Function, and the public `chunk_gated_delta_rule`, which takes and returns what
the reference ``delta_rule_chunked`` (reference.py) does.

The custom ops are opaque to torch.compile (it traces their fake implementations for shapes), so a compiled
model calls the kernels without graph breaks (see kernels/norm/op.py for why not ``triton_op``). The kernel
module is imported on the first call, so importing this one needs no triton.
"""

from __future__ import annotations

import torch

from hybridtron.kernels.gated_delta_rule.inputs import check_inputs
from hybridtron.kernels.limits import CHUNK_SIZES, MAX_DK

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _operand_dtype(q: torch.Tensor) -> torch.dtype:
    """The kernels' matmul operand dtype, which Tinv is kept in: q's for 16-bit q, else the accumulation's."""
    return q.dtype if q.element_size() == 2 else _acc_dtype(q)


@torch.library.custom_op("hybridtron::chunk_gated_delta_rule_fwd", mutates_args=())
def _fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    resets: torch.Tensor | None, initial_state: torch.Tensor | None, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.gated_delta_rule.chunk_kernels import chunk_gdr_fwd

    return chunk_gdr_fwd(q, k, v, g, beta, resets, initial_state, chunk_size)


@_fwd.register_fake
def _(q, k, v, g, beta, resets, initial_state, chunk_size):
    B, T, n_h, _, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    N = -(-T * n_h // chunk_size)
    acc = _acc_dtype(q)
    return (q.new_empty(B, T, Hv, Dv), q.new_empty(B, Hv, Dk, Dv, dtype=acc),
            q.new_empty(B, Hv, N * chunk_size, chunk_size, dtype=_operand_dtype(q)))


@torch.library.custom_op("hybridtron::chunk_gated_delta_rule_bwd", mutates_args=())
def _bwd(
    do: torch.Tensor, dht: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, resets: torch.Tensor | None, tinv: torch.Tensor, initial_state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from hybridtron.kernels.gated_delta_rule.chunk_kernels import chunk_gdr_bwd

    return chunk_gdr_bwd(do, dht, q, k, v, g, beta, resets, tinv, initial_state, chunk_size)


@_bwd.register_fake
def _(do, dht, q, k, v, g, beta, resets, tinv, initial_state, chunk_size):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dht.new_empty(dht.shape, dtype=_acc_dtype(q)))


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """(q, k, v, g, beta, resets or None, initial_state or None, chunk_size) -> (o, final state), shapes as in
    `chunk_gated_delta_rule`, all contiguous, resets bool. Saves the inputs and the inverted chunk systems Tinv
    (B, Hv, N * C, C) in the matmul operand dtype (bf16 for bf16 q: the size of fla's saved A); the backward
    recomputes W, U, delta and the chunk states from them."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, resets, initial_state, chunk_size):
        o, final, tinv = torch.ops.hybridtron.chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, resets, initial_state, chunk_size)
        ctx.save_for_backward(q, k, v, g, beta, resets, tinv, initial_state)
        ctx.chunk_size = chunk_size
        ctx.s0_dtype = None if initial_state is None else initial_state.dtype
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        q, k, v, g, beta, resets, tinv, initial_state = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = torch.ops.hybridtron.chunk_gated_delta_rule_bwd(
            do.contiguous(), dht.contiguous(), q, k, v, g, beta, resets, tinv, initial_state, ctx.chunk_size)
        dh0 = None if ctx.s0_dtype is None else dh0.to(ctx.s0_dtype)
        return dq, dk, dv, dg, dbeta, None, dh0, None


def _check(q, k, v, g, beta, resets, initial_state, chunk_size) -> None:
    """The reference's shapes (inputs.py), and the sizes the kernels take, refused by the argument's name."""
    check_inputs("chunk_gated_delta_rule", q, k, v, g, beta, resets, initial_state)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_gated_delta_rule: chunk_size={chunk_size}; the kernels take one of {CHUNK_SIZES}")
    Dk = q.shape[-1]
    if not 0 < Dk <= MAX_DK:
        raise ValueError(f"chunk_gated_delta_rule: the key head dim Dk={Dk} (q's last dim) must be in 1 .. "
                         f"{MAX_DK}: the kernels keep a whole key row in registers")


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule on the chunked Triton kernels: what ``delta_rule_chunked`` computes, with its
    arguments, shapes and dtypes (reference.py's module docstring): q (B, T, Hk, Dk); k (B, T, n_h, Hk, Dk);
    v (B, T, n_h, Hv, Dv); g (B, T, Hv) log decays <= 0; beta (B, T, n_h, Hv); resets (B, T) bool, True where
    a document starts (the state is zeroed before that token); initial_state (B, Hv, Dk, Dv). q and k are
    L2-normalised inside (q also scaled by Dk^-1/2). Returns o (B, T, Hv, Dv) in q's dtype and, with
    output_final_state, the final state in fp32 (fp64 for fp64 q), else None. Differentiable in q, k, v, g,
    beta and initial_state (the final state's gradient flows back too). chunk_size: 16, 32 or 64.

    On the CPU the kernels run only under TRITON_INTERPRET=1 (set before starting Python)."""
    _check(q, k, v, g, beta, resets, initial_state, chunk_size)
    if resets is not None:
        resets = resets.contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o, final = ChunkGatedDeltaRuleFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                                 beta.contiguous(), resets, initial_state, chunk_size)
    return o, (final if output_final_state else None)
