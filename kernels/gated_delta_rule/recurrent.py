"""The gated delta rule, one token after another, as a single fused Triton kernel: the decoding path.

When a model decodes it feeds one token (or a few) per step together with the recurrent state it cached from
the previous step. A chunked kernel has nothing to chunk then; what counts is reading the state once, applying
the few updates and writing it back once. Here one program owns a (Dk, BV) column tile of one value head's
state and keeps it in registers, in fp32, across all T * n_h sub-steps (kernels/gated_delta_rule/reference.py,
re-exported by model/delta_rule.py, gives the maths; per sub-step, with k and q L2-normalised):

    S <- 0                                  before the token's first sub-step, if the token starts a document
    S <- exp(g) S                           once per token, at its first sub-step
    S <- S + k (beta (v - S^T k))^T         each of the n_h DeltaProduct sub-steps (k, v, beta)
    o  = S^T q / sqrt(Dk)                   after the token's last sub-step

The columns of S (value features) never mix, so tiles of Dv are independent programs; each still needs all
of k and q, which it normalises itself (a few flops per program, instead of another kernel and a round trip
through memory). Grouped value attention reads key head hv // r for value head hv straight from q and k, and
all inputs are read in the caller's (B, T, [n_h,] H, D) layout, so nothing is copied or repeated in torch.

Forward only: there is no backward, and inputs that require grad (with grad mode on) are refused; training
uses the chunked kernel or the reference. The kernel needs triton (importing this module decorates it; on the
CPU it runs only under TRITON_INTERPRET=1, set before the import, which is how the tests run it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridtron.kernels.backend import check_interpreted
from hybridtron.kernels.gated_delta_rule.inputs import check_inputs
from hybridtron.kernels.triton_utils import next_pow2, warps

EPS = 1e-6  # the L2 norm's eps, placed as the reference does: x / sqrt(sum(x^2) + eps)
MAX_BV = 16  # value columns per program: more programs for the small batches of decoding


@triton.jit
def _l2_normalize(x, EPS: tl.constexpr):
    """x (BK,) with zeros in its padding, which the sum therefore ignores."""
    return x / tl.sqrt(tl.sum(x * x, axis=0) + EPS)


@triton.jit
def _recurrent_gdr_fwd_kernel(
    Q, K, V, G, BETA, RESETS, S0, OUT, ST,  # see recurrent_gated_delta_rule_fwd for shapes; all contiguous
    T, HK, HV,
    DK: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, NH: tl.constexpr,
    HAS_RESETS: tl.constexpr, HAS_S0: tl.constexpr, STORE_FINAL: tl.constexpr,
    COMPUTE: tl.constexpr, EPS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # b * HV + hv: also the state's row in (B * HV, DK, DV)
    b = bh // HV
    hv = bh % HV
    hk = hv // R  # the key head serving this value head
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_k = rk < DK
    mask_v = rv < DV
    s_offs = bh * DK * DV + rk[:, None] * DV + rv[None, :]  # (BK, BV) into (B, HV, DK, DV)
    s_mask = mask_k[:, None] & mask_v[None, :]
    # h: this program's (BK, BV) tile of the state S, in COMPUTE. Its padded rows and columns stay zero, because
    # padded k and v entries load as zero.
    if HAS_S0:
        h = tl.load(S0 + s_offs, mask=s_mask, other=0.0).to(COMPUTE)
    else:
        h = tl.zeros((BK, BV), dtype=COMPUTE)
    scale = 1.0 / tl.sqrt(tl.full((), DK, COMPUTE))  # in COMPUTE, so a float64 run stays exact

    for t in range(T):
        bt = b * T + t  # (b, t) as one int64 index
        if HAS_RESETS:  # a new document: forget everything before this token (where, not *0: drops inf/nan too)
            h = tl.where(tl.load(RESETS + bt) != 0, 0.0, h)
        h = h * tl.exp(tl.load(G + bt * HV + hv).to(COMPUTE))
        for j in tl.static_range(NH):  # DeltaProduct sub-steps
            btj = bt * NH + j
            k = tl.load(K + (btj * HK + hk) * DK + rk, mask=mask_k, other=0.0).to(COMPUTE)
            k = _l2_normalize(k, EPS)
            v = tl.load(V + (btj * HV + hv) * DV + rv, mask=mask_v, other=0.0).to(COMPUTE)
            beta = tl.load(BETA + btj * HV + hv).to(COMPUTE)
            delta = beta * (v - tl.sum(h * k[:, None], axis=0))  # (BV,): the write corrects S^T k towards v
            h += k[:, None] * delta[None, :]
        q = tl.load(Q + (bt * HK + hk) * DK + rk, mask=mask_k, other=0.0).to(COMPUTE)
        q = _l2_normalize(q, EPS) * scale
        o = tl.sum(h * q[:, None], axis=0)  # (BV,)
        tl.store(OUT + (bt * HV + hv) * DV + rv, o.to(OUT.dtype.element_ty), mask=mask_v)

    if STORE_FINAL:
        tl.store(ST + s_offs, h.to(ST.dtype.element_ty), mask=s_mask)


def state_dtype(q: torch.Tensor) -> torch.dtype:
    """The state's dtype, and the one the kernel computes in: fp32, or fp64 for fp64 queries (as the reference)."""
    return torch.promote_types(q.dtype, torch.float32)


