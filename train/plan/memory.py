"""One rank's training step on fake tensors over a fake process group of the whole world (see the package's
docstring): its peak memory by category, per planned rank."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _UpdateType, _WeakRefInfo
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

from hybridtron.configs import ConfigError, JobConfig
from hybridtron.train.device import autocast_dtype
from hybridtron.train.parallel.context_parallel import local_piece
from hybridtron.train.parallel.mesh import Mesh
from hybridtron.train.plan.collectives import CollectiveBytes

GIB = 1 << 30
CATEGORIES = {  # tracker category (enum name) -> what the plan calls it
    "PARAM": "weights", "SHARDED_PARAM": "weights", "BUFFER": "weights",
    "UNSHARDED_PARAM": "gathered", "ALL_GATHER": "gathered",
    "GRAD": "grads", "SHARDED_GRAD": "grads", "UNSHARDED_GRAD": "grads", "REDUCE_SCATTER": "grads",
    "OPT": "optimizer",
    "ACT": "activations", "TEMP": "activations",
    # a pipeline's receive buffers (``_receive_buffers``), the only tensors ``_tracker`` tells either tracker of:
    # FSDP2's as inputs, the plain one's as external tensors ("Other")
    "INP": "pp_buffers", "OTH": "pp_buffers",
}
DIMS = ("dp", "tp", "pp", "ep", "cp")


def with_zero_stage(cfg: JobConfig, zero_stage: int) -> JobConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=zero_stage))


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

        device = _fake_device(func, args)
        if device is not None:
            return device
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


def _fake_device(func, args) -> torch.device | None:
    """A fake tensor's device, as the fake tensor itself answers ``prim.device`` (FakeTensor.__torch_dispatch__), for
    the Python modes above it to return at once: C++ code asks a tensor's device often (502 of the 856 ops one
    dense_1b layer added to a step under ZeRO-3), and each question went through every mode."""
    from torch._subclasses.fake_tensor import FakeTensor

    if func is torch.ops.prim.device.default and len(args) == 1 and isinstance(args[0], FakeTensor):
        return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
    return None


def _own_fake_mode_for_dtensor_shapes():
    """DTensor computes each op's output shape on fake tensors of the global shape, in the active fake mode when
    there is one. In the fake run that is the plan's own, and the trackers would count those whole-size tensors as
    if the rank held them; with a fake mode of its own (as in a real run) they stay apart."""
    from unittest import mock

    import torch.distributed.tensor._sharding_prop as sharding_prop

    return mock.patch.object(sharding_prop, "detect_fake_mode", lambda *_args, **_kwargs: None)


class _LazyChunks:
    """``torch.chunk(tensor, n, dim)`` padded to ``n`` pieces with empty tensors (FSDP2's ``_chunk_with_empty``),
    each piece made when it is read. FSDP2 reads two of them per parameter (its rank's and the first, for the padded
    size), but ``torch.chunk`` makes all ``n``: on fake tensors over 512 ranks that was 0.26 s per parameter, most of
    the plan of dense_1b on 64 nodes (6.5 of 9.6 s CPU for a one-layer rank under the profiler)."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        self.size = tensor.size(dim)
        self.step = -(-self.size // n)  # torch.chunk's piece length: ceil(size / n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        i = i + self.n if i < 0 else i
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.size == 0:  # torch.chunk of an empty dimension: n empty views
            return self.tensor.narrow(self.dim, 0, 0)
        start = i * self.step
        if start < self.size:
            return self.tensor.narrow(self.dim, start, min(self.step, self.size - start))
        return self[0].new_empty(0)  # as _chunk_with_empty pads

    def __iter__(self):
        return (self[i] for i in range(self.n))


def _cheap_fsdp_chunks():
    from unittest import mock

    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return mock.patch.object(_fsdp_param, "_chunk_with_empty", _LazyChunks)


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


def outside_a_process_group() -> None:
    """The planner makes fake process groups of its own: refused inside a real one (under torchrun)."""
    if dist.is_initialized():
        raise ConfigError("hybridtron plan simulates other layouts in one process: run it without torchrun "
                          "(torchrun is for --measure)")


# ---- the simulated (or real) rank ------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(cfg: JobConfig, world: int, rank: int):
    """The ``Mesh`` rank ``rank`` of a ``world``-process job would get, over a fake process group in this
    process: ``Mesh.setup`` itself builds it (checks, device mesh, expert mesh, context-parallel groups), reading
    the launcher's variables, which are set for it meanwhile. Its layout and kernel rules are checked for the
    cluster's GPUs (``target_layout``, as the plan checked them before), not for this host's CPU: ``train.fp8``
    is planned as the cluster runs it (torchao's FP8 matmuls, not refused for want of FP8 tensor cores here)."""
    outside_a_process_group()
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
        with _cluster_layout(), Mesh.setup(cfg, torch.device("cpu")) as mesh:
            yield mesh
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _ClusterLayoutRules:
    """``Mesh.setup``'s layout check (``Layout.from_config`` with the fake devices' type, the CPU) replaced by the
    cluster's (``target_layout``: its GPUs taken as present, FP8 tensor cores included)."""

    @staticmethod
    def from_config(cfg: JobConfig, world: int, *_args, **_kwargs):
        from hybridtron.train.parallel.layout import target_layout

        return target_layout(cfg, world)


def _cluster_layout():
    from unittest import mock

    from hybridtron.train.parallel import mesh as mesh_module

    return mock.patch.object(mesh_module, "Layout", _ClusterLayoutRules)


def build_rank(cfg: JobConfig, mesh: Mesh, device: torch.device, vocab: int, amp: torch.dtype | None,
               like: dict[int, int] | None = None):
    """(the engine, ``rank_facts``) of ``mesh``'s rank, built as train/engine.py's ``build_engine`` builds it, in
    its order. ZeRO-0 stays unwrapped (module docstring); ``amp``: the autocast dtype FSDP's mixed precision
    follows. ``like`` (the planner's reduced rank, ``train/plan/reduced.py``): every layer of the rank -> the layer
    of its kind built for it; only those are built, the others are None, as a pipeline cut leaves them, and the
    built ones keep their indices (and so their kinds: the mixer, the feed-forward and whether they recompute are
    chosen by index)."""
    from hybridtron.model import GatedLM
    from hybridtron.train.engine import engine_over
    from hybridtron.train.optim import build_optimizer
    from hybridtron.train.parallel.parallelize import apply_run_data_parallel, parallelize

    torch.manual_seed(cfg.train.seed)
    keep = None if like is None else set(like.values())
    if keep is None:
        with torch.device(device):
            model = GatedLM(cfg.model, vocab)
            model.init_weights()
    else:  # built on the meta device and cut first: the dropped layers cost nothing (0.26 s for dense_1b on fakes)
        with _disable_current_modes(), torch.device("meta"):  # plain meta tensors, not the fake mode's
            model = GatedLM(cfg.model, vocab)
        for i in range(len(model.layers)):
            if i not in keep:
                model.layers._modules[str(i)] = None
        # to_empty's empty_like would read the meta tensors, which the fake mode refuses; a fresh tensor of each shape
        model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
        model.init_weights()
    applied = parallelize(model, cfg, mesh, device, amp, data_parallel=False)  # the trainer's order, up to DP
    facts = rank_facts(cfg, model, mesh, like)  # before FSDP shards what data parallelism exchanges
    apply_run_data_parallel(model, applied, cfg, mesh, amp, replicate=False)
    return engine_over(cfg, model, build_optimizer(model, cfg.train), mesh, device, amp, applied), facts


@dataclasses.dataclass(frozen=True)
class _Action:
    """A pipeline action as torch's schedules name them (``_Action``'s stage_index and computation_type.value)."""

    stage_index: int
    kind: str

    @property
    def computation_type(self):
        return self

    @property
    def value(self) -> str:
        return self.kind


def sent_dtype(pipeline) -> torch.dtype:
    """The dtype of the residual stream pipeline stages send each other (and of its gradient), as torch's stages
    learn it from the sender's output: FSDP2's ``param_dtype`` where the stages are sharded with mixed precision
    (bf16 under bf16 training: FSDP2 casts each block's inputs to it, so the stream is bf16 from the embedding on),
    else fp32 (plain fp32 weights: the stream stays fp32 under autocast). Measured on a real 4-process gloo run of
    a tiny model, pp 2: bf16 buffers with dp 2 and ZeRO-3, fp32 with dp 1."""
    from torch.distributed.fsdp import FSDPModule

    for stage in pipeline.stages:
        if isinstance(stage, FSDPModule):
            return stage._get_fsdp_state()._mp_policy.param_dtype or torch.float32
    return torch.float32


def pipeline_orders(cfg: JobConfig) -> dict[int, list] | None:
    """Every pp rank's actions in the configured training schedule (torch's ``pipeline_order``, idle slots left
    out), as a built rank's schedule has them (``ReplayedSchedule.order``, its own): the same schedule
    (``pipeline.training_schedule``) built over stages of empty modules in a fake process group of pp ranks. None
    outside a pipeline. The schedule's order depends on the stage and micro-batch counts alone."""
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from hybridtron.train.parallel.pipeline import n_stages, stage_ids, training_schedule

    p = cfg.parallel
    if p.pp == 1:
        return None
    outside_a_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.pp)
    try:
        stages = [PipelineStage(torch.nn.Module(), s, n_stages(cfg), torch.device("cpu"), group=dist.group.WORLD)
                  for s in stage_ids(cfg, 0)]  # pp rank 0's stages
        schedule = training_schedule(p.pp_schedule, stages, cfg.train.grad_accum_steps)
        return {r: [a for a in order if a is not None] for r, order in schedule.pipeline_order.items()}
    finally:
        dist.destroy_process_group()


# Warm-up forwards a shortened 1F1B stage keeps (``ReplayedSchedule.shorten``): two, for the second's leftover to be
# what each further one holds (the first's includes what a step's first forward leaves, ZeRO-2's gathered weights).
WARM_UPS = 2
# (forward, backward) pairs it keeps: the first makes the gradients, the second is one of the rest, and what it
# leaves behind (from its start to the next action's) what each of them leaves
PAIRS = 2


class ReplayedSchedule:
    """The configured torch schedule for one pipeline rank, run on fake tensors in this process: its own action
    order (``pipeline_order``) replayed on the rank's stage modules (see the module docstring). Forwards and
    backwards of one stage pair up first in, first out, as every torch schedule orders them."""

    def __init__(self, pipeline, device: torch.device, warm: bool = False):
        self.pipeline, self.device, self.torch_schedule = pipeline, device, pipeline.schedule
        self.order = [a for a in pipeline.schedule.pipeline_order[pipeline.mesh.pp_rank] if a is not None]  # no idle
        self.n_stages, self.n_micro = len(pipeline.ranges), pipeline.n_micro
        self.modules = dict(zip(pipeline.stage_ids, pipeline.stages, strict=True))
        self.recv: dict[tuple[str, int, int], torch.Tensor] = {}  # torch's per-micro-batch receive buffers
        # ``warm``: the next step is a first step that only leaves behind what later steps find (``ready_rank``'s
        # ``quick``): one micro-batch forward and backward through each of the rank's stages, every receive buffer
        # allocated, FSDP's gradients reduced and resharded as after a last micro-batch
        self.warm = warm
        # what a (not warm) step runs: every micro-batch in the configured order, or fewer (``shorten``), with
        # ``tail`` the indices in ``traced_order`` of the two actions that start its shifted tail and the next period
        self.traced, self.traced_order, self.tail, self.left_out, self.warm_up = self.n_micro, self.order, None, 0, None
        self.extra_warm_ups, self.short = 0, False
        self.watch = None  # called with each action's index in ``traced_order`` before it runs (``tracked_step``)

    def shorten(self) -> bool:
        """Trace 1F1B with as few micro-batches as shape its memory: v + min(m - w, 2) on a stage with w warm-up
        forwards (pp - 1 - s), v = min(w, ``WARM_UPS``). Its actions are w forwards, then m - w pairs (forward,
        backward), then w backwards. The first pair is a step's first backward (it makes the gradients); every
        later pair repeats the one before with w micro-batches in flight, and holds only what each finished
        micro-batch leaves behind (the gradient received into its activation buffer, a logged loss) in addition.
        So from the second pair on (``tail``) the step's memory is that of two pairs plus m - w - 2 times what
        one pair leaves behind (measured between the second pair's start and the next action's: ``tracked_step``),
        and the pairs left out hold no more than the second does then (with one pair, it is traced; the last
        stage, whose second pair's backward is its last, keeps a third pair for the measurement). Likewise
        every warm-up forward after the first leaves its micro-batch's activations held and nothing else: from the
        first pair to the last backward (``warm_up``), w warm-ups hold w - v times what one leaves (measured
        between the starts of the v-th warm-up and the first pair's forward) more than v do; the first backwards
        of the cooldown, with fewer in flight than a pair's, hold less than it, the last the same. Every receive
        buffer stays allocated (the first step allocated m). A stage alike in all but w, with 2 pairs or more,
        takes the same trace with its own w - v (``reduced.plan_ranks``). Returns whether the step is shortened
        (1F1B with one stage per rank, fewer actions traced than it runs)."""
        from torch.distributed.pipelining import Schedule1F1B

        schedule = self.torch_schedule
        if type(schedule) is not Schedule1F1B or len(self.modules) != 1:
            return False
        w = self.n_stages - 1 - self.pipeline.mesh.pp_rank
        pairs = self.n_micro - w
        # (torch ends the order with a REDUCE_GRAD, which the replay leaves to FSDP's last backward)
        kinds = [a.computation_type.value for a in self.order if a.computation_type.value != "REDUCE_GRAD"]
        if kinds != ["F"] * w + ["F", "B"] * pairs + ["B"] * w:
            return False  # not the order the shortcut is worked out for (another torch)
        # the last stage (no cooldown) keeps a third pair: its second pair's backward is its last (FSDP's reduction)
        keep = PAIRS if w else PAIRS + 1
        v, p = min(w, WARM_UPS), min(pairs, keep)  # fewer pairs: all of them, no tail
        if v == w and p == pairs:
            return False
        stage = self.order[0].stage_index
        order = [_Action(stage, "F")] * v + [_Action(stage, "F"), _Action(stage, "B")] * p + [_Action(stage, "B")] * v
        self.traced, self.traced_order, self.left_out, self.short = v + p, order, pairs - p, True
        self.tail = (v + 2, v + 4) if p == keep else None  # v + 4: a cooldown backward, or the third pair
        # where the held warm-ups are measured and the shifted places start and end; the stage's own w - v
        self.warm_up = (v - 1, v, len(order) - 1) if v == WARM_UPS else None
        self.extra_warm_ups = w - v
        return True

    def _buffer(self, kind: str, stage: int, mb: int, like: torch.Tensor) -> torch.Tensor:
        """The receive buffer ``kind`` ("act" or "grad") of ``stage`` for micro-batch ``mb``; ``like``: a (B, T)
        tensor of the micro-batch (its labels, which reach every stage)."""
        key = (kind, stage, mb)
        if key not in self.recv:
            # Between stages the residual stream: (B, T / (cp tp), d) in the dtype the stages send (``sent_dtype``)
            shape = (like.shape[0], like.shape[1] // self.pipeline.mesh.tp, self.pipeline.model.cfg.d_model)
            self.recv[key] = torch.empty(shape, dtype=sent_dtype(self.pipeline), device=self.device)
        return self.recv[key]

    def step(self, *args, target=None, losses=None, return_outputs=False, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        from hybridtron.train.parallel.pipeline import stage_loss

        n = self.n_micro  # (a shortened step runs the first ``traced`` of them: the batch is the whole step's)
        ids = args[0].chunk(n) if args else None
        labels = target.chunk(n) if target is not None else None
        kw = [{k: v.chunk(n)[m] for k, v in kwargs.items()} for m in range(n)]
        for key, buf in self.recv.items():
            if key[0] == "act":
                buf.grad = None  # torch clears the received activations' gradients at the start of a step
        held = {s: [] for s in self.modules}
        started = {s: 0 for s in self.modules}
        backwards = {s: 0 for s in self.modules}
        order, n_last, watch = self.traced_order, self.traced, self.watch
        if self.warm:
            self.warm = False
            for s in self.modules:
                for m in range(self.n_micro):
                    if s > 0:
                        self._buffer("act", s, m, kw[m]["labels"])
                    if s < self.n_stages - 1:
                        self._buffer("grad", s, m, kw[m]["labels"])
            order = [_Action(s, "F") for s in sorted(self.modules)] + [_Action(s, "B") for s in sorted(self.modules,
                                                                                                      reverse=True)]
            n_last, watch = 1, None
        for index, action in enumerate(order):
            if watch is not None:
                watch(index)
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
                    last = backwards[s] == n_last
                    module.set_is_last_backward(last)
                    module.set_reshard_after_backward(last)
                    module.set_requires_gradient_sync(last)
                if s == self.n_stages - 1:
                    out.backward()
                else:
                    out.backward(self._buffer("grad", s, m, kw[m]["labels"]))
        return None


def _batch(cfg: JobConfig, vocab: int, device: torch.device) -> dict:
    """A micro-batch of random tokens (and one document when the model masks documents) on ``device``, as the
    trainer moves its batches there (the token ids must meet the embedding on its device)."""
    x = torch.randint(0, vocab, (cfg.train.micro_batch_size, cfg.data.seq_len), device=device)
    batch = {"input_ids": x, "labels": x}
    if cfg.model.doc_mask:
        batch["doc_ids"] = torch.zeros_like(x)
    return batch


@contextlib.contextmanager
def _state_only():
    """AdamW's step creating its state (``_init_group``) but updating nothing: the update's dozen ops per
    parameter change values only, which fake tensors do not have (a third of the optimizer's CPU time in the
    plan). The step counters stay 0, a tensor each all the same."""
    from unittest import mock

    import torch.optim.adam as adam

    with contextlib.ExitStack() as stack:
        for name in ("_single_tensor_adam", "_multi_tensor_adam", "_fused_adam"):
            if hasattr(adam, name):
                stack.enter_context(mock.patch.object(adam, name, lambda *args, **kwargs: None))
        yield


def _train_step(engine, n_micro: int, vocab: int, keep_grads: bool = False, update: bool = True, also=()) -> None:
    """One optimizer step over ``n_micro`` micro-batches through ``engine``'s own ``run`` and ``update``, as the
    trainer takes it (train/trainer.py ``train_step``): each micro-batch this rank's piece of its sequences, every
    position labelled, so each loss weight is 1 (None: what ``step.loss_weights`` gives such batches).
    ``keep_grads`` leaves the gradients for the next step to accumulate into (``ready_rank``'s ``quick``);
    ``update`` False stops after the backward (no clipping, no optimizer step); ``also``: parameters outside the
    model whose gradients are clipped with its own (layers left out of a step, ``tracked_step``)."""
    loss, _ = engine.run(_MicroBatches(engine, vocab, n_micro), [None] * n_micro)
    engine.reduce_gradients()
    if update:
        engine.update(loss, lambda _loss, _norm: True, keep_grads=keep_grads, also=also)


class _MicroBatches:
    """A step's ``n`` micro-batches (``_batch``), each this rank's piece of its sequences (context parallel), made
    when the step reads it: the trainer's lie on the host and go to the device one at a time (train/step.py), so
    the plan's device, where they are made, holds one at a time too (a pipeline's step takes them all at once)."""

    def __init__(self, engine, vocab: int, n: int):
        self.engine, self.vocab, self.n = engine, vocab, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        engine = self.engine
        return local_piece(_batch(engine.cfg, self.vocab, engine.device), engine.mesh)


class _Runs:
    """The planner's side of a ``TorchEngine`` (the model runs whole on every micro-batch): how many micro-batches
    a tracked step runs and what the rank holds beyond its modules. One class per engine (``_runs``), so that the
    planner asks no engine which it is."""

    accumulates = True  # a step can run one micro-batch on the gradients an earlier one left (``ready_rank``)

    def __init__(self, engine):
        self.engine = engine

    def n_micro(self, accum: int) -> int:
        """Two: the second already holds the accumulated gradients beside a micro-batch's activations, so later
        ones change nothing."""
        return min(accum, 2)

    def replay(self, device: torch.device, warm: bool) -> None:
        """On fake tensors: run the step as it is (nothing to replace)."""

    def schedule(self):
        return None

    def receive_buffers(self) -> list[torch.Tensor]:
        return []


class _PipelineRuns(_Runs):
    """The planner's side of a ``PipelineEngine``: every micro-batch runs (how many are in flight is what the
    schedule decides); on fake tensors its schedule is replayed (``ReplayedSchedule``); the stages' receive
    buffers are held from step to step."""

    accumulates = False

    def n_micro(self, accum: int) -> int:
        return accum

    def replay(self, device: torch.device, warm: bool) -> None:
        pipeline = self.engine.pipeline
        pipeline.schedule = ReplayedSchedule(pipeline, device, warm=warm)
        pipeline._warm = pipeline._warm or warm  # torch's stages learn their shapes first; the replay need not

    def schedule(self):
        return self.engine.pipeline.schedule

    def receive_buffers(self) -> list[torch.Tensor]:
        return _receive_buffers(self.engine.pipeline)


def _runs(engine) -> _Runs:
    from hybridtron.train.engine import PipelineEngine, TorchEngine

    return {TorchEngine: _Runs, PipelineEngine: _PipelineRuns}[type(engine)](engine)


class _PeakOnly:
    """torch's trackers update, after every op, the peak of every module they have seen (a loop over all of them:
    half the CPU time of a 4-layer dense_1b step under the profiler); the plan reads the rank's peak alone. A fake
    tensor's device is answered at once (``_fake_device``: no memory changes).

    With ``blocks`` ({layer index: block}) set, the peak is also kept per place of the step (``segments``): (phase,
    pass, layer, inside) where pass is "fw", "bw" (recomputation included) or "opt", phase counts the changes of
    pass (a pipeline's forwards and backwards of micro-batches, the gradient clipping after the backward), layer is
    the one of ``blocks`` running (inside True) or the last that ran in the phase (inside False: the embedding
    before any, the loss after the last, the collectives between two; None before any)."""

    blocks: dict[int, nn.Module] | None = None
    segments: dict[tuple, dict] = {}
    _phase, _pass, _last = 0, None, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = _fake_device(func, args)
        return device if device is not None else super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, reftype, t: torch.Tensor) -> None:
        """torch's ``MemTracker._track`` (every storage of a new op output counted under ``reftype``), but for
        every storage: torch's returns at the first it already knows. A tensor subclass has several (a Float8
        tensor's data and scale) in a set, whose order changes from run to run, so a new fp8 all-gather's output
        beside its known scale was counted in some runs and not in others; the plan of fp8 under tp varied by
        GiB between runs of the same command (bench/RESULTS.md, 2026-11-29)."""
        for st in get_untyped_storages(t):
            winfo, _ = self._WINFO.get(st, (None, None))
            if winfo is None:
                winfo, w_st = _WeakRefInfo.create_winfo(st, t.device, reftype, self._delete_callback)
                self._WINFO[st] = (winfo, w_st)
                if winfo.mem_consumed > 0:
                    self._update_snap(_UpdateType.ADD, winfo)
            elif winfo.size != st.size():
                old = winfo.mem_consumed
                winfo.update_mem_consumed(st)
                self._update_snap(_UpdateType.SIZE, winfo, old_mem_consumed=old)

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)
            if self.blocks is not None:
                place = self._place()
                seg = self.segments.get(place)
                if seg is None or seg[_TOTAL_KEY] < snap[_TOTAL_KEY]:
                    self.segments[place] = dict(snap)

    def _place(self) -> tuple:
        mods = self._mod_tracker
        where = "opt" if self._in_opt else "bw" if mods.is_bw else "fw"
        if where != self._pass:
            self._phase, self._pass, self._last = self._phase + 1, where, None
        running = [i for i, b in self.blocks.items() if mods._known_modules.get(b) in mods.parents]
        if not running:
            return self._phase, where, self._last, False
        # One block runs at a time, but a block whose inputs' gradients are not all computed stays among the
        # tracker's parents after its backward (seen with MoE layers): the latest is the lowest in backward.
        self._last = min(running) if where == "bw" else max(running)
        return self._phase, where, self._last, True


def _tracker(rank: ReadyRank, detached: list[nn.Module] = ()):
    """torch's memory tracker for the rank, told of what already exists: weights, optimizer state and (pipeline)
    the receive buffers of the first step, which later steps reuse. FSDP2's own tracker when FSDP wraps the
    roots (it tells sharded from gathered weights), else the plain one. ``detached``: layers left out of this step
    (``tracked_step``), whose weights, gradients and optimizer state it counts all the same."""
    from torch.distributed.fsdp import FSDPModule

    roots, model, optimizer = rank.engine.roots, rank.model, rank.optimizer
    buffers = rank.runs.receive_buffers()
    if isinstance(roots[0], FSDPModule):
        tracker = _FSDPMemTracker(roots[0], optimizer)
        if len(roots) > 1:  # several stages per rank: the tracker walks the modules of all (it takes one root)
            tracker._root_mod = nn.ModuleList(roots)
        tracker.detached = detached
        managed = {id(fp.sharded_param) for m in [*roots, *detached] for sub in m.modules()
                   if isinstance(sub, FSDPModule) and (group := sub._get_fsdp_state()._fsdp_param_group)
                   for fp in group.fsdp_params}
        tracker.unmanaged = [p for m in [*roots, *detached] for p in m.parameters() if id(p) not in managed]
        tracker.track_inputs(buffers)
        return tracker
    tracker = _MemTracker()
    tracker.track_external(model, *detached, optimizer, *buffers)
    return tracker


class _FSDPMemTracker(_PeakOnly, FSDPMemTracker):
    """FSDP2's tracker, which also counts the shards of ``detached`` blocks (left out of the step: no hooks, as
    they do not run; FSDP's root still calls their post-backward, which finds no gradient and does nothing), and
    the parameters FSDP2 does not manage (``unmanaged``: expert parallel's experts, ``ignored_params``) with their
    gradients, which torch's tracker sees neither (before, an ep2 rank of tiny_moe under ZeRO-2 missed its 1.2 MB
    of expert weights, and its expert gradients counted as activations, or not at all once they existed before the
    step). Their types are the FSDP tracker's that map to weights and gradients and stay on the GPU under
    ``parallel.offload`` (BUFFER, UNSHARDED_GRAD): FSDP2 does not offload what it ignores."""

    detached: list[nn.Module] = []
    unmanaged: list[nn.Parameter] = []

    def _register_module_and_optimizer_hooks(self) -> None:
        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
        from torch.distributed.fsdp import FSDPModule

        super()._register_module_and_optimizer_hooks()
        for block in self.detached:
            for m in block.modules():
                if isinstance(m, FSDPModule) and (group := m._get_fsdp_state()._fsdp_param_group):
                    self._instrument_fsdp_sharded_params_grads(group)
            for buffer in block.buffers():
                self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

        def grad_hook(p):
            self._update_and_maybe_create_winfos(p.grad, _FSDPRefType.UNSHARDED_GRAD)

        self._unmanaged_hooks = []
        for p in self.unmanaged:
            self._update_and_maybe_create_winfos(p, _FSDPRefType.BUFFER)
            if p.grad is not None:
                grad_hook(p)
            self._unmanaged_hooks.append(p.register_post_accumulate_grad_hook(grad_hook))

    def _deregister_module_and_optimizer_hooks(self) -> None:
        super()._deregister_module_and_optimizer_hooks()
        for handle in self._unmanaged_hooks:
            handle.remove()

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig_post_backward):
        """torch's wrapper, which tags the unsharded gradients before FSDP2's post-backward, then the gradients
        that post-backward keeps without reducing them: a micro-batch before a pipeline's last (gradient sync off)
        moves each block's unsharded gradient into ``unsharded_accumulated_grad``, a new tensor in the reduce dtype
        (fp32 beside bf16 weights), held until the last micro-batch reduces it. torch's tracker counted those as
        activations (the 405B layout on 512 GPUs: 23 GiB of its pipeline stage's gradients)."""
        from functools import wraps

        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

        inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig_post_backward)

        @wraps(inner)
        def tagged(*args, **kwargs):
            inner(*args, **kwargs)
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group else ():
                if fsdp_param.unsharded_accumulated_grad is not None:
                    self._update_and_maybe_create_winfos(fsdp_param.unsharded_accumulated_grad,
                                                         _FSDPRefType.UNSHARDED_GRAD)

        return tagged


