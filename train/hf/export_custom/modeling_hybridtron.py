"""Modeling code of a hybridtron export that needs custom code (written by ``hybridtron export``).

The model is transformers' Qwen3.5 text model (``Qwen3_5ForCausalLM``: gated attention, SwiGLU,
zero-centred RMSNorms, partial rotary, the hybrid conv/recurrent/KV cache) with two modules replaced:
the feed-forward of MoE layers (`HybridtronSparseMoeBlock`, below) and the Gated DeltaNet mixer, which
here also has

- negative eigenvalues (``config.linear_allow_neg_eigval``): beta = 2 sigmoid(b), in (0, 2);
- DeltaProduct (``config.linear_num_householder`` = n_h > 1): per token one decay, then n_h delta-rule
  steps with their own key, value and beta; the token's output is read after its last step.

- HAX (``config.linear_sparse_attention``, Zhan et al. 2025): a single-head sparse attention over the
  mixer's values, added to the delta-rule output before the gated norm (`HybridtronHAX`, below).

Weight names are Qwen3.5's. DeltaProduct widens three tensors: ``in_proj_qkv`` (and the depthwise
``conv1d`` over its output) produce [q | k_1 .. k_nh | v_1 .. v_nh], each k_j key_dim wide and each v_j
value_dim wide, and ``in_proj_b`` produces n_h * num_value_heads betas, step-major. With n_h = 1 and
beta = sigmoid(b) the mixer computes what Qwen3.5's does.

Per value head, state S (Dk, Dv), L2-normalised q and k, log decay g <= 0:
    S <- exp(g) S,   then for each step j:   S <- S + beta_j k_j (v_j - S^T k_j)^T,   o = S^T q / sqrt(Dk)

The delta rule runs in plain torch (float32): a chunked form for prompts and a step-by-step form for
one-token decoding. The states live in transformers' own cache (per layer, the last conv_kernel_size
convolution inputs and the recurrent state), so ``generate`` works as it does for Qwen3.5. A model
without full-attention layers gets `HybridtronTextModel`, Qwen3.5's text model minus its one need for
one (the decoded length, which only an attention layer's cache knows), so it decodes with the cache too.

HAX, with x the post-convolution values of the first delta step (B, T, value_dim), one head of width
D = ``linear_sparse_dim`` (weights ``linear_attn.hax.*``):
    [q | k] = x qk_proj                    out_t = softmax over S_t of (q_t . k_j / sqrt(D)) -> sum_j p_tj x_j
    o = delta_rule(...) + out_scale * out
S_t holds at most ``linear_sparse_keys`` positions j <= t, half from each source of "hax" (the whole budget
for "lsh" / "key_selection" alone; a key both choose counts once):
- LSH: the latest keys of q_t's bucket. bucket(y) = the sign bits of normalise(y - mean of the earlier
  vectors of its kind (queries or keys)) @ lsh_proj, lsh_proj a fixed random (D, lsh_bits) buffer saved
  with the weights;
- key selection: the best by score_j = scorer([k_j | normalise(sum of q_1 .. q_j)]), an MLP;
- window ("window"): the latest positions t, t-1, ...
Cached decoding keeps every key, value, bucket and score so far and the running sums, so a cached call
chooses the keys the full forward would. Padding (``attention_mask`` 0) is never a key and is left out of
the running means. The whole input is one document: hybridtron's training-time document boundaries
(packed sequences) have no counterpart here, as for the recurrent state.

MoE layers (``config.num_experts`` > 0, all but ``config.mlp_only_layers``), with Qwen3.5-MoE's weight
names (``mlp.gate.weight`` the router (E, d); ``mlp.experts.gate_up_proj`` (E, 2I, d), gate rows first,
and ``mlp.experts.down_proj`` (E, d, I); ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``) and
what Qwen3.5-MoE lacks:
    scores = softmax or sigmoid(router(x)) in float32                 (config.moe_router)
    chosen = top_k(scores + expert_bias)    expert_bias only when config.moe_router_bias_update_rate > 0
    w      = scores[chosen], renormalised to sum 1 when config.norm_topk_prob
    y      = sum_j w_j expert_{chosen_j}(x) [+ sigmoid(shared_expert_gate(x)) shared_expert(x)]

This file imports only torch and transformers: it is loaded with ``trust_remote_code=True`` from the
model directory, where the hybridtron package need not be installed.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen35

from .configuration_hybridtron import SPARSE_SOURCES, HybridtronConfig


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def as_steps(q, k, v, g, beta):
    """Per-token inputs -> one sequence of T * n_h delta steps, heads first.

    q (B, T, H, Dk); k (B, T, n_h, H, Dk); v (B, T, n_h, H, Dv); g (B, T, H); beta (B, T, n_h, H).
    A token's query sits at its last step (zero elsewhere: nothing is read there), its decay at its first
    (zero elsewhere). Returns q, k (B, H, L, Dk), v (B, H, L, Dv), g, beta (B, H, L) with L = T * n_h."""
    B, T, n_h, H, Dk = k.shape
    q_steps = q.new_zeros(B, T, n_h, H, Dk)
    q_steps[:, :, -1] = q
    g_steps = g.new_zeros(B, T, n_h, H)
    g_steps[:, :, 0] = g

    def flat(x):  # (B, T, n_h, H, ...) -> (B, H, T * n_h, ...)
        return x.reshape(B, T * n_h, *x.shape[3:]).transpose(1, 2)

    return flat(q_steps), flat(k), flat(v), flat(g_steps), flat(beta)


def delta_rule_stepwise(q, k, v, g, beta, state):
    """The recurrence one step at a time (decoding). Shapes as `as_steps` returns them; state (B, H, Dk, Dv).
    Returns the outputs (B, H, L, Dv) and the final state."""
    outs = []
    for t in range(k.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        k_t = k[:, :, t]
        written = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, state))
        state = state + k_t[..., None] * written[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    return torch.stack(outs, dim=2), state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence over chunks of ``chunk`` steps: inside a chunk the writes solve one unit
    lower-triangular system (the WY / UT form), and only the state passes from chunk to chunk.

    With S0 the state entering a chunk, G the in-chunk cumulative log decay and D_ij = exp(G_i - G_j)
    for j <= i, the writes w_i = beta_i (v_i - k_i^T S_i) satisfy
        w + strict_lower(beta_i D_ij k_i^T k_j) w = beta v - (beta exp(G) k) S0,
    the outputs are o_i = exp(G_i) q_i^T S0 + sum_{j <= i} D_ij (q_i^T k_j) w_j, and the state leaving
    the chunk is exp(G_last) S0 + sum_j exp(G_last - G_j) k_j w_j^T."""
    B, H, L, Dk = k.shape
    pad = (-L) % chunk
    if pad:  # padded steps read nothing, write nothing and decay nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (L + pad) // chunk
    q, k, v, g, beta = (x.reshape(B, H, N, chunk, *x.shape[3:]) for x in (q, k, v, g, beta))
    G = g.cumsum(-1)  # (B, H, N, C)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # D: (B, H, N, C, C)
    k_beta = k * beta[..., None]
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + eye
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_in = q * G.exp()[..., None]
    k_out = k * (G[..., -1:] - G).exp()[..., None]
    outs = []
    for n in range(N):
        written = u[:, :, n] - w[:, :, n] @ state  # (B, H, C, Dv)
        outs.append(q_in[:, :, n] @ state + scores[:, :, n] @ written)
        state = state * G[:, :, n, -1, None, None].exp() + k_out[:, :, n].transpose(-1, -2) @ written
    return torch.stack(outs, dim=2).reshape(B, H, N * chunk, -1)[:, :, :L], state


