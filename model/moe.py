"""Dropless top-k token-choice mixture of SwiGLU experts, in transformers' Qwen3.5-MoE layout.

    scores = router(x)                      gate.weight (E, d); softmax or sigmoid, in fp32
    chosen = top_k(scores + expert_bias)    the bias (auxiliary-loss-free balancing) only picks experts
    w      = scores[chosen]                 renormalised to sum 1 when model.moe.norm_topk_prob
    y      = sum_j w_j expert_{chosen_j}(x) + sigmoid(shared_expert_gate(x)) shared_expert(x)
    expert_e(x) = down_e(silu(gate_e x) * up_e x)   experts.gate_up_proj (E, 2I, d) [gate rows, then up
                                                    rows], experts.down_proj (E, d, I)

Every token reaches all of its k experts (dropless: no capacity factor, nothing is dropped; the count
of dropped assignments is logged and is 0 by construction). Dispatch sorts the N*k (token, expert)
assignments by expert, so each expert's tokens are one contiguous slice, and runs the expert SwiGLUs
as grouped matmuls over those slices:

- ``native``: torch's grouped GEMM (``torch._grouped_mm``, CPU and CUDA) where the dtype and widths
  allow it (fp32/bf16/fp16, each row's width in bytes a multiple of 16, so the row strides are aligned;
  the experts' row offsets are not padded: whether CUDA's kernel wants them aligned for speed is for the
  GPU bench to show), else one matmul per expert slice;
- ``megablocks``: megablocks' grouped GEMM (``grouped_gemm.ops.gmm``, the kernel behind its dMoE) on
  CUDA, with the same routing, weights and layout.

Between the two grouped GEMMs the activation is one pass over the gate_up output (kernels/moe_gemm's packed
SwiGLU: it reads the [gate | up] halves where they lie and returns their gradient as one tensor), on the dense
SwiGLU's backend switch (``model.kernels.swiglu``). ``model.moe.gather`` says where the token rows are put
into expert order: ``permute`` (the default, the measured path) writes them with kernels/moe_permute and the
grouped GEMM reads them; ``gemm`` fuses that gather into the gate_up GEMM's operand loads (kernels/moe_gemm's
Triton grouped GEMM, on ``model.kernels.moe``'s switch; its backward computes dx as expert-ordered rows that the
permutation's combine kernel sums per token, and the weight gradient with the same gathered loads), so the
permuted (N k, d) rows are neither written nor kept for the backward. The down projection stays on
``model.moe.backend`` either way.

Precision: the router's logits, softmax/sigmoid and top-k are fp32 on purpose (autocast switched off for
them). Everything else runs in the compute dtype (``expert_dtype``): under bf16 autocast the token rows are
cast once, before the permutation (which then moves half the bytes), and the expert weights once per forward,
because autocast does not cover ``torch._grouped_mm`` and torch's CUDA grouped GEMM takes fp32 inputs to a
per-expert fp32 loop; under FSDP2's bf16 parameters the weights' dtype. The shared expert reads the same cast
rows.

No host synchronisation: the per-expert counts and the grouped GEMM's offsets stay on the device, and so do
the balance losses and load statistics (``metrics`` reads them once per optimizer step). Only megablocks'
gmm, the per-expert fallback and the expert-parallel all-to-all (its split sizes) need counts on the host.

`moe_reference` (a loop over experts with masks, no sorting) is the ground truth the tests compare both
with. Combining the k outputs of a token is a fixed-order sum, so results do not depend on atomics.

Balancing: the Switch-Transformer auxiliary loss ``E * sum_e f_e P_e`` (f_e the fraction of
assignments that went to expert e, P_e its mean router probability) times aux_loss_coef; the ST-MoE
router z-loss ``mean(logsumexp(logits)^2)`` times z_loss_coef; and DeepSeek-V3's auxiliary-loss-free
bias, moved after every optimizer step by ``bias_update_rate * sign(mean load - load_e)`` outside the
gradient (a persistent buffer, so it is checkpointed). The weighted losses of the last forward are in
``aux_loss``; GatedLM adds them to the loss.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.configs import ConfigError, ModelConfig
from hybridtron.kernels.backend import pick_for
from hybridtron.kernels.moe_gemm import gathered_linear, swiglu_packed
from hybridtron.kernels.moe_permute import moe_permute, moe_unpermute, sort_assignments
from hybridtron.model.mlp import SwiGLU

STATS = ("aux_loss", "z_loss", "dropped", "forwards")  # MoE._sums, summed over the micro-batches of a step
# model.moe.gather: where the token rows are put into expert order for the gate_up projection. "permute": a
# kernel writes the permuted rows (N k, d), then the grouped GEMM reads them (the measured default); "gemm": the
# gate_up GEMM loads them through the order itself (kernels/moe_gemm, Triton: model.kernels.moe), no permuted copy.
GATHERS = ("permute", "gemm")


def _no_autocast(device_type: str):
    """Autocast off for a deliberately fp32 computation (a no-op context where it is off already)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class Experts(nn.Module):
    """E SwiGLU experts as two stacked weights (transformers' Qwen3.5-MoE ``mlp.experts``)."""

    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.n_experts, self.d_model, self.hidden = n_experts, d_model, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=out_std)  # writes into the residual stream

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x (n, d) by plain matmuls, in x's dtype: the reference path."""
        gate, up = (x @ self.gate_up_proj[e].T.to(x.dtype)).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down_proj[e].T.to(x.dtype)


