"""The gated delta rule in pure torch: the token-by-token recurrence and the chunked (WY / UT) form.

These are the references the Triton kernels beside this file (chunk.py, recurrent.py) are measured against,
and the model's ``reference`` backend (model/delta_rule.py re-exports them). Per value head, with state S of
shape (Dk, Dv), L2-normalised q_t and k_t, decay g_t <= 0 (log space) and write strength beta_t:

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T        (Gated DeltaNet, Yang et al.)
    o_t = S_t^T q_t / sqrt(Dk)

written in the (Dk, Dv) convention, where the transition acts from the left: S_t = (I - beta_t k_t
k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T. beta in (0, 2) (negative eigenvalues, Grazzi et al.) needs
no change here: the caller scales beta.

DeltaProduct (Siems et al.) takes n_h (k, v, beta) triples per token: the decay applies once, then n_h
delta steps, and the output is read after the last. Both forms run it as a sequence n_h times longer
(decay only at each token's first sub-step, queries only at its last), so one algorithm serves both.

Document resets (packed sequences): ``resets[b, t]`` True zeroes the state before token t, so nothing
crosses a document boundary. The chunked form handles a reset inside a chunk exactly, by masking the
decays between positions of different segments and the carried state after a reset (a large negative
g would do it only approximately: in fp32 a cumulative sum of -1e4 and a decay of 0.01 keeps three
significant digits of the latter).

Heads: q and k have Hk heads, v, g and beta Hv (grouped value attention); query/key head h serves value
heads h*r .. h*r + r - 1 with r = Hv / Hk, the grouping of transformers' Qwen3.5.

Shapes: q (B, T, Hk, Dk); k (B, T, n_h, Hk, Dk); v (B, T, n_h, Hv, Dv); g (B, T, Hv);
beta (B, T, n_h, Hv); resets (B, T) bool; initial_state (B, Hv, Dk, Dv). Returns o (B, T, Hv, Dv) in q's
dtype and the final state (fp32 at least) or None. Computation is in fp32 at least (fp64 stays fp64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the eps placement of fla and transformers' Qwen3.5)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, resets, initial_state):
    """Normalise, scale and flatten DeltaProduct sub-steps into one sequence of length T * n_h,
    with value heads first: (B, H, L, D) tensors and (B, H, L) gates."""
    B, T, n_h, Hk, Dk = k.shape
    Hv = v.shape[-2]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    dtype = torch.promote_types(q.dtype, torch.float32)
    r = Hv // Hk
    q = l2_normalize(q.to(dtype)) * Dk**-0.5
    k = l2_normalize(k.to(dtype))
    if r > 1:
        q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
    L = T * n_h
    # Queries only at each token's last sub-step, decay only at its first, reset before its first.
    qe = q.new_zeros(B, T, n_h, Hv, Dk)
    qe[:, :, -1] = q
    ge = g.new_zeros(B, T, n_h, Hv, dtype=dtype)
    ge[:, :, 0] = g.to(dtype)
    re = None
    if resets is not None:
        re = torch.zeros(B, T, n_h, dtype=torch.bool, device=resets.device)
        re[:, :, 0] = resets.bool()
        re = re.reshape(B, L)

    def heads_first(x):  # (B, T, n_h, H, ...) -> (B, H, L, ...)
        return x.reshape(B, L, *x.shape[3:]).transpose(1, 2)

    S0 = None if initial_state is None else initial_state.to(dtype)
    return (heads_first(qe), heads_first(k), heads_first(v.to(dtype)), heads_first(ge),
            heads_first(beta.to(dtype)), re, S0)


def _finish(o: torch.Tensor, n_h: int, out_dtype: torch.dtype) -> torch.Tensor:
    """(B, H, L, Dv) -> (B, T, H, Dv): the output at each token's last sub-step."""
    B, H, L, Dv = o.shape
    return o.view(B, H, L // n_h, n_h, Dv)[:, :, :, -1].transpose(1, 2).to(out_dtype)


def delta_rule_recurrent(
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
    """The token-by-token recurrence (see the module docstring for shapes); O(T) sequential steps."""
    n_h, out_dtype = k.shape[2], q.dtype
    q, k, v, g, beta, resets, S = _prepare(q, k, v, g, beta, resets, initial_state)
    B, H, L, Dk = k.shape
    if S is None:
        S = q.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for t in range(L):
        if resets is not None:
            S = S * (~resets[:, t]).to(S.dtype)[:, None, None, None]
        S = S * g[:, :, t].exp()[..., None, None]  # decay first: S' = exp(g) S
        k_t = k[:, :, t]  # (B, H, Dk)
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)  # what the state already says for k_t
        delta = beta[:, :, t, None] * (v[:, :, t] - pred)  # (B, H, Dv)
        S = S + k_t[..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return _finish(torch.stack(outs, dim=2), n_h, out_dtype), (S if output_final_state else None)


def delta_rule_chunked(
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
    """The chunked form: within a chunk of C steps the C delta updates are solved at once (a unit
    lower-triangular system, the UT transform of the WY representation), and only the state passes
    from chunk to chunk, so the sequential depth is T / C and the work is matmuls.

    Within a chunk, with S0 the state entering it, Gamma_ij = exp(G_i - G_j) (G the in-chunk cumulative
    log decay) when i and j lie in the same document segment and Gamma_i = exp(G_i) while no reset
    precedes i in the chunk, the writes delta_i = beta_i (v_i - k_i^T S'_i) solve
        (I + A) delta = beta v - (beta Gamma k) S0,   A_ij = beta_i Gamma_ij k_i^T k_j  (j < i),
    the outputs are o_i = Gamma_i q_i^T S0 + sum_{j <= i} Gamma_ij (q_i^T k_j) delta_j, and the state
    leaving the chunk is Gamma_end S0 + sum_j Gamma_{end, j} k_j delta_j^T."""
    n_h, out_dtype = k.shape[2], q.dtype
    q, k, v, g, beta, resets, S = _prepare(q, k, v, g, beta, resets, initial_state)
    B, H, L, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = (-L) % C
    if pad:  # padded steps write nothing (k = v = beta = 0) and decay nothing (g = 0)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        if resets is not None:
            resets = F.pad(resets, (0, pad))
    N = (L + pad) // C

    def chunks(x):  # (B, H, L', ...) -> (B, H, N, C, ...)
        return x.reshape(B, H, N, C, *x.shape[3:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    G = g.cumsum(-1)  # (B, H, N, C): log decay from the chunk start through step i
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if resets is None:
        same = causal
        from_start = None
    else:
        seg = resets.reshape(B, 1, N, C).long().cumsum(-1)  # segment id within the chunk; 0 = carried in
        same = causal & (seg[..., :, None] == seg[..., None, :])  # (B, 1, N, C, C)
        from_start = seg == 0  # (B, 1, N, C): the carried-in state still reaches step i
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~same, float("-inf"))
    decay = diff.exp()  # Gamma_ij: (B, H, N, C, C), zero above the diagonal and across segments
    decay_in = G.exp() if from_start is None else G.exp() * from_start  # Gamma_i
    decay_out = (G[..., -1:] - G).exp()  # to the chunk end ...
    if resets is not None:  # ... only for steps in the chunk's last segment
        decay_out = decay_out * (seg == seg[..., -1:])
    decay_all = decay_in[..., -1]  # the carried state's decay over the whole chunk: (B, H, N)

    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay  # beta_i Gamma_ij k_i^T k_j, lower triangle incl. diagonal
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    T_sys = A.tril(-1) + eye  # I + strictly lower part
    U = torch.linalg.solve_triangular(T_sys, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(T_sys, k_beta * decay_in[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # (B, H, N, C, C)
    q_in = q * decay_in[..., None]
    k_out = k * decay_out[..., None]

    if S is None:
        S = q.new_zeros(B, H, Dk, Dv)
    outs = []
    for n in range(N):
        delta = U[:, :, n] - W[:, :, n] @ S  # (B, H, C, Dv)
        outs.append(q_in[:, :, n] @ S + attn[:, :, n] @ delta)
        S = S * decay_all[:, :, n, None, None] + k_out[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, Dv)[:, :, :L]
    return _finish(o, n_h, out_dtype), (S if output_final_state else None)