# ---- HAX: sparse attention inside the mixer (config.linear_sparse_attention) ------------------------------
def gathered_attention(q, k, v, idx, scale: float):
    """Query t of row b attends to the keys idx[b, t, :] (positions into k and v; -1: an empty slot): softmax
    over the non-empty slots of scale * q . k, weights times v. q (B, T, D), k (B, N, D), v (B, N, E),
    idx (B, T, S) -> (B, T, E) in q's dtype, computed in float32 at least; a query without keys gets zeros."""
    B, T, S = idx.shape
    f = torch.promote_types(q.dtype, torch.float32)
    flat = idx.clamp(min=0).reshape(B, T * S, 1)
    kg = k.to(f).gather(1, flat.expand(B, T * S, k.shape[-1])).view(B, T, S, -1)
    vg = v.to(f).gather(1, flat.expand(B, T * S, v.shape[-1])).view(B, T, S, -1)
    logits = (torch.einsum("btd,btsd->bts", q.to(f), kg) * scale).masked_fill(idx < 0, float("-inf"))
    m = logits.amax(-1, keepdim=True).clamp(min=torch.finfo(f).min)  # no key: every weight exp(-inf) = 0
    p = (logits - m).exp()
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(f).tiny)
    return torch.einsum("bts,btse->bte", p, vg).to(q.dtype)