def recurrent_gated_delta_rule_fwd(q, k, v, g, beta, resets, initial_state, output_final_state):
    """The launcher: q (B, T, Hk, Dk); k (B, T, n_h, Hk, Dk); v (B, T, n_h, Hv, Dv); g (B, T, Hv);
    beta (B, T, n_h, Hv); resets (B, T) bool or None; initial_state (B, Hv, Dk, Dv) or None (shapes checked
    by the caller). -> o (B, T, Hv, Dv) in q's dtype, and the final state (B, Hv, Dk, Dv) in `state_dtype`,
    or an empty tensor when output_final_state is False."""
    B, T, NH, HK, DK = k.shape
    HV, DV = v.shape[-2:]
    o = q.new_empty(B, T, HV, DV)
    final = q.new_empty((B, HV, DK, DV) if output_final_state else (0,), dtype=state_dtype(q))
    if B * HV * DV == 0:  # nothing to compute (and an empty grid would not launch)
        return o, final
    check_interpreted(_recurrent_gdr_fwd_kernel, q.device)
    # The kernel indexes every input as contiguous in its own layout: no copies for contiguous inputs.
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    resets = None if resets is None else resets.contiguous()
    s0 = None if initial_state is None else initial_state.contiguous()
    BK, BV = next_pow2(DK), min(next_pow2(DV), MAX_BV)
    # (B * Hv, Dv tiles): the first grid axis allows 2^31 - 1 programs, the others only 65535 on CUDA.
    grid = (B * HV, triton.cdiv(DV, BV))
    _recurrent_gdr_fwd_kernel[grid](
        q, k, v, g, beta, resets if resets is not None else q, s0 if s0 is not None else q, o, final,
        T, HK, HV, DK=DK, DV=DV, R=HV // HK, NH=NH,
        HAS_RESETS=resets is not None, HAS_S0=s0 is not None, STORE_FINAL=output_final_state,
        COMPUTE=tl.float64 if state_dtype(q) == torch.float64 else tl.float32, EPS=EPS, BK=BK, BV=BV,
        num_warps=warps(BK * BV // 4),  # one warp per 1024 state elements: 32 fp32 registers per thread
    )
    return o, final


@torch.library.custom_op("hybridtron::recurrent_gated_delta_rule_fwd", mutates_args=())
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         resets: torch.Tensor | None, initial_state: torch.Tensor | None,
         output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return recurrent_gated_delta_rule_fwd(q, k, v, g, beta, resets, initial_state, output_final_state)


@_fwd.register_fake
def _(q, k, v, g, beta, resets, initial_state, output_final_state):
    B, T, _, _, DK = k.shape
    HV, DV = v.shape[-2:]
    return (q.new_empty(B, T, HV, DV),
            q.new_empty((B, HV, DK, DV) if output_final_state else (0,), dtype=state_dtype(q)))


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`delta_rule_recurrent` (the reference) as one Triton kernel, forward only, for decoding: a few tokens at a
    time from a cached state. q (B, T, Hk, Dk); k (B, T, n_h, Hk, Dk); v (B, T, n_h, Hv, Dv); g (B, T, Hv)
    log decays <= 0; beta (B, T, n_h, Hv); resets (B, T) bool or None; initial_state (B, Hv, Dk, Dv) or None.
    Returns o (B, T, Hv, Dv) in q's dtype and, when output_final_state, the final state (B, Hv, Dk, Dv) in fp32
    (fp64 for fp64 q), which the next step takes as its initial_state; else None."""
    tensors = (q, k, v, g, beta, initial_state)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        raise RuntimeError(
            "recurrent_gated_delta_rule is forward only (the decoding kernel) and has no backward, but an input "
            "requires grad; for training use the chunked gated delta rule kernel or the reference "
            "(delta_rule_recurrent / delta_rule_chunked), or call this under torch.no_grad() / torch.inference_mode()"
        )
    check_inputs("recurrent_gated_delta_rule", q, k, v, g, beta, resets, initial_state)
    o, final = torch.ops.hybridtron.recurrent_gated_delta_rule_fwd(q, k, v, g, beta, resets, initial_state,
                                                                   output_final_state)
    return o, (final if output_final_state else None)