class _MemTracker(_PeakOnly, MemTracker):
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


def rank_facts(cfg: JobConfig, model, mesh: Mesh, like: dict[int, int] | None = None) -> dict:
    """What the communication of the rank depends on: its parameters (without the ep-sharded experts, and those)
    and the layers and pipeline stages it holds. ``like`` (the planner's reduced rank, ``train/plan/reduced.py``):
    every layer of the rank -> a layer of its kind that ``model`` holds (itself, where it holds it)."""
    from hybridtron.model.mlp import SwiGLU
    from hybridtron.train.parallel.expert_parallel import expert_params
    from hybridtron.train.parallel.pipeline import n_stages as count_stages
    from hybridtron.train.parallel.pipeline import stage_ids

    def local(p):
        return p.to_local().numel() if isinstance(p, DTensor) else p.numel()

    experts = {id(p) for p in expert_params(model)}
    present = {i: block for i, block in enumerate(model.layers) if block is not None}
    like = like or {i: i for i in present}
    layers = sorted(like)
    per_layer = {i: (sum(local(p) for p in block.parameters() if id(p) not in experts),
                     sum(local(p) for p in block.parameters() if id(p) in experts)) for i, block in present.items()}
    types = cfg.model.layer_types()
    stages, n_stages = stage_ids(cfg, mesh.pp_rank), count_stages(cfg)
    in_layers = {id(p) for block in present.values() for p in block.parameters()}
    root = sum(local(p) for p in model.parameters() if id(p) not in experts | in_layers)
    return {"params": root + sum(per_layer[like[i]][0] for i in layers), "root_params": root,
            "expert_params": sum(per_layer[like[i]][1] for i in layers),
            "layers": len(layers), "attention_layers": sum(types[i] == "A" for i in layers),
            "delta_layers": sum(types[i] == "L" for i in layers),
            "moe_layers": sum(cfg.model.moe.is_moe_layer(i) for i in layers) if cfg.model.moe.n_experts else 0,
            "swiglu_layers": sum(isinstance(getattr(model.layers[like[i]], "mlp", None), SwiGLU) for i in layers),
            "stages": list(stages), "n_stages": n_stages,
            "embedding": 0 in stages, "head": n_stages - 1 in stages}