@torch.no_grad()
def choose_keys(sources, n: int, T: int, live, bucket=None, q_bucket=None, score=None, chunk: int = 256):
    """(B, T, n * len(sources)) key positions for the queries, the last T of the N keys; -1 for an empty slot,
    no position twice in a row. live (B, N) bool: False at padding, never a key. The query at position p
    reads keys j <= p, per source: "window" the positions p, p-1, .., p-n+1 (the live ones), "lsh" the n
    latest keys whose bucket (B, N; -1 at padding) is the query's (q_bucket (B, T)), "key_selection" the
    n best by score (B, N) that an earlier source did not choose."""
    B, N = live.shape
    dev = live.device
    p = torch.arange(N - T, N, device=dev)  # the queries' positions
    back = torch.arange(n, device=dev)

    def take(x, pos):  # x (B, N) at positions pos (B, T, n)
        return x.gather(1, pos.reshape(B, -1)).view(pos.shape)

    parts = []
    for src in sources:
        if src == "window":
            j = (p[:, None] - back).expand(B, T, n)
            ix = torch.where((j >= 0) & take(live, j.clamp(min=0)), j, -1)
        elif src == "lsh":  # sorted by (bucket, position), q's bucket is one run; its entries <= p end at `end`
            order_key, order = (bucket * N + torch.arange(N, device=dev)).sort(dim=1)
            end = torch.searchsorted(order_key, q_bucket * N + p, right=True) - 1
            at = end[..., None] - back  # the run's last n entries, latest first
            j = take(order, at.clamp(min=0))
            ix = torch.where((at >= 0) & (take(bucket, j) == q_bucket[..., None]), j, -1)
        else:
            pieces, pos = [], torch.arange(N, device=dev)
            for a in range(0, T, chunk):  # (B, chunk, N) candidates at a time
                ok = (pos <= p[a : a + chunk, None]) & live[:, None, :]
                val, j = torch.where(ok, score.float()[:, None, :], float("-inf")).topk(min(n, N), dim=-1)
                pieces.append(F.pad(torch.where(val > float("-inf"), j, -1), (0, n - j.shape[-1]), value=-1))
            ix = torch.cat(pieces, 1)
            for prev in parts:  # a key another source chose counts once
                ix = ix.masked_fill((ix[..., :, None] == prev[..., None, :]).any(-1), -1)
        parts.append(ix)
    return torch.cat(parts, -1)


