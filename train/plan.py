"""``hybridtron plan``: per-GPU memory and per-step communication of a config on a cluster shape, before a launch.

Memory is not guessed from formulas: two training steps (forward, backward, optimizer) of one rank run on fake
tensors (``FakeTensorMode``: shapes and dtypes, no storage) over a fake process group of the whole world size
(``FakeStore``, backend "fake": DTensor and device meshes work on it, collectives move nothing), and over the
second (the steady state: optimizer state exists) torch's memory trackers record the peak by category: sharded and gathered weights, gradients, optimizer state,
activations and temporaries. The rank is built by the trainer's own code, in the trainer's order: the layout
checks and the device mesh (``Mesh.setup``), the pipeline cut (``train/parallel/pipeline.py``), tensor parallelism
(``apply_tensor_parallel``: the model's own DTensor plan), expert parallelism (``apply_expert_parallel``: this
rank's experts), context parallelism (``apply_context_parallel``: the rank runs T/cp positions; attention
passes key/value blocks round a ring, delta-rule layers gather each piece's state map), FSDP2
(``apply_data_parallel``), then the optimizer. So the plan follows the model code as it is: MoE, delta-rule and structured layers and activation
checkpointing included. Each fused op runs as the GPU run would pick it (``gpu_kernels``: our Triton kernels'
``autograd.Function`` with their custom ops' fake implementations), so what is kept for backward is what those
kernels keep: the fused attention its output and log-sum-exp (not the T x T probabilities of the reference's
autograd), the chunked delta rule its inputs, decay terms and chunk states, the fused loss its two gradients (no
logits), norms their inputs and inverse RMS. Dtypes are fp32, or bf16 where CPU autocast casts (matmuls) when the
run trains in bf16 (CUDA's autocast casts the same ops).

Where fake tensors cannot follow the real run, this is what the plan assumes instead:

- MoE routing is balanced: every expert gets N k / E of a micro-batch's N k token assignments (so under ep every
  rank receives as many rows as it sends). A fake tensor has no values, and the routing counts set shapes
  (``_KnownValues`` below). An unbalanced router holds more rows on the ranks of its busiest experts.
- Pipeline schedules run their own action order for the planned rank: torch's ``pipeline_order`` of the
  configured schedule (gpipe: all forwards, then all backwards, so every micro-batch's activations are held at
  once; 1f1b: stage s runs pp - s forwards first, so it holds up to pp - s micro-batches; interleaved schedules
  as torch orders them). torch's runtime itself cannot run on one process (it exchanges shapes and votes with
  the other stages), so the replay keeps what it keeps: one receive buffer per micro-batch for the activations
  and one for their gradients, allocated once, and the received activations' gradients until the next step.
  Under FSDP the gradients stay unsharded until the last micro-batch, as torch's stages arrange it. zero_bubble
  splits each backward in an input half (I) and a weight half (W): a micro-batch's activations are held from its
  forward to its W (the I half keeps the graph for the W half); the gradients the I half keeps for W are not
  counted.
- The tokens are uniformly random (drawn for real: what is computed from them alone, such as which labels fall in
  a rank's vocabulary shard, is as in a real step). Text is skewed towards frequent tokens.
- ``parallel.offload: cpu`` (FSDP2's CPU offload): the sharded weights, sharded gradients and optimizer state are
  counted in host memory (``host``), not in the GPU peak; what is gathered for compute stays on the GPU.
- ZeRO-0 is planned without DDP's wrapper (its C++ reducer cannot run on fake tensors): with
  ``gradient_as_bucket_view`` its buckets are the gradients, so the replicated model holds what the plain one does.

Every pipeline stage is planned (the first rank of each): stages differ in layers, embeddings and in-flight
micro-batches; ranks of one stage differ only by their shard. ``--measure`` runs the same two steps on real
tensors in the job's real layout (under torchrun, every rank; a pipeline through torch's real schedule) and
prints the prediction beside the measured peak of the rank the plan found heaviest: the check that the plan is
right.

``--measure`` also counts the bytes every collective of the measured step sent (``CollectiveBytes``: DDP, FSDP2,
DTensor, pipelining and our own calls alike, as ring algorithms move them) beside the volumes below.

Step time (``step_time``): the step's model FLOPs at a configured peak x MFU, each dimension's bytes at the intra-
or inter-node bandwidth (whether its process groups fit in a node), the pipeline bubble, and what the engines
overlap; ``hybridtron plan`` prints the breakdown.

Communication per optimizer step and GPU, in bytes sent (ring algorithms: as many are received). m micro-batches
per step of B sequences of T tokens, d = model.d_model, f(n) = (n - 1) / n; s = 4 (the residual stream and the
norm outputs stay fp32 under autocast), c = 2 in bf16 runs, else 4 (projection outputs); the parameters P and
the layer counts L are those of the planned rank (its tp shard, its pipeline stages); head counts H are those
of the rank's tp shard:

  dp  n = dp x cp ranks average the gradients; P without the experts sharded over ep; g = 2 when FSDP gathers
      bf16 weights (parallel.mixed_precision), else 4
      ZeRO-0 (DDP): all-reduce of the gradients once per step:                 2 f(n) 4 P
      ZeRO-2: all-gather of the weights (forward) and reduce-scatter of the gradients, per micro-batch:
                                                                               m (f(n) g P + f(n) 4 P)
      ZeRO-3: the all-gather again in backward, but for the root's parameters P_root (embeddings, final norm,
      head: FSDP2 keeps them gathered from forward to backward):             m (f(n) g (2 P - P_root) + f(n) 4 P)
      (under pp torch's stages reduce-scatter once per step: m = 1 in the reduce-scatter term)
      HSDP (parallel.dp_shard = s < dp): the all-gathers and reduce-scatters above run in the groups of s x cp
      ranks (n = s cp in them), and the accumulated shards are all-reduced across the dp / s groups once per
      step, after the last micro-batch (column dp_replicate):                  2 f(dp / s) 4 P / (s cp)
      ep > 1: the expert gradients all-reduced over their dp cp / ep copies:   2 f(dp cp / ep) 4 P_experts
  tp  (T: the rank's piece, seq_len / cp, under context parallel)
      per layer: all-gather of the two norm outputs and reduce-scatter of the two projection outputs in forward,
      the reverse in backward:                                                 m L 4 f(tp) B T d (s + c)
      activation checkpointing repeats the forward ones in backward:           + m L 2 f(tp) B T d (s + c)
      the embedding (reduce-scatter, then all-gather in backward) and the output layer (the reverse), on the
      stages that hold them:                                                   m 2 f(tp) B T d s each
  pp  the stage's output and its input's gradient, (B, T/tp, d) fp32 each (the first stage sends no gradient,
      the last no output), per stage of the rank:                              m 2 B (T / (cp tp)) d 4
      tied embeddings: first and last stage all-reduce the embedding's gradient once per step: V d 4 / tp
  ep  per MoE layer, balanced routing: the routed copies of the tokens (k per token) to their experts' ranks
      and back, and their gradients:                                           m L_moe 2 f(ep) B (T / cp) k d (s + c)
  cp  per attention layer (ring attention): cp - 1 passes of a key and a value block in forward, cp passes of
      them with their fp32 gradients in backward:            m L_attn B (T / cp) H_kv D (2 (cp - 1) c + cp (2 c + 8))
      per delta-rule layer: all-gather of every piece's state map (A | B), fp32, and the reduce-scatter of its
      gradient; the convolution halo to the next rank and its gradient back:
                                                     m L_delta 2 B ((cp - 1) H_v D_k (D_k + D_v) 4 + (K - 1) C c)
      document ids (int64) gathered per micro-batch when masked:               m (cp - 1) B (T / cp) 8
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

from hybridtron.configs import ConfigError, JobConfig

from .device import autocast_context, autocast_dtype
from .parallel.context_parallel import local_piece
from .parallel.mesh import Mesh, dp_shard_size, resolve_layout
from .parallel.parallelize import checkpointing_mode, clip_grad_norm

GIB = 1 << 30
CATEGORIES = {  # tracker category (enum name) -> what the plan calls it
    "PARAM": "weights", "SHARDED_PARAM": "weights", "BUFFER": "weights",
    "UNSHARDED_PARAM": "gathered", "ALL_GATHER": "gathered",
    "GRAD": "grads", "SHARDED_GRAD": "grads", "UNSHARDED_GRAD": "grads", "REDUCE_SCATTER": "grads",
    "OPT": "optimizer",
    "ACT": "activations", "TEMP": "activations", "INP": "activations", "OTH": "activations",
}
DIMS = ("dp", "tp", "pp", "ep", "cp")


def _compute_dtype(cfg: JobConfig) -> torch.dtype | None:
    """The run's autocast dtype on the GPUs it plans for."""
    return autocast_dtype(cfg.train, torch.device("cuda"))