def _grouped_mm_ok(x: torch.Tensor, *widths: int) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all(w * x.element_size() % 16 == 0 for w in widths)


def expert_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the experts run in: autocast's where autocast is on for x's device (torch's autocast does not
    cover ``torch._grouped_mm``, so the layer casts itself; float64 stays float64, as autocast leaves it), else
    the expert weights' (FSDP2 gathers them in its param_dtype)."""
    dev = x.device.type
    if x.dtype != torch.float64 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, backend: str = "native",
                   counts: list[int] | None = None) -> torch.Tensor:
    """Row block e of x (rows offsets[e-1]:offsets[e], consecutive) times weight[e].T; weight (E, out, in) in x's
    dtype; offsets (E,) int32, the running row counts, on x's device.

    Where torch's grouped GEMM runs (``native``) the offsets stay on the device: no host synchronisation.
    megablocks' gmm and the per-expert fallback need the row counts on the host (``counts``, or one device-to-
    host copy of them here)."""
    if backend != "megablocks" and _grouped_mm_ok(x, weight.shape[1], weight.shape[2]):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    if counts is None:
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
    if backend == "megablocks":
        from grouped_gemm.ops import gmm  # megablocks' grouped GEMM: its CUTLASS kernel reads the sizes on the host

        return gmm(x, weight, torch.tensor(counts, dtype=torch.int64), trans_b=True)
    # unbind, not weight[e]: each indexing would give the backward a zero gradient of the whole (E, out, in)
    # weight to add up (E of them); unbind's backward stacks the E slices once.
    return torch.cat([xe @ we.T for xe, we in zip(x.split(counts), weight.unbind(0), strict=True)])


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.n_experts, self.top_k = m.n_experts, m.top_k
        self.router_kind, self.norm_topk_prob = m.router, m.norm_topk_prob
        self.aux_loss_coef, self.z_loss_coef, self.bias_update_rate = m.aux_loss_coef, m.z_loss_coef, m.bias_update_rate
        self.backend = m.backend
        self.kernel_backend = cfg.kernels.moe  # token permute / unpermute, gathered GEMM: kernels/moe_permute, moe_gemm
        self.swiglu_backend = cfg.kernels.swiglu  # the experts' activation, switched as the dense SwiGLU's
        self.gather = m.gather
        if self.gather not in GATHERS:
            raise ConfigError(f"model.moe.gather={self.gather!r} is not a choice; choose one of {list(GATHERS)}: "
                              f"permute (a permutation kernel, then the grouped GEMM) or gemm (the gate_up GEMM "
                              f"gathers the token rows itself; Triton)")
        if self.backend == "megablocks":
            try:
                import grouped_gemm.ops  # noqa: F401  (installed with megablocks)
            except ImportError as e:
                raise ConfigError(
                    "model.moe.backend=megablocks needs megablocks and its grouped_gemm kernels, which build on "
                    "CUDA machines only (pip install 'hybridtron[gpu]'); use model.moe.backend=native elsewhere"
                ) from e
        hidden = m.expert_hidden or cfg.resolved_ffn_hidden()
        self.gate = nn.Linear(cfg.d_model, self.n_experts, bias=False)  # the router
        self.experts = Experts(self.n_experts, cfg.d_model, hidden)
        if m.shared_expert_hidden:
            # Plain projections: the MoE block's norm keeps its gain, so no scale vectors here.
            self.shared_expert = SwiGLU(cfg.d_model, m.shared_expert_hidden)
            self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.register_buffer("expert_bias", torch.zeros(self.n_experts))  # persistent: resumes exactly
        # Statistics since the last optimizer step (summed over micro-batches), for metrics and the bias.
        # Both stay on the device (no host synchronisation in the forward); metrics() reads them once per step.
        self.register_buffer("_load", torch.zeros(self.n_experts, dtype=torch.float64), persistent=False)
        self.register_buffer("_sums", torch.zeros(len(STATS), dtype=torch.float64), persistent=False)  # STATS
        self.aux_loss: torch.Tensor | None = None
        # Expert parallel (set from outside, ``train/parallel/expert_parallel.py``): a callable that runs the expert-sorted
        # assignments through experts held by other ranks too; None runs every expert here.
        self.expert_dispatch = None
        # Context parallel (set from outside, ``train/parallel/context_parallel.py``): x is one piece of each sequence, and
        # the balance loss needs the whole sequences' expert loads (``sum_counts``).
        self.context_parallel = None

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        self.expert_bias.zero_()
        self.reset_stats()

    def active_params_per_token(self) -> int:
        """Router + top_k experts + the shared expert and its gate: the parameters one token uses."""
        e = self.experts
        n = self.gate.weight.numel() + self.top_k * (e.gate_up_proj[0].numel() + e.down_proj[0].numel())
        if self.shared_expert is not None:
            n += sum(p.numel() for p in self.shared_expert.parameters()) + self.shared_expert_gate.weight.numel()
        return n

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, d) -> (logits (N, E) fp32, probs (N, E), top-k weights (N, k), top-k experts (N, k)).

        The scores are fp32 on purpose, autocast or not: the top-k choice compares them (plus the small balancing
        bias) and bf16 would tie experts; the router is 2 d E FLOPs a token, under 1% of the layer's."""
        f32 = torch.promote_types(x.dtype, torch.float32)  # fp32 at least (fp64 stays fp64: tests)
        with _no_autocast(x.device.type):
            logits = F.linear(x.to(f32), self.gate.weight.to(f32))
        probs = logits.softmax(-1) if self.router_kind == "softmax" else logits.sigmoid()
        choice = probs + self.expert_bias if self.bias_update_rate else probs
        idx = choice.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, idx)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, probs, weights, idx

    def _losses(self, logits: torch.Tensor, probs: torch.Tensor,
                counts: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(weighted sum of the balance losses or None, unweighted aux loss, unweighted z-loss), all on the device;
        counts (E,): assignments per expert (the dispatch's, not a second count)."""
        N, E = probs.shape
        counts = counts.to(probs.dtype)
        zero = probs.new_zeros(())
        if self.context_parallel is not None:  # f_e of the whole sequences; each piece's P_e then carries the
            counts = self.context_parallel.sum_counts(counts)  # gradient, and the pieces' mean is the whole loss
            N = N * self.context_parallel.n
        load = counts / (N * self.top_k)  # f_e
        terms, aux, z = [], zero, zero
        if self.aux_loss_coef:
            p = probs if self.router_kind == "softmax" else probs / probs.sum(-1, keepdim=True)
            aux = E * (load * p.mean(0)).sum()
            terms.append(self.aux_loss_coef * aux)
        if self.z_loss_coef:
            z = torch.logsumexp(logits, dim=-1).pow(2).mean()
            terms.append(self.z_loss_coef * z)
        return (sum(terms) if terms else None), aux, z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, k, E = x.shape[0], self.top_k, self.n_experts
        logits, probs, weights, idx = self.route(x)
        flat = idx.flatten()  # assignment a = token * k + j
        order, pos = sort_assignments(flat)  # assignments grouped by expert, and the inverse
        # per-expert counts on the device (bincount would read the largest index back to the host on CUDA;
        # `hybridtron plan` simulates this int64 scatter-add as balanced routing)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add(0, flat, torch.ones_like(flat))
        if self.training:
            self.aux_loss, aux, z = self._losses(logits, probs, counts)
            with torch.no_grad():  # accumulated on the device: nothing here waits for the GPU
                self._load += counts.to(self._load.dtype)
                stats = torch.stack([aux.detach().to(self._sums.dtype), z.detach().to(self._sums.dtype),
                                     N * k - counts.sum().to(self._sums.dtype),  # dropped: 0, dropless
                                     self._sums.new_ones(())])
                self._sums += stats
        else:
            self.aux_loss = None
        # The experts, the permutation and the shared expert run in the compute dtype (expert_dtype): under bf16
        # autocast the rows are cast once here, and the expert weights once per forward in run_experts.
        xe = x.to(expert_dtype(x, self.experts.gate_up_proj))
        if self.expert_dispatch is None and self.gathers_in_gemm(xe):
            ys = self.run_experts_gathered(xe, order, pos, counts)
        else:
            xs = moe_permute(xe, order, pos, k, backend=self.kernel_backend)  # (N k, d), expert-sorted: x[order // k]
            if self.expert_dispatch is None:
                ys = self.run_experts(xs, counts, self.experts.gate_up_proj, self.experts.down_proj)
            else:
                ys = self.expert_dispatch(self, xs, counts)
        out = moe_unpermute(ys, order, pos, weights, k, backend=self.kernel_backend)  # (N, d): weighted sum per token
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(xe)) * self.shared_expert(xe)
        return out.view(shape)

    def run_experts(self, xs: torch.Tensor, counts: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, host_counts: list[int] | None = None) -> torch.Tensor:
        """Rows sorted by expert (counts[e] rows for expert e of the given weights, counts an (E,) tensor on the
        device) through their SwiGLU experts, in xs's dtype (the weights are cast to it: autocast does not reach
        the grouped GEMM). host_counts: the same counts on the host where the caller has them already."""
        dt = xs.dtype
        offsets = counts.cumsum(0).to(torch.int32)
        if host_counts is None and self.backend == "megablocks":
            host_counts = counts.tolist()  # megablocks' gmm takes the sizes on the host: one copy for both matmuls
        h = grouped_linear(xs, gate_up_proj.to(dt), offsets, self.backend, host_counts)
        return self._activation_and_down(h, down_proj.to(dt), offsets, host_counts)

    def gathers_in_gemm(self, xe: torch.Tensor) -> bool:
        """The gate_up GEMM gathers the token rows itself: model.moe.gather=gemm where model.kernels.moe runs our
        Triton kernels. On the reference backend the gather is the permutation's (the same formula), and expert
        parallelism sends the permuted rows to other ranks, so both keep the permute path."""
        return self.gather == "gemm" and pick_for("moe", self.kernel_backend, xe) == "triton"

    def run_experts_gathered(self, xe: torch.Tensor, order: torch.Tensor, pos: torch.Tensor,
                             counts: torch.Tensor) -> torch.Tensor:
        """`run_experts` on the token rows xe (N, d) themselves: the gate_up GEMM reads row r of the expert-sorted
        assignments as xe[order[r] // k] (kernels/moe_gemm), so the permuted (N k, d) rows are never written, nor
        kept for the backward (xe is, k times smaller). Same result, rows in the same expert order."""
        dt = xe.dtype
        offsets = counts.cumsum(0).to(torch.int32)
        host_counts = counts.tolist() if self.backend == "megablocks" else None  # the down projection's gmm
        h = gathered_linear(xe, order, pos, self.top_k, self.experts.gate_up_proj.to(dt), offsets,
                            backend=self.kernel_backend)
        return self._activation_and_down(h, self.experts.down_proj.to(dt), offsets, host_counts)

    def _activation_and_down(self, h: torch.Tensor, down_proj: torch.Tensor, offsets: torch.Tensor,
                             host_counts: list[int] | None) -> torch.Tensor:
        """silu(gate) * up on the gate_up rows h (R, 2 I) = [gate | up] in one pass (the packed SwiGLU reads the
        halves where they lie and hands the backward one (R, 2 I) gradient: no copy of either half, no
        concatenation), then the down projection."""
        return grouped_linear(swiglu_packed(h, backend=self.swiglu_backend), down_proj, offsets, self.backend,
                              host_counts)

    # -- between optimizer steps ------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Load per expert (fraction of assignments), the unweighted losses and the router biases,
        averaged over the micro-batches since the last optimizer step (one device-to-host copy)."""
        E = self.n_experts
        host = torch.cat([self._load.double(), self._sums.double(), self.expert_bias.detach().double()]).tolist()
        load, sums, bias = host[:E], dict(zip(STATS, host[E:E + len(STATS)], strict=True)), host[E + len(STATS):]
        n = max(sums["forwards"], 1)
        total = sum(load)
        out = {f"load/e{e}": (c / total if total else 0.0) for e, c in enumerate(load)}
        out["dropped"] = sums["dropped"]
        if self.aux_loss_coef:
            out["aux_loss"] = sums["aux_loss"] / n
        if self.z_loss_coef:
            out["z_loss"] = sums["z_loss"] / n
        if self.bias_update_rate:
            out.update({f"bias/e{e}": b for e, b in enumerate(bias)})
        return out

    @torch.no_grad()
    def reduce_load(self, reduce) -> None:
        """Sum this step's expert counts over the data-parallel ranks (``reduce`` sums a tensor in place)."""
        reduce(self._load)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Move the routing biases towards balance (an overloaded expert's bias down), then reset the
        statistics for the next step. On the device, without a sync: with no load counted (no training forward)
        every expert sits at the mean and sign(0) leaves the biases as they are."""
        if self.bias_update_rate:
            load = self._load.float()
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.reset_stats()

    @torch.no_grad()
    def reset_stats(self) -> None:
        """Forget the statistics gathered since the last optimizer step (a forward that was not training)."""
        self._load.zero_()
        self._sums.zero_()


def moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The same layer by a loop over experts with masks (no sorting, no grouped GEMM): ground truth."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    _, _, weights, idx = moe.route(x)
    x = x.to(expert_dtype(x, moe.experts.gate_up_proj))  # the layer's compute dtype, as MoE.forward casts
    out = torch.zeros_like(x)
    for e in range(moe.n_experts):
        token, slot = (idx == e).nonzero(as_tuple=True)
        if token.numel():
            out = out.index_add(0, token, moe.experts.expert(e, x[token]) * weights[token, slot, None].to(x.dtype))
    if moe.shared_expert is not None:
        out = out + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out.view(shape)