class HybridtronHAX(nn.Module):
    """The sparse attention branch of one Gated DeltaNet mixer (see the module docstring)."""

    def __init__(self, config: HybridtronConfig, value_dim: int):
        super().__init__()
        self.sources = SPARSE_SOURCES[config.linear_sparse_attention]
        self.n_per = config.linear_sparse_keys // len(self.sources)
        self.dim = config.linear_sparse_dim or config.linear_key_head_dim
        self.n_bits = config.linear_lsh_bits
        self.qk_proj = nn.Linear(value_dim, 2 * self.dim, bias=False)
        self.out_scale = nn.Parameter(torch.ones(value_dim))
        if "lsh" in self.sources:  # fixed, not trained: saved with the weights so that every copy hashes alike
            self.register_buffer("lsh_proj", torch.randn(self.dim, self.n_bits))
        if "key_selection" in self.sources:
            w = 2 * self.dim
            self.scorer = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                                        nn.Linear(w, 1, bias=False))

    def bucket(self, y, running_sum, count):
        """y centred by the mean of the earlier vectors of its kind (0 at the first one), normalised, projected:
        the sign bits as one integer."""
        earlier = count - 1
        mean = torch.where(earlier > 0, (running_sum - y) / earlier.clamp(min=1), 0.0)
        c = F.normalize(y - mean, dim=-1)
        bits = (c @ self.lsh_proj.to(c.dtype)) > 0
        return (bits.long() << torch.arange(self.n_bits, device=y.device)).sum(-1)

    def forward(self, x, live=None, past: dict | None = None):
        """x (B, T, value_dim); live (B, T) bool (False: padding) or None; past: the state this returned for the
        tokens before x, or None. -> (out_scale * attention (B, T, value_dim), the state after x)."""
        B, T, _ = x.shape
        D = self.dim
        f = torch.promote_types(x.dtype, torch.float32)
        q, k = self.qk_proj(x).split(D, dim=-1)
        if live is None:
            live = torch.ones(B, T, dtype=torch.bool, device=x.device)
        new = {"k": k, "v": x, "live": live}
        q_bucket = sums = None
        if "lsh" in self.sources or "key_selection" in self.sources:  # running [count | sum q | sum k]
            run = (torch.cat([x.new_ones(B, T, 1, dtype=f), q.to(f), k.to(f)], -1) * live[..., None]).cumsum(1)
            if past is not None:
                run = run + past["sums"][:, None].to(run.dtype)
            sums = run[:, -1]
            count, qsum, ksum = run.split([1, D, D], -1)
        if "lsh" in self.sources:
            q_bucket = self.bucket(q.to(f), qsum, count)
            new["bucket"] = self.bucket(k.to(f), ksum, count).masked_fill(~live, -1)
        if "key_selection" in self.sources:
            new["score"] = self.scorer(torch.cat([k, F.normalize(qsum, dim=-1).to(k.dtype)], -1)).squeeze(-1)
        keys = new if past is None else {name: torch.cat([past[name], t], 1) for name, t in new.items()}
        idx = choose_keys(self.sources, self.n_per, T, keys["live"], keys.get("bucket"), q_bucket, keys.get("score"))
        out = gathered_attention(q, keys["k"], keys["v"], idx, D**-0.5)
        state = {name: t.detach() for name, t in keys.items()}
        if sums is not None:
            state["sums"] = sums.detach()
        return out * self.out_scale.to(out.dtype), state