# ---- values fake tensors cannot do without -------------------------------------------------------------------
aten = torch.ops.aten
# Tensors made from nothing whose values are known: index ranges, and random token ids (drawn for real).
_FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.randint.default, aten.randint.low,
              aten.randint.generator, aten.randint.low_generator}
_KNOWN_LIMIT = 1 << 22  # elements: index tensors up to a vocabulary's length, not activations


class _KnownValues(TorchDispatchMode):
    """Values computed for real inside a fake-tensor step, where a shape depends on them.

    A fake tensor has a shape but no values, and a few shapes in a training step come from values: how many token
    assignments each expert gets (an int64 scatter-add of ones over the router's choices, or ``torch.bincount``;
    under expert parallelism the all-to-all splits and ``repeat_interleave`` of those counts), which labels fall in a rank's
    vocabulary shard (``torch.nonzero`` in the vocabulary-parallel loss), and DTensor's index arithmetic
    (``torch.arange(n)...tolist()``). Such tensors are *known* here: a real tensor, or a fake one that carries its
    real value (``_known``). Index ranges and the random token ids of the batches are drawn for real, and an op
    whose tensor inputs are all known (and small) also runs on the real values, so its result is known too: what
    is computed from the tokens alone is what a real step computes. The routing counts, which depend on the
    weights too, are the assumption of the plan: balanced (module docstring).
    A scalar read from an unknown floating tensor (a loss, a gradient norm, a logged statistic) reads as 0.0:
    none of them sets a shape. Values of tensors changed in place are forgotten.

    Also: torch 2.13's fake kernel of ``torch._grouped_mm`` accepts bf16 only while the CPU kernel also runs fp32,
    so fp32 grouped matmuls get their output from the same shape rule without the dtype check.
    """

    def __init__(self, fake_mode):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor unwraps to its local tensors first, which come back here
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        fakes = [t for t in tensors if isinstance(t, FakeTensor)]
        if tensors and not fakes and func not in (aten.lift_fresh.default, aten.lift_fresh_copy.default):
            with _disable_current_modes():  # real tensors only (device-mesh bookkeeping): as without fake tensors
                return func(*args, **kwargs)
        if func is aten.bincount.default:
            return self._balanced_counts(*args, **kwargs)
        if func is aten.scatter_add.default and args[0].dtype == torch.int64 and args[0].dim() == 1:
            return self._balanced_counts(args[2], minlength=args[0].numel())  # MoE counts (model/moe.py)
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            from torch._meta_registrations import _create_grouped_mm_output_tensor

            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            return _create_grouped_mm_output_tensor(args[0], args[1], offs, kwargs.get("out_dtype"))
        if func in (aten._local_scalar_dense.default, aten.item.default):
            value = _known(args[0])
            if value is not None:
                with _disable_current_modes():
                    return value.item()
            try:
                return func(*args, **kwargs)  # fake constants (an optimizer's step count) know their value
            except DataDependentOutputException:
                if args[0].dtype.is_floating_point:
                    return 0.0
                raise ConfigError("hybridtron plan cannot simulate this model: a shape depends on a value it cannot "
                                  "know without the data") from None
        known = all(_known(t) is not None for t in tensors) and bool(tensors or func in _FACTORIES)
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            if not known:
                raise
            out = None
        if func._schema.is_mutable:
            for t in fakes:
                t.__dict__.pop("_known", None)
            if func is torch.ops.c10d.alltoall_base_.default and _known(args[1]) is not None:
                args[0]._known = _known(args[1])  # balanced: every rank sends each rank what this one sends
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if known and all(t.numel() <= _KNOWN_LIMIT for t in outs):
            real_args, real_kwargs = tree_map_only(torch.Tensor, _known, (args, kwargs))
            if "device" in real_kwargs:  # known values live on the CPU, whatever device the fake tensors claim
                real_kwargs = {**real_kwargs, "device": torch.device("cpu")}
            with _disable_current_modes():
                value = func(*real_args, **real_kwargs)
            if out is None:  # a shape only the values give (repeat_interleave of known counts)
                out = tree_map_only(torch.Tensor, lambda v: self._fake_of(v, fakes[0].device), value)
            for fake, real in zip(tree_flatten(out)[0], tree_flatten(value)[0], strict=True):
                if isinstance(fake, FakeTensor):
                    fake._known = real
        return out

    def _balanced_counts(self, x, weights=None, minlength=0):
        if weights is not None or not minlength:
            raise ConfigError("hybridtron plan simulates torch.bincount only as MoE routing counts (minlength set)")
        n = x.numel()
        with _disable_current_modes():
            value = torch.full((minlength,), n // minlength, dtype=torch.int64)
            value[:n % minlength] += 1
        out = self._fake_of(value, x.device)
        out._known = value
        return out

    def _fake_of(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A fake tensor of ``value``'s shape and dtype on ``device`` (the known values themselves stay on the CPU)."""
        out = self.fake_mode.from_tensor(value)
        return out if out.device == device else out.to(device)


def _own_fake_mode_for_dtensor_shapes():
    """DTensor computes each op's output shape on fake tensors of the global shape, in the active fake mode when
    there is one. In the fake run that is the plan's own, and the trackers would count those whole-size tensors as
    if the rank held them; with a fake mode of its own (as in a real run) they stay apart."""
    from unittest import mock

    import torch.distributed.tensor._sharding_prop as sharding_prop

    return mock.patch.object(sharding_prop, "detect_fake_mode", lambda *_args, **_kwargs: None)


def gpu_backend(op: str, requested: str) -> str:
    """The backend the plan counts ``op``'s memory with on the GPUs it is for: ours (``triton``) for ``auto`` and for
    every peer library. ``auto`` there takes whichever is measured fastest, and the peers keep what ours keeps for
    the backward (attention: q, k, v, the output and the log-sum-exp; the delta rule: its inputs and one chunk
    system; the convolution: its inputs) while their custom kernels have no fake implementations of ours to run
    on the plan's fake tensors."""
    return "reference" if requested == "reference" else "triton"


@contextlib.contextmanager
def gpu_kernels(cfg: JobConfig):
    """In the fake run, each fused op takes the backend the GPU run takes, not the CPU's reference: its
    ``autograd.Function`` saves for backward exactly what the GPU kernels keep (the fused attention its output
    and log-sum-exp, not the T x T probabilities the reference's autograd would; the chunked delta rule its
    inputs, decay terms and chunk states; the fused loss its two gradients, never the logits), and its custom
    ops' fake implementations give the shapes (no kernel runs on fake tensors). The kernels' own scratch inside
    one launch is not counted. `backend.forced` holds the choice for the CPU device type for this run only."""
    from hybridtron.kernels import backend

    chosen = {}
    for op in backend.OPS:  # the config's request, and the backend it resolves to on the GPU
        chosen[op] = gpu_backend(op, getattr(cfg.model.kernels, op))
        if op == "cross_entropy" and cfg.parallel.tp > 1 and chosen[op] == "triton":
            # The vocabulary-parallel loss launches its two kernels inside its own loop (no custom op to fake); the
            # reference runs the same loop and saves the same gradients, only its per-chunk scratch differs.
            chosen[op] = "reference"
    with backend.forced(chosen, "cpu"):
        yield


def _known(t: torch.Tensor) -> torch.Tensor | None:
    from torch._subclasses.fake_tensor import FakeTensor

    return t.__dict__.get("_known") if isinstance(t, FakeTensor) else t


# ---- the simulated (or real) rank ------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(cfg: JobConfig, world: int, rank: int):
    """The ``Mesh`` rank ``rank`` of a ``world``-process job would get, over a fake process group in this
    process: ``Mesh.setup`` itself builds it (checks, device mesh, expert mesh, context-parallel groups), reading
    the launcher's variables, which are set for it meanwhile."""
    if dist.is_initialized():
        raise ConfigError("hybridtron plan simulates other layouts in one process: run it without torchrun "
                          "(torchrun is for --measure)")
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    # DTensor caches each op's output layout by device mesh, and meshes of one shape compare equal: this rank would
    # get the process groups of a rank simulated (or measured) before, destroyed by now.
    _clear_sharding_prop_cache()
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, backend="auto"))  # no NCCL check
    try:
        if world > 1:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        with Mesh.setup(cfg, torch.device("cpu")) as mesh:
            yield mesh
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_rank(cfg: JobConfig, mesh: Mesh, device: torch.device, vocab: int, amp: torch.dtype | None):
    """(model, pipeline or None, optimizer, the modules that run forward, ``rank_facts``) of ``mesh``'s rank,
    built as ``cli._train_run`` builds them, in its order. ZeRO-0 stays unwrapped (module docstring); ``amp``:
    the autocast dtype FSDP's mixed precision follows."""
    from hybridtron.model import GatedLM

    from .optim import build_optimizer
    from .parallel.context_parallel import apply_context_parallel
    from .parallel.expert_parallel import apply_expert_parallel
    from .parallel.parallelize import apply_data_parallel, apply_tensor_parallel, parallelize

    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = parallelize(GatedLM(cfg.model, vocab), cfg.train)
        model.init_weights()
    pipeline = None
    if mesh.pp > 1:
        from .parallel.pipeline import Pipeline

        pipeline = Pipeline(cfg, model, mesh, device, vocab)
    apply_tensor_parallel(model, mesh)
    apply_expert_parallel(model, mesh)
    apply_context_parallel(model, mesh)
    facts = rank_facts(cfg, model, pipeline)  # before FSDP shards what data parallelism exchanges
    roots = pipeline.stages if pipeline is not None else [model]
    if mesh.zero_stage >= 2:
        apply_data_parallel(model, mesh, amp, cfg.parallel.mixed_precision,
                            roots=roots if pipeline is not None else None, offload=cfg.parallel.offload == "cpu")
    if pipeline is not None:
        pipeline.finish()
    return model, pipeline, build_optimizer(model, cfg.train), roots, facts