@contextlib.contextmanager
def fake_modes(cfg: JobConfig, kernels: str = "gpu"):
    """Fake tensors (with the values a shape needs, ``_KnownValues``), DTensor's shape rules kept apart, and the
    fused ops' backends of a GPU run (``kernels="gpu"``) or of a CPU one ("cpu")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with contextlib.ExitStack() as stack:
        fake_mode = stack.enter_context(FakeTensorMode())
        stack.enter_context(_KnownValues(fake_mode))
        stack.enter_context(_own_fake_mode_for_dtensor_shapes())
        stack.enter_context(_cheap_fsdp_chunks())
        if kernels == "gpu":
            stack.enter_context(gpu_kernels(cfg))
        yield


@dataclasses.dataclass
class ReadyRank:
    """A rank built and through its first step (its optimizer state exists), ready for ``tracked_step``."""

    cfg: JobConfig
    mesh: Mesh
    device: torch.device
    vocab: int
    amp: torch.dtype | None
    engine: object  # train/engine.py's, over the rank's model
    runs: _Runs  # the planner's side of the engine
    facts: dict
    n_micro: int  # micro-batches a tracked step runs
    zero_grad: bool  # whether a step ends by dropping its gradients (not under ``quick``)

    @property
    def model(self) -> nn.Module:
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def pipeline(self):
        """The rank's pipeline stages and schedule (a pipeline engine's only)."""
        return self.engine.pipeline


def ready_rank(cfg: JobConfig, mesh: Mesh, fake: bool, device: torch.device, quick: bool = False,
               like: dict[int, int] | None = None) -> ReadyRank:
    """``mesh``'s rank built (``build_rank``; with ``like``, the layers it maps to only) and through
    its first step. Step 1 creates the optimizer state (and, in a pipeline, torch's stages learn their shapes from
    it, by an autograd.grad that torch's module tracker cannot follow); the tracked step after it is the steady
    state. A non-pipeline step runs two micro-batches: the second already holds the accumulated gradients beside a
    micro-batch's activations, so later ones change nothing. A pipeline step runs them all: how many are in flight
    is what its schedule decides. ``quick`` (several micro-batches): outside a pipeline, the first step leaves its
    gradients and a tracked step runs one micro-batch, which accumulates into them as the second micro-batch of a
    step does, and leaves them for the next (the first micro-batch of a step, which starts without gradients,
    holds no more than the second at any point); in a pipeline the first step runs one micro-batch per stage
    (``ReplayedSchedule``'s ``warm``), not the whole schedule twice (torch's shape warm-up, then the step).
    ``tests/train/test_plan_reduced.py`` compares both with the step as it was.

    On fake tensors ``train.compile`` is off: torch.compile falls back to the eager blocks there (dense_1b planned
    the same 40.02 GiB either way) after tracing them in vain, 0.5 s of CPU per block and step."""
    if fake and cfg.train.compile:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    amp = _compute_dtype(cfg)  # the GPUs' autocast, applied to the CPU run alike (module docstring)
    engine, facts = build_rank(cfg, mesh, device, vocab, amp, like)
    runs = _runs(engine)
    if fake:
        runs.replay(device, warm=quick)
    accum = cfg.train.grad_accum_steps
    n_micro = runs.n_micro(accum)
    first_only = quick  # (a first step's update changes no memory)
    quick = quick and runs.accumulates and accum > 1
    with _state_only() if first_only and fake else contextlib.nullcontext():
        _train_step(engine, 1 if runs.accumulates else n_micro, vocab, keep_grads=quick)
    return ReadyRank(cfg, mesh, device, vocab, amp, engine, runs, facts, 1 if quick else n_micro, not quick)


@contextlib.contextmanager
def _left_out(rank: ReadyRank, layers):
    """The blocks of ``layers`` taken out of the model (and of the pipeline's stages) for a while: absent, as a
    pipeline cut leaves a layer, so a step neither runs nor gathers them. Yields them."""
    model = rank.model
    blocks = {i: model.layers[i] for i in layers}
    lists = [model.layers] + [root.layers for root in rank.engine.roots if root is not model]  # pipeline stages
    held = [(lst, str(i)) for lst in lists for i in blocks if lst._modules.get(str(i)) is not None]
    for lst, name in held:
        lst._modules[name] = None
    try:
        yield list(blocks.values())
    finally:
        for lst, name in held:
            lst._modules[name] = blocks[int(name)]


def shortened(rank: ReadyRank) -> ReadyRank:
    """``rank`` with its pipeline schedule traced on fewer micro-batches where that gives the same places' memory
    (``ReplayedSchedule.shorten``: 1F1B); its tracked steps must keep their places (``tracked_step``), which are
    those of the whole step."""
    schedule = rank.runs.schedule()
    if isinstance(schedule, ReplayedSchedule):
        schedule.shorten()
    return rank


def _watch_tail(tracker, schedule: ReplayedSchedule, device: torch.device):
    """For a shortened schedule (``ReplayedSchedule.shorten``): a callback for its actions that starts a new place
    of the step where its tail starts (and, with held warm-ups, where the first pair and the last backward start),
    and keeps the tracker's memory by type at the starts of the tail and of the period after it (and of the v-th
    warm-up forward and the first pair); and a function of the warm-ups to add that then returns the places with
    the left-out pairs' leftovers added to every place of the tail, and that many warm-ups' to every place from
    the first pair to the last backward."""
    marks, phases = {}, {}
    warm = schedule.warm_up or ()
    tail = schedule.tail or ()
    measured = {*tail, *warm[:2]}
    starts = {*tail[:1], *warm[1:]}

    def watch(index: int) -> None:
        if index in measured:
            snap = tracker._curr_mem_snap
            marks[index] = dict(snap[device] if device in snap else next(iter(snap.values())))
        if index in starts:
            phases[index] = tracker._phase + 1  # a new place starts here (a new phase: ``_PeakOnly._place``)
            tracker._pass = None

    def change(a: dict, b: dict) -> dict:
        return {k: b.get(k, 0) - a.get(k, 0) for k in a.keys() | b.keys()}

    def shift(segments: dict, extra_warm_ups: int) -> dict:
        per_pair = change(*(marks[i] for i in tail)) if tail else {}
        if extra_warm_ups and not warm:
            raise ValueError("this trace holds too few warm-up forwards to add more")
        per_warm_up = change(*(marks[i] for i in warm[:2])) if warm else {}
        # a stage with more warm-ups runs as many fewer pairs (m - w in all)
        left_out = schedule.left_out + schedule.extra_warm_ups - extra_warm_ups
        if left_out < 0:
            raise ValueError("a stage with that many warm-ups runs fewer pairs than the trace")
        out = {}
        for place, snap in segments.items():
            snap = dict(snap)
            if tail and place[0] >= phases[tail[0]]:
                for k, v in per_pair.items():
                    snap[k] = snap.get(k, 0) + left_out * v
            if warm and phases[warm[1]] <= place[0] < phases[warm[2]]:
                for k, v in per_warm_up.items():
                    snap[k] = snap.get(k, 0) + extra_warm_ups * v
            out[place] = snap
        return out

    return watch, shift


def tracked_step(rank: ReadyRank, left_out=(), counted=None, places: bool = False, update: bool = True):
    """One training step of ``rank`` under the memory tracker, the layers ``left_out`` absent from it (their
    weights, gradients and optimizer state counted, unchanged; their gradients clipped with the others'); returns
    the tracker. ``counted``: a context the step runs in (``CollectiveBytes``). ``places``: keep the peak of every
    place of the step too (``_PeakOnly``); a ``shortened`` rank's places are those of the whole step (its peak
    over all of them, not the tracker's peak). ``update`` False: no clipping or optimizer step (``_train_step``)."""
    schedule = rank.runs.schedule()
    short = isinstance(schedule, ReplayedSchedule) and schedule.short
    if short and not places:
        raise ValueError("a shortened pipeline step has the whole step's memory at its places only")
    with _left_out(rank, left_out) as detached:
        tracker = _tracker(rank, detached)
        if places:
            tracker.blocks = {i: b for i, b in enumerate(rank.model.layers) if b is not None}
            tracker.segments = {}
        shift = None
        if short:
            schedule.watch, shift = _watch_tail(tracker, schedule, rank.device)
        roots = rank.engine.roots

        # The trackers follow one call per module: a step calls the model (or a stage) once per micro-batch, so
        # each call starts the statistics of its modules afresh (those of a rank's other pipeline stages are still
        # awaited by their backward); the peak over all of them is kept. A global hook, registered before the
        # trackers' own, runs first.
        def fresh_module_stats(module, _args):
            if any(module is r for r in roots):
                for m in module.modules():
                    tracker.memory_tracking.pop(m, None)

        handle = nn.modules.module.register_module_forward_pre_hook(fresh_module_stats)
        try:
            with tracker, counted or contextlib.nullcontext():
                _train_step(rank.engine, rank.n_micro, rank.vocab, keep_grads=not rank.zero_grad, update=update,
                            also=[p for block in detached for p in block.parameters()])
        finally:
            handle.remove()
            if short:
                schedule.watch = None
    if shift is not None:  # the places of the whole step; ``tracker.shifted``: those of a stage with more warm-ups
        raw = tracker.segments
        tracker.shifted = lambda extra: shift(raw, extra)
        tracker.segments = tracker.shifted(schedule.extra_warm_ups)
    return tracker


def categories(by_type: dict, cfg: JobConfig, mesh: Mesh) -> dict:
    """Bytes by torch's tracker types (``_RefType`` or their names) -> bytes by plan category, with "total" (the
    tracker's own, else the sum) and, under ``parallel.offload=cpu``, "host" (what FSDP2 keeps in host memory,
    outside the GPU's peak)."""
    out = {"weights": 0.0, "gathered": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "pp_buffers": 0.0}
    host = {"SHARDED_PARAM": 0.0, "SHARDED_GRAD": 0.0, "OPT": 0.0}  # parallel.offload=cpu: FSDP2 keeps these there
    total = None
    for key, val in by_type.items():
        name = getattr(key, "name", key)
        if name == "Total":
            total = float(val)
        elif name in CATEGORIES:
            out[CATEGORIES[name]] += float(val)
            if name in host:
                host[name] += float(val)
    out["total"] = sum(out.values()) if total is None else total
    if cfg.parallel.offload == "cpu" and mesh.zero_stage >= 2:  # the shards and the optimizer live in host memory
        for name, val in host.items():  # (present all step long: their peaks are their size at the total's peak)
            out[CATEGORIES[name]] -= val
            out["total"] -= val
        out["host"] = sum(host.values())
    return out


def peak_by_type(tracker, device: torch.device) -> dict:
    """The tracker's peak snapshot of ``device`` (bytes by tracker type, and "Total")."""
    snap = tracker.get_tracker_snapshot("peak")
    return snap[device] if device in snap else next(iter(snap.values()))


def held_by(tracker, module: nn.Module, optimizer) -> dict:
    """Bytes by tracker type of the storages of ``module``'s parameters, their gradients and optimizer state, and
    its buffers, as ``tracker`` counted them (each storage once: FSDP2's gradients of a block share one)."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    tensors = [t for p in module.parameters() for t in (p, p.grad, *optimizer.state.get(p, {}).values())
               if isinstance(t, torch.Tensor)] + list(module.buffers())
    out, seen = {}, set()
    for t in tensors:
        for st in get_untyped_storages(t):
            winfo = tracker._WINFO.get(st, (None, None))[0]
            if winfo is not None and id(winfo) not in seen:
                seen.add(id(winfo))
                out[winfo.reftype] = out.get(winfo.reftype, 0) + winfo.mem_consumed
    return out


def step_peak(cfg: JobConfig, mesh: Mesh, fake: bool, device: torch.device | None = None, kernels: str = "gpu",
              quick: bool = False) -> dict:
    """Peak bytes of ``mesh``'s rank over a training step that has optimizer state (the second), by plan category,
    and its ``rank_facts``. ``fake``: on fake tensors (over a fake process group); else real, on ``device``
    (default CPU), in the process group already set up. On CUDA the allocator's own peak is added as
    ``cuda_max_allocated``. ``kernels``: on fake tensors, the fused ops' backends of a GPU run (``gpu_kernels``) or
    of a CPU one ("cpu": the references, to compare with a real step on the CPU). ``quick``: ``ready_rank``'s."""
    device = device or torch.device("cpu")
    with fake_modes(cfg, kernels) if fake else contextlib.nullcontext():
        rank = ready_rank(cfg, mesh, fake, device, quick)
        on_gpu = device.type == "cuda" and torch.cuda.is_available()  # not fake CUDA tensors on a CPU (tests)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        # ZeRO-0 over several data ranks: the memory is the plain model's, as planned; a real run replicates it (DDP),
        # whose all-reduce is counted over one more step, after DDP wraps the model.
        ddp_after = not fake and mesh.zero_stage == 0 and mesh.data_ranks > 1  # (a pipeline needs ZeRO-2 or 3)
        counted = CollectiveBytes() if not fake else None
        tracker = tracked_step(rank, counted=None if ddp_after else counted)
        if ddp_after:
            from hybridtron.train.parallel.parallelize import apply_run_data_parallel

            apply_run_data_parallel(rank.model, rank.engine.applied, cfg, mesh, rank.amp)
            with counted:
                _train_step(rank.engine, rank.n_micro, rank.vocab)
    out = categories(peak_by_type(tracker, device), cfg, mesh)
    if not fake:  # what this rank's collectives sent in the step, by op
        out["comm_sent"] = dict(counted.sent)
    if on_gpu:
        out["cuda_max_allocated"] = float(torch.cuda.max_memory_allocated(device))
    return {"memory": out, "facts": rank.facts}


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