class HybridtronGatedDeltaNet(nn.Module):
    """Qwen3.5's Gated DeltaNet mixer with negative eigenvalues, DeltaProduct and HAX (see the module docstring)."""

    chunk_size = 64  # delta steps per chunk of the prompt form

    def __init__(self, config: HybridtronConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_householder = config.linear_num_householder
        self.allow_neg_eigval = config.linear_allow_neg_eigval
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        n_h, d = self.num_householder, config.hidden_size
        self.conv_dim = self.key_dim * (1 + n_h) + self.value_dim * n_h
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, n_h * self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(1.0, 16.0).log())
        self.norm = qwen35.Qwen3_5RMSNormGated(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)
        self.hax = HybridtronHAX(config, self.value_dim) if config.linear_sparse_attention != "none" else None

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        # ``cache``: transformers' Cache (5.24's name; the decoder layer passes it by keyword), None without one.
        x = hidden_states
        if attention_mask is not None:  # (B, T) padding mask: a padded position writes nothing into the state
            x = x * attention_mask[:, :, None].to(x.dtype)
        B, T, _ = x.shape
        K, n_h = self.conv_kernel_size, self.num_householder
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim

        mixed = self.in_proj_qkv(x).transpose(1, 2)  # (B, conv_dim, T)
        state = None
        if cache is not None:
            state = cache.get_recurrent_state(self.layer_idx)  # None before the first call (or a reset)
            # Stores the last K inputs and returns the ones the convolution needs: those kept, then these.
            mixed = cache.update_conv_state(mixed, self.layer_idx, conv_kernel_size=K)
        fresh = state is None  # (the HAX branch then starts anew too)
        conv = self.conv1d(F.pad(mixed, (K - 1, 0)))[..., -T:]  # causal: output t reads inputs t-K+1 .. t
        conv = F.silu(conv).transpose(1, 2)  # (B, T, conv_dim)
        q, k, v = conv.split([self.key_dim, n_h * self.key_dim, n_h * self.value_dim], dim=-1)
        hax_input = v[..., : self.value_dim]  # the values of the first delta step

        f32 = torch.promote_types(x.dtype, torch.float32)
        q = l2_normalize(q.reshape(B, T, Hk, Dk).to(f32)) * Dk**-0.5
        k = l2_normalize(k.reshape(B, T, n_h, Hk, Dk).to(f32))
        v = v.reshape(B, T, n_h, Hv, Dv).to(f32)
        if Hv != Hk:  # grouped values: key head h serves value heads h*r .. h*r + r - 1
            q, k = q.repeat_interleave(Hv // Hk, dim=-2), k.repeat_interleave(Hv // Hk, dim=-2)
        beta = self.in_proj_b(x).to(f32).sigmoid().reshape(B, T, n_h, Hv)
        if self.allow_neg_eigval:
            beta = 2.0 * beta
        g = -self.A_log.to(f32).exp() * F.softplus(self.in_proj_a(x).to(f32) + self.dt_bias.to(f32))  # (B, T, Hv)

        state = x.new_zeros(B, Hv, Dk, Dv, dtype=f32) if state is None else state.to(f32)
        steps = as_steps(q, k, v, g, beta)
        if T == 1:
            o, state = delta_rule_stepwise(*steps, state)
        else:
            o, state = delta_rule_chunked(*steps, state, self.chunk_size)
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)
        o = o[:, :, n_h - 1 :: n_h].transpose(1, 2)  # (B, T, Hv, Dv): each token's last step
        if self.hax is not None:  # its state: per layer in ``hybridtron_hax``, a dict set on transformers' cache
            if cache is not None and not hasattr(cache, "hybridtron_hax"):
                cache.hybridtron_hax = {}
            past = None if cache is None or fresh else cache.hybridtron_hax.get(self.layer_idx)
            live = None if attention_mask is None else attention_mask.bool()
            extra, hax_state = self.hax(hax_input, live, past)
            if cache is not None:
                cache.hybridtron_hax[self.layer_idx] = hax_state
            o = o + extra.view(B, T, Hv, Dv).to(o.dtype)

        z = self.in_proj_z(x).reshape(B, T, Hv, Dv)
        o = self.norm(o.to(x.dtype), z)  # RMSNorm per value head, gated by silu(z)
        return self.out_proj(o.reshape(B, T, self.value_dim))