class ReplayedSchedule:
    """The configured torch schedule for one pipeline rank, run on fake tensors in this process: its own action
    order (``pipeline_order``) replayed on the rank's stage modules (see the module docstring). Forwards and
    backwards of one stage pair up first in, first out, as every torch schedule orders them."""

    def __init__(self, pipeline, device: torch.device):
        self.pipeline, self.device = pipeline, device
        self.order = [a for a in pipeline.schedule.pipeline_order[pipeline.mesh.pp_rank] if a is not None]
        self.n_stages, self.n_micro = len(pipeline.ranges), pipeline.n_micro
        self.modules = dict(zip(pipeline.stage_ids, pipeline.stages, strict=True))
        self.recv: dict[tuple[str, int, int], torch.Tensor] = {}  # torch's per-micro-batch receive buffers

    def _buffer(self, kind: str, stage: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        """The receive buffer ``kind`` ("act" or "grad") of ``stage`` for micro-batch ``mb``; ``like``: a (B, T)
        tensor of the micro-batch (its labels, which reach every stage)."""
        key = (kind, stage, mb)
        if key not in self.recv:
            # Between stages the residual stream: (B, T / (cp tp), d) fp32 (it stays fp32 under autocast)
            shape = (like.shape[0], like.shape[1] // self.pipeline.mesh.tp, self.pipeline.model.cfg.d_model)
            self.recv[key] = torch.empty(shape, dtype=torch.float32, device=self.device)
        return self.recv[key]

    def step(self, *args, target=None, losses=None, return_outputs=False, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        from .parallel.pipeline import stage_loss

        ids = args[0].chunk(self.n_micro) if args else None
        labels = target.chunk(self.n_micro) if target is not None else None
        kw = [{k: v.chunk(self.n_micro)[m] for k, v in kwargs.items()} for m in range(self.n_micro)]
        for key, buf in self.recv.items():
            if key[0] == "act":
                buf.grad = None  # torch clears the received activations' gradients at the start of a step
        held = {s: [] for s in self.modules}
        started = {s: 0 for s in self.modules}
        backwards = {s: 0 for s in self.modules}
        for action in self.order:
            s, kind = action.stage_index, action.computation_type.value
            module = self.modules[s]
            if kind == "F":
                m = started[s]
                started[s] += 1
                if s == 0:
                    x = ids[m]
                else:
                    x = self._buffer("act", s, m, kw[m]["labels"]).requires_grad_(True)
                out = module(x, **kw[m])
                if s == self.n_stages - 1:
                    out = stage_loss(out, labels[m] if labels is not None else None)
                    if losses is not None:
                        losses.append(out.detach())
                held[s].append((m, out))
            elif kind in ("B", "W"):  # W: the weight half of zero_bubble's backward (I holds the graph until it)
                m, out = held[s].pop(0)
                backwards[s] += 1
                if isinstance(module, FSDPModule):  # as torch's stages: reduce after the last micro-batch only
                    last = backwards[s] == self.n_micro
                    module.set_is_last_backward(last)
                    module.set_reshard_after_backward(last)
                    module.set_requires_gradient_sync(last)
                if s == self.n_stages - 1:
                    out.backward()
                else:
                    out.backward(self._buffer("grad", s, m, kw[m]["labels"]))
        return None


def _batches(cfg: JobConfig, vocab: int, n: int, device: torch.device):
    """``n`` micro-batches of random tokens (and one document each when the model masks documents) on ``device``,
    as the trainer moves its batches there (the token ids must meet the embedding on its device)."""
    B, T = cfg.train.micro_batch_size, cfg.data.seq_len
    for _ in range(n):
        x = torch.randint(0, vocab, (B, T), device=device)
        batch = {"input_ids": x, "labels": x}
        if cfg.model.doc_mask:
            batch["doc_ids"] = torch.zeros_like(x)
        yield batch


def _train_step(cfg: JobConfig, model, optimizer, mesh, pipeline, device, amp, n_micro: int, vocab: int) -> None:
    """One optimizer step over ``n_micro`` micro-batches, as train/step.py's ``run_torch`` and ``run_pipeline``
    take it (every micro-batch fully labelled, so no loss weights; without the scalars they log)."""
    from .parallel.expert_parallel import sync_expert_grads

    if pipeline is not None:
        parts = list(_batches(cfg, vocab, n_micro, device))
        batch = local_piece({k: torch.cat([p[k] for p in parts]) for k in parts[0]}, mesh)  # context parallel
        with autocast_context(device, amp):
            pipeline.step(batch)
        sync_expert_grads(model, mesh)
        pipeline.clip_grad_norm(cfg.train.grad_clip)
    else:
        for i, batch in enumerate(_batches(cfg, vocab, n_micro, device)):
            if mesh.zero_stage == 0 and hasattr(model, "set_requires_gradient_sync"):  # DDP: once, as the trainer
                model.set_requires_gradient_sync(i == n_micro - 1)
            b = local_piece(batch, mesh)
            with autocast_context(device, amp):
                loss = model(b["input_ids"], b.get("doc_ids"), labels=b["labels"])
            (loss / n_micro).backward()
        sync_expert_grads(model, mesh)
        clip_grad_norm(model.parameters(), cfg.train.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tracker(roots: list[nn.Module], model, optimizer, pipeline):
    """torch's memory tracker for the rank, told of what already exists: weights, optimizer state and (pipeline)
    the receive buffers of the first step, which later steps reuse. FSDP2's own tracker when FSDP wraps the
    roots (it tells sharded from gathered weights), else the plain one."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    buffers = _receive_buffers(pipeline) if pipeline is not None else []
    if isinstance(roots[0], FSDPModule):
        tracker = FSDPMemTracker(roots[0], optimizer)
        if len(roots) > 1:  # several stages per rank: the tracker walks the modules of all (it takes one root)
            tracker._root_mod = nn.ModuleList(roots)
        tracker.track_inputs(buffers)
        return tracker
    tracker = _MemTracker()
    tracker.track_external(model, optimizer, *buffers)
    return tracker


class _MemTracker(MemTracker):
    """torch's plain tracker, which hooks the gradient of every parameter of a module when the module first runs.
    Tensor-parallel layers that run on their parameters' local shards (``train/parallel/tensor_parallel.py``) lend their
    submodules those shards, non-leaf views, as parameters for the call: their gradients reach the DTensor
    parameters, hooked already, so such submodules get no hooks (torch refuses hooks on non-leaf tensors)."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        lent = any(not p.is_leaf for p in module.parameters())
        with warnings.catch_warnings():  # it reads the .grad of each: a warning for the lent views
            warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
            return super()._track_module_params_and_buffers(module, install_grad_hooks and not lent)


def _receive_buffers(pipeline) -> list[torch.Tensor]:
    """The tensors a pipeline's stages receive into (activations and their gradients, one per micro-batch),
    allocated by the first step: the replay's, or those of torch's stages."""
    schedule = pipeline.schedule
    if isinstance(schedule, ReplayedSchedule):
        return list(schedule.recv.values())
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    infos = [i for st in stages for recv in (st.args_recv_info, st.grad_recv_info) for group in recv.values()
             for i in (group or ())]
    return [i.buffer for i in infos if getattr(i, "buffer", None) is not None]


def rank_facts(cfg: JobConfig, model, pipeline) -> dict:
    """What the communication of the rank depends on: its parameters (without the ep-sharded experts, and those)
    and the layers and pipeline stages it holds."""
    from .parallel.expert_parallel import expert_params

    def local(p):
        return p.to_local().numel() if isinstance(p, DTensor) else p.numel()

    experts = {id(p) for p in expert_params(model)}
    layers = [i for i, block in enumerate(model.layers) if block is not None]
    types = cfg.model.layer_types()
    stages = pipeline.stage_ids if pipeline is not None else [0]
    n_stages = len(pipeline.ranges) if pipeline is not None else 1
    in_layers = {id(p) for block in model.layers if block is not None for p in block.parameters()}
    return {"params": sum(local(p) for p in model.parameters() if id(p) not in experts),
            "root_params": sum(local(p) for p in model.parameters() if id(p) not in experts | in_layers),
            "expert_params": sum(local(p) for p in model.parameters() if id(p) in experts),
            "layers": len(layers), "attention_layers": sum(types[i] == "A" for i in layers),
            "delta_layers": sum(types[i] == "L" for i in layers),
            "moe_layers": sum(cfg.model.moe.is_moe_layer(i) for i in layers) if cfg.model.moe.n_experts else 0,
            "stages": list(stages), "n_stages": n_stages,
            "embedding": 0 in stages, "head": n_stages - 1 in stages}


def step_peak(cfg: JobConfig, mesh: Mesh, fake: bool, device: torch.device | None = None, kernels: str = "gpu") -> dict:
    """Peak bytes of ``mesh``'s rank over a training step that has optimizer state (the second), by plan category,
    and its ``rank_facts``. ``fake``: on fake tensors (over a fake process group); else real, on ``device``
    (default CPU), in the process group already set up. On CUDA the allocator's own peak is added as
    ``cuda_max_allocated``. ``kernels``: on fake tensors, the fused ops' backends of a GPU run (``gpu_kernels``) or
    of a CPU one ("cpu": the references, to compare with a real step on the CPU)."""
    device = device or torch.device("cpu")
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    amp = _compute_dtype(cfg)  # the GPUs' autocast, applied to the CPU run alike (module docstring)
    with contextlib.ExitStack() as stack:
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            fake_mode = stack.enter_context(FakeTensorMode())
            stack.enter_context(_KnownValues(fake_mode))
            stack.enter_context(_own_fake_mode_for_dtensor_shapes())
            if kernels == "gpu":
                stack.enter_context(gpu_kernels(cfg))
        model, pipeline, optimizer, roots, facts = build_rank(cfg, mesh, device, vocab, amp)
        if fake and pipeline is not None:
            pipeline.schedule = ReplayedSchedule(pipeline, device)
        # Step 1 creates the optimizer state (and, in a pipeline, torch's stages learn their shapes from it, by an
        # autograd.grad that torch's module tracker cannot follow); step 2, tracked, is the steady state. A
        # non-pipeline step runs two micro-batches: the second already holds the accumulated gradients beside a
        # micro-batch's activations, so later ones change nothing. A pipeline step runs them all: how many are in
        # flight is what its schedule decides.
        accum = cfg.train.grad_accum_steps
        n_micro = accum if pipeline is not None else min(accum, 2)
        _train_step(cfg, model, optimizer, mesh, pipeline, device, amp, 1 if pipeline is None else n_micro, vocab)
        tracker = _tracker(roots, model, optimizer, pipeline)

        # The trackers follow one call per module: a step calls the model (or a stage) once per micro-batch, so
        # each call starts the statistics of its modules afresh (those of a rank's other pipeline stages are still
        # awaited by their backward); the peak over all of them is kept. A global hook, registered before the
        # trackers' own, runs first.
        def fresh_module_stats(module, _args):
            if any(module is r for r in roots):
                for m in module.modules():
                    tracker.memory_tracking.pop(m, None)

        handle = nn.modules.module.register_module_forward_pre_hook(fresh_module_stats)
        on_gpu = device.type == "cuda" and torch.cuda.is_available()  # not fake CUDA tensors on a CPU (tests)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        # ZeRO-0 over several data ranks: the memory is the plain model's, as planned; a real run replicates it (DDP),
        # whose all-reduce is counted over one more step, after DDP wraps the model.
        ddp_after = not fake and mesh.zero_stage == 0 and mesh.data_ranks > 1 and pipeline is None
        counted = CollectiveBytes() if not fake else contextlib.nullcontext()
        try:
            with tracker, (contextlib.nullcontext() if ddp_after else counted):
                _train_step(cfg, model, optimizer, mesh, pipeline, device, amp, n_micro, vocab)
        finally:
            handle.remove()
        if ddp_after:
            from .parallel.parallelize import apply_data_parallel

            apply_data_parallel(model, mesh, amp, cfg.parallel.mixed_precision)
            with counted:
                _train_step(cfg, model, optimizer, mesh, pipeline, device, amp, n_micro, vocab)
        snap = tracker.get_tracker_snapshot("peak")
    per_dev = snap[device] if device in snap else next(iter(snap.values()))
    out = {"weights": 0.0, "gathered": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
    host = {"SHARDED_PARAM": 0.0, "SHARDED_GRAD": 0.0, "OPT": 0.0}  # parallel.offload=cpu: FSDP2 keeps these there
    for key, val in per_dev.items():
        name = getattr(key, "name", key)
        if name == "Total":
            out["total"] = float(val)
        elif name in CATEGORIES:
            out[CATEGORIES[name]] += float(val)
            if name in host:
                host[name] += float(val)
    if cfg.parallel.offload == "cpu" and mesh.zero_stage >= 2:  # the shards and the optimizer live in host memory
        for name, val in host.items():  # (present all step long: their peaks are their size at the total's peak)
            out[CATEGORIES[name]] -= val
            out["total"] -= val
        out["host"] = sum(host.values())
    if not fake:  # what this rank's collectives sent in the step, by op
        out["comm_sent"] = dict(counted.sent)
    if on_gpu:
        out["cuda_max_allocated"] = float(torch.cuda.max_memory_allocated(device))
    return {"memory": out, "facts": facts}


def planned_ranks(cfg: JobConfig, world: int) -> list[int]:
    """The ranks the plan simulates: the first of every pipeline stage (``Mesh.pp_rank``: pp outermost)."""
    return [s * (world // cfg.parallel.pp) for s in range(cfg.parallel.pp)]


def simulate(cfg: JobConfig, world: int, kernels: str = "gpu") -> dict[int, dict]:
    """``step_peak`` on fake tensors of every planned rank of ``cfg`` on ``world`` processes: {rank: result}."""
    results = {}
    for rank in planned_ranks(cfg, world):
        with fake_world(cfg, world, rank) as mesh:
            results[rank] = step_peak(cfg, mesh, fake=True, kernels=kernels)
    return results


# ---- communication ---------------------------------------------------------------------------------------------
def _recomputed_fraction(cfg: JobConfig) -> float:
    """The share of blocks whose forward runs again in backward, collectives included."""
    if checkpointing_mode(cfg.train) != "full":
        return 0.0
    every, layers = cfg.train.activation_checkpointing_every, cfg.model.n_layers
    return math.ceil(layers / every) / layers


def _checkpointing_label(cfg: JobConfig) -> str:
    mode = checkpointing_mode(cfg.train)
    every = cfg.train.activation_checkpointing_every
    return f"{mode} (every {every} blocks)" if mode == "full" and every > 1 else mode


def comm_bytes(cfg: JobConfig, world: int, facts: dict) -> dict[str, float]:
    """Bytes each GPU sends per optimizer step in every parallel dimension (formulas: module docstring)."""
    p, m = cfg.parallel, cfg.model
    dp = resolve_layout(cfg, world)
    mb, B, T, d = cfg.train.grad_accum_steps, cfg.train.micro_batch_size, cfg.data.seq_len, m.d_model
    amp = _compute_dtype(cfg)
    s, c = 4, (2 if amp is not None else 4)
    g = 2 if amp is not None and p.mixed_precision == "auto" else 4

    def f(n):
        return (n - 1) / n

    out = dict.fromkeys((*DIMS, "dp_replicate"), 0.0)
    n, P = dp * p.cp, facts["params"]
    if n > 1:
        if p.zero_stage == 0:
            out["dp"] = 2 * f(n) * 4 * P
        else:
            # ZeRO-3 gathers the blocks again in backward; the root stays gathered (reshard_after_forward=False)
            gathered = P if p.zero_stage == 2 else 2 * P - facts.get("root_params", 0)
            reduces = 1 if p.pp > 1 else mb
            shard = dp_shard_size(cfg, dp)
            shard = n if shard == dp else shard * p.cp  # FSDP2 over all dp x cp ranks, or HSDP's dp_shard x cp groups
            out["dp"] = mb * f(shard) * g * gathered + reduces * f(shard) * 4 * P
            if shard < n:  # HSDP: the step's accumulated shards all-reduced across the groups, once
                out["dp_replicate"] = 2 * f(n // shard) * 4 * P / shard
    if p.ep > 1 and n > p.ep:
        out["dp"] += 2 * f(n // p.ep) * 4 * facts["expert_params"]
    if p.tp > 1:
        # full checkpointing repeats the forward's two collectives of each recomputed block; selective keeps them
        t = T // p.cp  # under context parallel the rank's piece of each sequence
        per_layer = (4 + 2 * _recomputed_fraction(cfg)) * f(p.tp) * B * t * d * (s + c)
        ends = (facts["embedding"] + facts["head"]) * 2 * f(p.tp) * B * t * d * s
        out["tp"] = mb * (facts["layers"] * per_layer + ends)
    if p.pp > 1:
        boundary = B * (T // (p.cp * p.tp)) * d * 4
        for stage in facts["stages"]:
            out["pp"] += mb * boundary * ((stage < facts["n_stages"] - 1) + (stage > 0))
        vocab = m.resolve_vocab(cfg.data.tokenizer.vocab_size)
        if m.tie_embeddings and (facts["embedding"] or facts["head"]):
            out["pp"] += vocab * d * 4 / p.tp
    if p.ep > 1:
        out["ep"] = mb * facts["moe_layers"] * 2 * f(p.ep) * B * (T // p.cp) * m.moe.top_k * d * (s + c)
    if p.cp > 1:
        t = T // p.cp
        D = m.resolved_head_dim()
        block = B * t * (m.n_kv_heads // p.tp) * D  # one piece's keys (or values) of this rank's heads: the ring
        out["cp"] = mb * facts["attention_layers"] * block * (2 * (p.cp - 1) * c + p.cp * (2 * c + 8))
        if facts["delta_layers"]:
            n_k, n_v, d_k, d_v = m.deltanet.resolved(m)
            n_h = m.deltanet.n_householder
            conv_dim = n_k * d_k * (1 + n_h) + n_v * d_v * n_h
            maps = (p.cp - 1) * B * (n_v // p.tp) * d_k * (d_k + d_v) * 4  # the (A | B) of this rank's heads, fp32
            halo = B * (m.deltanet.conv_size - 1) * (conv_dim // p.tp) * c
            out["cp"] += mb * facts["delta_layers"] * 2 * (maps + halo)
        if m.doc_mask:
            out["cp"] += mb * (p.cp - 1) * B * t * 8
    return out


# ---- what the collectives moved ----------------------------------------------------------------------------------
def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes this rank sends in every collective of a real step, as the ring algorithms the volumes of
    ``comm_bytes`` assume move them (n ranks, f = (n - 1) / n, S the bytes of this rank's tensor): all-reduce
    2 f S; all-gather (n - 1) S of the input; reduce-scatter f S of the input; all-to-all what goes to the other
    ranks; a send S. It sees every collective, whoever issues it: ``torch.distributed``'s calls (DDP, FSDP2,
    pipelining, ours), DTensor's functional collectives (tensor parallel), as the ``c10d`` / ``_c10d_functional``
    ops they dispatch. Ops of the setup (broadcast, barrier) are counted under their names too."""

    _ALL_REDUCE = {"allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
                   "all_reduce_coalesced_"}
    _GATHER = {"_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
               "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out"}
    _SCATTER = {"_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_tensor",
                "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_out"}

    def __init__(self):
        super().__init__()
        self.sent: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        name = func._schema.name.split("::")[1]
        a = {arg.name: v for arg, v in zip(func._schema.arguments, args, strict=False)} | kwargs
        pg = a.get("process_group")
        if pg is None and "group_name" in a:
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(a["group_name"])
        if pg is None:
            return
        if isinstance(pg, torch.ScriptObject):  # how the c10d ops receive their group
            pg = dist.ProcessGroup.unbox(pg)
        n = pg.size()
        inputs = next((a[k] for k in ("input_tensor", "input_tensors", "inputs", "input", "input_list", "tensors",
                                      "tensor") if k in a), None)
        size = _nbytes(inputs)
        if name in self._ALL_REDUCE:
            sent = 2 * (n - 1) / n * size
        elif name in self._GATHER:
            sent = (n - 1) * size
        elif name in self._SCATTER:
            sent = (n - 1) / n * size
        elif name in ("alltoall_base_", "all_to_all_single"):
            splits, rows = a.get("input_split_sizes") or [], inputs.shape[0] if inputs.dim() else 1
            own = splits[pg.rank()] if splits else rows / n
            sent = size * (1 - own / max(rows, 1))
        elif name == "alltoall_":
            sent = size - _nbytes(inputs[pg.rank()])
        elif name in ("send", "isend"):
            sent = size
        elif name == "batch_p2p_ops":
            sent = sum(_nbytes(t) for op, t in zip(a["op_list"], a["tensors"], strict=True) if "send" in op)
        else:
            return  # receives, barriers; broadcasts happen at setup, not in a step
        self.sent[name] = self.sent.get(name, 0.0) + sent


# ---- step time --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the step-time prediction assumes of the cluster (``hybridtron plan`` flags). Defaults: an H100 SXM's
    dense bf16 peak (989 TFLOP/s); MFU 0.40, what dense_1b reached on one H100 without activation checkpointing
    (measured 2026-11-24: 40.3%); NVLink at 360 GB/s per GPU and direction (80% of its 450) and one 400 Gb/s NIC
    per GPU at 45 GB/s (90% of 50) between nodes: assumptions, not measurements."""

    peak_tflops: float = 989.0
    mfu: float = 0.40
    intra_node_gbps: float = 360.0
    inter_node_gbps: float = 45.0
    gpus_per_node: int = 8


def _strides(cfg: JobConfig, dp: int) -> dict[str, tuple[int, int]]:
    """(stride, size) of every dimension's groups in the rank order of ``Mesh`` (pp, dp, cp, tp; tp innermost; HSDP's
    shard groups innermost in dp; ep's groups neighbouring dp ranks): a group whose stride x size exceeds a node's
    GPUs crosses nodes."""
    p = cfg.parallel
    shard = dp_shard_size(cfg, dp)
    fsdp = (p.tp, dp * p.cp) if shard == dp else (p.tp, shard * p.cp)
    return {"dp": fsdp, "dp_replicate": (p.tp * p.cp * shard, dp // shard), "tp": (1, p.tp), "cp": (p.tp, p.cp),
            "ep": (p.tp * p.cp, p.ep), "pp": (dp * p.cp * p.tp, p.pp)}


def step_time(cfg: JobConfig, world: int, comm: dict[str, float], hw: Hardware) -> dict:
    """Predicted seconds per optimizer step on one GPU, and their breakdown.

    compute: the step's model FLOPs (``model/flops.py``: 6 N per token plus attention, MoE counting the routed
    experts) over every GPU evenly, at ``peak x mfu``; full activation checkpointing runs the forward again (x 4/3;
    every k-th block: x (1 + 1/(3k))), selective only elementwise ops (x 1).
    pipeline bubble (pp > 1): (pp - 1) / m of the compute for gpipe and 1f1b, / (m v) for the interleaved schedules
    (v stages per rank; taken for zero_bubble too, an upper bound). Each dimension's bytes (``comm_bytes``) move at the
    intra-node bandwidth when its groups fit in a node, else at the inter-node one. What overlaps, as the engines do
    it: DDP's bucketed all-reduce and HSDP's all-reduce across replicas run during the last micro-batch's backward
    (2/3 of its compute); FSDP2's gathers and reduce-scatters, prefetched a layer ahead, during all of the compute;
    tensor-, expert- and context-parallel exchanges and the pipeline's sends sit on the critical path (exposed)."""
    from hybridtron.model.flops import flops_per_token

    p, t = cfg.parallel, cfg.train
    dp = resolve_layout(cfg, world)
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    tokens = t.micro_batch_size * cfg.data.seq_len * t.grad_accum_steps * dp  # per step, all GPUs
    model_flops = flops_per_token(cfg.model, vocab, cfg.data.seq_len) * tokens / world
    mode = checkpointing_mode(t)  # full re-runs the checkpointed blocks' forward (1 of every k blocks: 1/k of it);
    # selective recomputes only elementwise ops between the matmuls it keeps, counted as nothing
    done = model_flops * (1 + 1 / 3 / t.activation_checkpointing_every if mode == "full" else 1.0)
    compute = done / (hw.peak_tflops * 1e12 * hw.mfu)
    bubble = 0.0
    if p.pp > 1:
        bubble = compute * (p.pp - 1) / (t.grad_accum_steps * p.pp_stages_per_rank)
    strides = _strides(cfg, dp)
    seconds, exposed, links = {}, {}, {}
    last_backward = compute / t.grad_accum_steps * 2 / 3
    for dim, volume in comm.items():
        if not volume:
            continue
        stride, size = strides[dim]
        inter = stride * size > hw.gpus_per_node
        links[dim] = "inter-node" if inter else "intra-node"
        seconds[dim] = volume / ((hw.inter_node_gbps if inter else hw.intra_node_gbps) * 1e9)
        if dim == "dp":
            exposed[dim] = max(0.0, seconds[dim] - (compute if p.zero_stage >= 2 else last_backward))
        elif dim == "dp_replicate":
            exposed[dim] = max(0.0, seconds[dim] - last_backward)
        else:
            exposed[dim] = seconds[dim]
    total = compute + bubble + sum(exposed.values())
    return {"step_s": total, "compute_s": compute, "bubble_s": bubble, "comm_s": seconds, "exposed_s": exposed,
            "links": links, "tokens_per_s": tokens / total,
            "mfu": model_flops / total / (hw.peak_tflops * 1e12)}


# ---- the table -------------------------------------------------------------------------------------------------
def n_params(cfg: JobConfig) -> int:
    from hybridtron.model import GatedLM

    with torch.device("meta"):
        model = GatedLM(cfg.model, cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size))
    return model.num_params()


def with_zero_stage(cfg: JobConfig, zero_stage: int) -> JobConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=zero_stage))


def plan_table(cfg: JobConfig, world: int, gpu_memory_gib: float, stages=(0, 2, 3), hw: Hardware | None = None
               ) -> list[dict]:
    """One row per ZeRO stage the layout accepts (one row when nothing is data parallel): the heaviest planned
    rank's memory by category (GiB), whether it fits, GB it sends per step in every dimension (and in all), and
    every planned rank's peak (pipeline stages). A stage the layout refuses is a row with its reason."""
    refusals = {}
    for z in stages:
        try:
            dp = resolve_layout(with_zero_stage(cfg, z), world)  # the same for every stage the layout accepts
        except ConfigError as e:
            refusals[z] = e
    if len(refusals) == len(stages):
        raise refusals[stages[0]]
    if dp * cfg.parallel.cp == 1:  # nothing to shard over: every ZeRO stage is the same layout
        stages, refusals = (cfg.parallel.zero_stage,), {}
    P = n_params(cfg)
    rows = []
    for z in stages:
        if z in refusals:
            rows.append({"zero_stage": z, "refused": str(refusals[z])})
            continue
        cz = with_zero_stage(cfg, z)
        per_rank = simulate(cz, world)
        rank = max(per_rank, key=lambda r: per_rank[r]["memory"]["total"])
        mem, facts = per_rank[rank]["memory"], per_rank[rank]["facts"]
        comm = comm_bytes(cz, world, facts)
        time = step_time(cz, world, comm, hw or Hardware())
        rows.append({"time": time, "zero_stage": z, "dp": dp, "dp_shard": dp_shard_size(cz, dp), "params": P, "rank": rank,
                     "stages": facts["stages"],
                     **{k: v / GIB for k, v in mem.items()}, "fits": mem["total"] / GIB <= gpu_memory_gib,
                     "comm_gb": {k: v / 1e9 for k, v in comm.items()}, "comm_gb_per_step": sum(comm.values()) / 1e9,
                     "rank_peaks_gib": {r: v["memory"]["total"] / GIB for r, v in per_rank.items()}})
    return rows


def format_table(cfg: JobConfig, rows: list[dict], world: int, gpu_memory_gib: float) -> str:
    p = cfg.parallel
    dp, dp_shard = next((r["dp"], r["dp_shard"]) for r in rows if "refused" not in r)
    hsdp = dp_shard < dp  # the dp column is then the shard groups' traffic, dp_replicate the all-reduce across them
    dims = ["dp", *(["dp_replicate"] if hsdp else [])] + [k for k in DIMS[1:] if getattr(p, k) > 1]
    layout = ", ".join(f"{k}={dp if k == 'dp' else getattr(p, k)}" for k in DIMS if k == "dp" or getattr(p, k) > 1)
    if hsdp:
        layout = layout.replace(f"dp={dp}", f"dp={dp} (HSDP: dp_replicate={dp // dp_shard} x dp_shard={dp_shard})", 1)
    head = (f"{n_params(cfg) / 1e6:.1f}M parameters; {world} GPUs, {layout}; micro-batch "
            f"{cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, {cfg.train.grad_accum_steps} per step; "
            f"{'bf16' if _compute_dtype(cfg) is not None else 'fp32'} compute; activation checkpointing "
            f"{_checkpointing_label(cfg)}; per-GPU peak in GiB of {gpu_memory_gib:g}")
    notes = []
    if p.pp > 1:
        notes.append(f"pipeline schedule {p.pp_schedule}: each row is the heaviest stage's first rank (all stages "
                     f"are planned: see 'stage peaks')")
    if cfg.model.moe.n_experts:
        notes.append("MoE routing assumed balanced (every expert gets an equal share of the token assignments)")
    lines = [head, *notes,
             "| zero_stage | rank (stage) | weights | gathered | grads | optimizer | activations | peak | fits | "
             + " | ".join(f"{k} GB/step" for k in dims) + " | comm GB/step |",
             "|---" * (9 + len(dims) + 1) + "|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['zero_stage']} | refused: {r['refused']} |")
            continue
        stage = ",".join(str(s) for s in r["stages"])
        lines.append(f"| {r['zero_stage']} | {r['rank']} ({stage}) | {r['weights']:.3f} | {r['gathered']:.3f} | "
                     f"{r['grads']:.3f} | {r['optimizer']:.3f} | {r['activations']:.3f} | {r['total']:.3f} | "
                     f"{'yes' if r['fits'] else 'NO'} | "
                     + " | ".join(f"{r['comm_gb'][k]:.3f}" for k in dims) + f" | {r['comm_gb_per_step']:.3f} |")
    lines += ["", "step time (prediction: compute at the configured peak x MFU, communication at the configured "
                  "bandwidths, overlapped as the engine does; seconds per step)",
              "| zero_stage | compute | bubble | " + " | ".join(f"{k} comm (exposed)" for k in dims)
              + " | step | tokens/s | MFU |", "|---" * (6 + len(dims)) + "|"]
    for r in rows:
        if "refused" in r:
            continue
        tm = r["time"]
        lines.append(f"| {r['zero_stage']} | {tm['compute_s']:.3f} | {tm['bubble_s']:.3f} | "
                     + " | ".join(f"{tm['comm_s'].get(k, 0):.3f} ({tm['exposed_s'].get(k, 0):.3f}"
                                  + (f", {tm['links'][k]})" if k in tm["links"] else ")") for k in dims)
                     + f" | {tm['step_s']:.3f} | {tm['tokens_per_s']:,.0f} | {100 * tm['mfu']:.1f}% |")
    for r in rows:
        if "host" in r:
            lines.append(f"zero_stage {r['zero_stage']}, parallel.offload=cpu: {r['host']:.3f} GiB of sharded weights, "
                         f"gradients and optimizer state in host memory per rank, outside the GPU peak")
    for r in rows:
        if "refused" not in r and len(r["rank_peaks_gib"]) > 1:
            peaks = ", ".join(f"rank {k} (stage {i}) {v:.3f}" for i, (k, v) in enumerate(r["rank_peaks_gib"].items()))
            lines.append(f"stage peaks at zero_stage {r['zero_stage']}: {peaks}")
    return "\n".join(lines)


def measure(cfg: JobConfig, mesh: Mesh, device: torch.device) -> dict:
    """The real peak of this rank over the same two steps in the job's own layout (``mesh``: the running job's)."""
    return step_peak(cfg, mesh, fake=False, device=device)["memory"]


def release_distributed_state() -> None:
    """After the measured step's process group is destroyed: drop what still refers to it (DTensor's per-mesh
    sharding cache, the step's garbage), so no gloo object outlives it into interpreter shutdown. Without this
    a rank aborted at exit about once in six runs ("terminate called without an active exception")."""
    import gc

    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    gc.collect()


def gather_measurements(mesh: Mesh, mine: dict) -> dict[int, dict]:
    """Every rank's ``measure`` on every rank: {rank: memory}."""
    if not mesh.distributed:
        return {0: mine}
    everyone = [None] * mesh.world_size
    dist.all_gather_object(everyone, mine)
    return dict(enumerate(everyone))


def compare(cfg: JobConfig, world: int, measured: dict[int, dict]) -> dict:
    """The prediction for the heaviest planned rank beside what that rank measured: on a GPU the allocator's own
    peak (torch.cuda.max_memory_allocated: every tensor of the real step, the trackers' blind spots included), on
    the CPU the tracked peak of the real tensors."""
    on_gpu = any("cuda_max_allocated" in m for m in measured.values())
    predicted = simulate(cfg, world, kernels="gpu" if on_gpu else "cpu")  # the kernels the measured step ran
    rank = max(predicted, key=lambda r: predicted[r]["memory"]["total"])
    pred, real = predicted[rank]["memory"], measured[rank]

    def peak(m: dict) -> float:
        return m.get("cuda_max_allocated", m["total"])

    # The measured step ran min(accum, 2) micro-batches outside a pipeline (``step_peak``): the volumes for those.
    n_micro = cfg.train.grad_accum_steps if cfg.parallel.pp > 1 else min(cfg.train.grad_accum_steps, 2)
    cm = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=n_micro))

    def comm(r: int) -> dict:
        sent = measured[r].get("comm_sent", {})
        volumes = comm_bytes(cm, world, predicted[r]["facts"])
        return {"comm_measured_gb": sum(sent.values()) / 1e9, "comm_predicted_gb": sum(volumes.values()) / 1e9,
                "comm_predicted_gb_by_dim": {k: v / 1e9 for k, v in volumes.items() if v},
                "comm_measured_gb_by_op": {k: v / 1e9 for k, v in sent.items()}}

    real = {k: v for k, v in real.items() if k != "comm_sent"}

    dp = resolve_layout(cfg, world)
    return {"dp": dp, "dp_shard": dp_shard_size(cfg, dp), "tp": cfg.parallel.tp, "pp": cfg.parallel.pp,
            "ep": cfg.parallel.ep, "cp": cfg.parallel.cp,
            "zero_stage": cfg.parallel.zero_stage, "rank": rank,
            "measured_gib": {k: v / GIB for k, v in real.items()}, "predicted_gib": {k: v / GIB for k, v in pred.items()},
            "predicted_over_measured": pred["total"] / peak(real),
            **comm(rank),
            "ranks": {r: {"predicted_gib": predicted[r]["memory"]["total"] / GIB,
                          "measured_gib": peak(measured[r]) / GIB, **comm(r)} for r in predicted}}
