"""Gated DeltaNet mixer ("Gated Delta Networks", Yang et al.) in transformers' Qwen3.5 layout.

    [q | k | v] = SiLU(causal depthwise conv(x W_qkv))      in_proj_qkv, conv1d
    z = x W_z,  b = x W_b,  a = x W_a                       in_proj_z, in_proj_b, in_proj_a
    beta = sigmoid(b)   (2 sigmoid(b) with model.deltanet.neg_eigval: eigenvalues in (-1, 1))
    g = -exp(A_log) * softplus(a + dt_bias)                 per value head, log decay <= 0
    o = delta_rule(q, k, v, g, beta)                        kernels/gated_delta_rule (q, k L2-normalised inside)
    y = W_out (RMSNorm(o) * silu(z))                        norm (gain init 1, per value head), out_proj

Heads: n_k_heads query/key heads of k_head_dim, n_v_heads value heads of v_head_dim (a multiple of the
key heads: grouped value attention). DeltaProduct (model.deltanet.n_householder = n_h > 1) widens
in_proj_qkv to [q | k_1 .. k_nh | v_1 .. v_nh] (each k_j key_dim wide, each v_j value_dim wide, sub-step
major) and in_proj_b to n_h * n_v_heads; with n_h = 1 every shape and name is Qwen3.5's.

Packed documents (doc_ids): the recurrent state is zeroed where a document starts, and the convolution
at position t reads only inputs of t's own document. Decoding (a cache dict per layer) keeps the last
conv_size - 1 convolution inputs and the recurrent state, so a new token costs O(1) in the context; a call
continues the cached document (x's first position never starts one): the cached inputs and state feed x's
first document only, and the cache keeps no input of a document before x's last.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.configs import ModelConfig
from hybridtron.kernels.gated_delta_rule import gated_delta_rule
from hybridtron.kernels.short_conv import causal_conv, short_conv
from hybridtron.model.attention import doc_starts
from hybridtron.model.hax import HAX
from hybridtron.model.linear import make_linear
from hybridtron.model.norm import RMSNorm
from hybridtron.model.scale import norm_kwargs


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.deltanet
        self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim = d.resolved(cfg)
        self.n_h = d.n_householder
        self.neg_eigval = d.neg_eigval
        self.chunk_size = d.chunk_size
        self.algo = d.algo
        self.key_dim = self.n_k_heads * self.k_head_dim
        self.value_dim = self.n_v_heads * self.v_head_dim
        self.conv_dim = self.key_dim * (1 + self.n_h) + self.value_dim * self.n_h
        self.in_proj_qkv = make_linear(cfg, cfg.d_model, self.conv_dim, after_norm=True)
        self.in_proj_z = make_linear(cfg, cfg.d_model, self.value_dim, after_norm=True)
        self.in_proj_b = make_linear(cfg, cfg.d_model, self.n_h * self.n_v_heads, after_norm=True)
        self.in_proj_a = make_linear(cfg, cfg.d_model, self.n_v_heads, after_norm=True)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d.conv_size, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.n_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.n_v_heads))
        # The gated output norm always has a plain gain initialised to 1 (Qwen3.5's RMSNormGated), whatever
        # model.norm_type says; it feeds out_proj, so the scale-vector decay rule treats it as an Input-Norm.
        self.norm = RMSNorm(self.v_head_dim, cfg.norm_eps, zero_centered=False, **norm_kwargs(cfg, feeds_linear=True))
        self.out_proj = make_linear(cfg, self.value_dim, cfg.d_model, residual_out=True)
        # A decay rate and a time-step bias are not weights to shrink: decaying A_log towards 0 would pull
        # every head towards the same forgetting rate (Mamba-2 and GDN exclude both).
        self.param_decay = {"A_log": False, "dt_bias": False}
        self.context_parallel = None  # set from outside under context parallelism (train/parallel/context_parallel.py)
        self.conv_backend = cfg.kernels.conv  # conv + SiLU: kernels/short_conv (the reference is causal_conv)
        self.delta_rule_backend = cfg.kernels.delta_rule  # kernels/gated_delta_rule (beside its torch reference)
        # model.deltanet.sparse_attention: HAX's sparse attention over the values, added before the gated norm
        self.hax = HAX(cfg, self.value_dim) if d.sparse_attention != "none" else None

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """A_log, dt_bias and the convolution (the projections and the norm are initialised by the LM).

        A ~ U(1, 16) as in Mamba-2; the time step dt ~ log-uniform on [1e-3, 1e-1] (floored at 1e-4) and
        dt_bias = softplus^-1(dt) = dt + log(-expm1(-dt)), so softplus(a + dt_bias) starts at dt for a = 0.
        The convolution gets nn.Conv1d's own default, U(-1/sqrt(K), 1/sqrt(K)) (fan-in K per channel):
        a depthwise filter of width 4 then keeps the input's scale, where N(0, 0.02) would shrink q, k, v
        by ~25x before the L2 norm and the value path by as much."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = (torch.rand_like(self.dt_bias) * (hi - lo) + lo).exp().clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        bound = 1.0 / math.sqrt(self.conv1d.kernel_size[0])
        self.conv1d.weight.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, cache: dict | None = None) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model). doc_ids (B, T): no state or convolution crosses a
        document start. cache: this layer's decoding state ({} at the first call), extended in place."""
        B, T, _ = x.shape
        Hk, Hv, Dk, Dv, n_h = self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim, self.n_h
        mixed = self.in_proj_qkv(x)  # (B, T, conv_dim)
        past = None if cache is None else cache.get("conv_state")
        cp = self.context_parallel if cache is None else None  # x is one piece of each sequence
        if cp is not None:  # the convolution window reaches into the chunk before each of the rank's two
            K = self.conv1d.kernel_size[0]
            x2, ids = cp.conv_input(mixed, doc_ids, K - 1)
            conv_out = cp.unstack(F.silu(causal_conv(x2, self.conv1d.weight, ids)[:, K - 1:]))
        else:
            conv_out = short_conv(mixed, self.conv1d.weight, doc_ids, past, backend=self.conv_backend)
        if cache is not None:
            K = self.conv1d.kernel_size[0]
            seen = mixed if past is None else torch.cat([past, mixed], dim=1)
            def last(t):  # the last K - 1 positions (none for K = 1, where t[:, -0:] would keep all)
                return t[:, t.shape[1] - (K - 1):]

            state = last(torch.cat([seen.new_zeros(B, K - 1, self.conv_dim), seen], dim=1))
            if doc_ids is not None:  # the next call continues x's last document: it must not read an earlier one's
                ids = last(torch.cat([doc_ids[:, :1].repeat(1, K - 1), doc_ids], dim=1))  # past: x's first
                state = state.masked_fill((ids != doc_ids[:, -1:])[..., None], 0)
            cache["conv_state"] = state
        q, k, v = conv_out.split([self.key_dim, n_h * self.key_dim, n_h * self.value_dim], dim=-1)
        q = q.view(B, T, Hk, Dk)
        k = k.view(B, T, n_h, Hk, Dk)
        v = v.view(B, T, n_h, Hv, Dv)
        f32 = torch.promote_types(x.dtype, torch.float32)  # gates in fp32 at least (fp64 stays fp64: tests)
        beta = torch.sigmoid(self.in_proj_b(x).to(f32)).view(B, T, n_h, Hv)
        if self.neg_eigval:
            beta = 2.0 * beta
        g = -self.A_log.to(f32).exp() * F.softplus(self.in_proj_a(x).to(f32) + self.dt_bias.to(f32))  # (B, T, Hv)
        resets = doc_starts(doc_ids) if doc_ids is not None else None
        state = None if cache is None else cache.get("recurrent_state")
        rule = functools.partial(gated_delta_rule, chunk_size=self.chunk_size, backend=self.delta_rule_backend,
                                 algo="recurrent" if self.algo == "recurrent" or (cache is not None and T == 1)
                                 else "chunked")
        if cp is not None:  # the state comes from the chunks before and goes on to the ones after
            o = cp.delta_rule(rule, q, k, v, g, beta, None if doc_ids is None else cp.chunk_resets(doc_ids))
        else:
            o, state = rule(q, k, v, g, beta, resets=resets, initial_state=state, output_final_state=cache is not None)
        if cache is not None:
            cache["recurrent_state"] = state
        if self.hax is not None:  # model/hax.py; values of the first Householder sub-step
            if cp is not None:
                raise ValueError("model.deltanet.sparse_attention does not run under context parallelism (the config "
                                 "refuses it when it loads); set it to none or train without context parallelism")
            o = o + self.hax(v[:, :, 0].reshape(B, T, self.value_dim), doc_ids, cache).view(B, T, Hv, Dv).to(o.dtype)
        z = self.in_proj_z(x).view(B, T, Hv, Dv)
        o = self.norm.gated(o, z).to(x.dtype)  # gated RMSNorm per value head: norm(o) * silu(z), one kernel
        return self.out_proj(o.reshape(B, T, self.value_dim))