class HybridtronExperts(nn.Module):
    """E SwiGLU experts as two stacked weights (Qwen3.5-MoE's layout)."""

    def __init__(self, config: HybridtronConfig):
        super().__init__()
        E, d, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inner, d))
        self.down_proj = nn.Parameter(torch.empty(E, d, inner))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, d); idx, weights (N, k): each token's chosen experts and their weights."""
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            token, slot = (idx == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return out


class HybridtronSparseMoeBlock(nn.Module):
    """Top-k token-choice MoE with softmax or sigmoid scores and the auxiliary-loss-free router bias (see the
    module docstring)."""

    def __init__(self, config: HybridtronConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.router = config.num_experts_per_tok, config.norm_topk_prob, config.moe_router
        self.use_bias = config.moe_router_bias_update_rate > 0
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = HybridtronExperts(config)
        if self.use_bias:  # saved with the weights: it chooses the experts
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = qwen35.Qwen3_5MLP(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, d) -> the chosen experts (N, k) and their weights (N, k), in float32."""
        f32 = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(f32), self.gate.weight.to(f32))
        scores = logits.softmax(-1) if self.router == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias.to(f32) if self.use_bias else scores
        idx = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, idx)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        idx, weights = self.route(x)
        out = self.experts(x, idx, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


class HybridtronTextModel(qwen35.Qwen3_5TextModel):
    """Qwen3.5's text model for configs without full-attention layers. Qwen3.5's own forward asks an attention
    layer's cache for the length decoded so far (for the rotary positions and the causal mask), and with none
    it fails on every cached call; no layer here reads either, so this passes arange positions and the
    linear layers' padding mask directly."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        if not isinstance(attention_mask, dict):
            if inputs_embeds is None:
                inputs_embeds, input_ids = self.embed_tokens(input_ids), None
            B, T = inputs_embeds.shape[:2]
            if position_ids is None:
                position_ids = torch.arange(T, device=inputs_embeds.device).expand(B, T)
            if attention_mask is not None and (attention_mask.ndim != 2 or T == 1 or bool((attention_mask == 1).all())):
                attention_mask = None  # (Qwen3.5's rule: single tokens and unpadded batches are not masked)
            attention_mask = {"linear_attention": None if attention_mask is None else attention_mask[:, -T:]}
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               inputs_embeds=inputs_embeds, **kwargs)


class HybridtronForCausalLM(qwen35.Qwen3_5ForCausalLM):
    """Qwen3_5ForCausalLM whose linear-attention layers are `HybridtronGatedDeltaNet` (with `HybridtronHAX` when
    configured) and whose MoE layers' feed-forwards are `HybridtronSparseMoeBlock`."""

    config_class = HybridtronConfig

    def __init__(self, config: HybridtronConfig):
        super().__init__(config)
        # Qwen3.5's own mixers are built first and replaced here (free on the meta device from_pretrained
        # builds on); every other module, and the forward of every layer, stays transformers'.
        if "full_attention" not in config.layer_types:
            self.model = HybridtronTextModel(config)
        for i, layer in enumerate(self.model.layers):
            if config.layer_types[i] == "linear_attention":
                layer.linear_attn = HybridtronGatedDeltaNet(config, i)
            if config.is_moe_layer(i):
                layer.mlp = HybridtronSparseMoeBlock(config)
        self.post_init()

    def _reorder_cache(self, cache, beam_idx):
        """Beam search (transformers' generate calls this when the model has it): the cache's own states, then
        the HAX branches', which the cache carries as ``hybridtron_hax`` without knowing them."""
        cache.reorder_cache(beam_idx)
        hax = getattr(cache, "hybridtron_hax", {})
        for i, state in hax.items():
            hax[i] = {name: t.index_select(0, beam_idx.to(t.device)) for name, t in state.items()}
        return cache

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, HybridtronGatedDeltaNet):  # the projections and the conv are generic modules
            init.ones_(module.dt_bias)
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).log_())
        elif isinstance(module, HybridtronHAX):  # the projection and the scorer are generic modules
            init.ones_(module.out_scale)
            if "lsh" in module.sources:
                init.normal_(module.lsh_proj)
        elif isinstance(module, HybridtronExperts):
            init.normal_(module.gate_up_proj, std=self.config.initializer_range)
            init.normal_(module.down_proj, std=self.config.initializer_range)
        elif isinstance(module, HybridtronSparseMoeBlock) and module.expert_bias is not None:
            init.zeros_(module.expert_bias)


__all__ = ["HybridtronForCausalLM", "HybridtronGatedDeltaNet", "HybridtronHAX", "HybridtronSparseMoeBlock"]
