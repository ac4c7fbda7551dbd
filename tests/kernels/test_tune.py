"""kernels/tune.py: ``auto`` on a measured device keeps the fastest backend that agrees with the reference; a wrong or
failing one is dropped with a warning naming it; decisions are cached per machine, reused, invalidated by a
version change, shared by every process of a machine (a lock) and by every rank of a run (rank 0's, installed);
nothing is measured inside a compile trace. The CPU stands in for the GPU here (``configure(devices=...)``), with
injected timings: which candidate is fastest is the test's to say, what agrees is each candidate's own output."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import warnings

import pytest
import torch

from hybridtron.kernels import backend, tune
from hybridtron.kernels.tune_cases import Inputs, attention_shape, bucket

from .helpers import fake_timer

# as a program that calls the tuned ops without the model registers the tuner (kernels/__init__.py)
backend.use_tuner(tune)

SHAPE = ("attention", (("dtype", "float32"), ("B", 1), ("T", 64), ("H", 2), ("KV", 1), ("D", 8), ("gate", "none"),
                       ("docs", False), ("grad", True)))


class FakeCase:
    """An "attention" whose backends compute ``2 x``: ``wrong`` ones add 0.5, ``crash`` ones raise."""

    op, factor, atol = "attention", 3.0, None
    wrong: set = set()
    crash: set = set()
    calls: list = []

    @staticmethod
    def ref_mode(params):
        return None

    @staticmethod
    def inputs(params, device, small):
        x = torch.linspace(-1, 1, 16, dtype=torch.float64 if small else torch.float32, device=device)
        return Inputs([x], [torch.float32])

    @classmethod
    def run(cls, name, params, x):
        cls.calls.append(name)
        if name in cls.crash:
            raise RuntimeError(f"{name} exploded")
        return 2 * x + (0.5 if name in cls.wrong else 0.0)

    @staticmethod
    def work(params, full=None):
        return 1.0, 1.0


@contextlib.contextmanager
def fake_tuner(cache_dir):
    """The CPU measured like a GPU, the fake attention case, the cache in ``cache_dir``; yields the timer's log."""
    tune.reset()
    backend.clear_cache()
    FakeCase.wrong, FakeCase.crash, FakeCase.calls = set(), set(), []
    log: list = []
    tune.configure(devices=("cpu",), cache_dir=cache_dir, cases={"attention": FakeCase},
                   timer=fake_timer({"triton": 3.0, "sdpa": 1.0, "flex": 2.0, "reference": 9.0}, log))
    try:
        yield log
    finally:
        tune.reset()
        backend.clear_cache()


@pytest.fixture
def tuned(tmp_path):
    with fake_tuner(tmp_path) as log:
        yield log


def test_the_fastest_correct_backend_wins_and_wrong_or_crashing_ones_are_dropped(tuned, tmp_path):
    assert set(tune.candidates("attention", torch.device("cpu"))) >= {"triton", "sdpa", "flex", "reference"}
    assert backend.pick("attention", "auto", "cpu", SHAPE) == "sdpa"  # 1.0 ms of 3.0 / 1.0 / 2.0
    tune.reset()
    tuned.clear()
    tune.configure(devices=("cpu",), cache_dir=tmp_path / "other", cases={"attention": FakeCase},
                   timer=fake_timer({"triton": 3.0, "sdpa": 1.0, "flex": 2.0}, tuned))
    FakeCase.wrong, FakeCase.crash = {"sdpa"}, {"flex"}
    with pytest.warns(tune.KernelTuningWarning) as caught:
        assert backend.pick("attention", "auto", "cpu", SHAPE) == "triton"
    said = [str(w.message) for w in caught]
    assert any("backend sdpa dropped" in s and "disagrees with the reference" in s for s in said), said
    assert any("backend flex dropped" in s and "RuntimeError: flex exploded" in s for s in said), said
    d = tune.decisions()[tune.shape_key(SHAPE)]
    assert set(d.dropped) == {"sdpa", "flex"} and set(d.times_ms) == {"triton"}
    assert tuned == [["triton"]]  # only what agreed is timed; the reference only where nothing did


def test_the_reference_is_timed_only_where_no_kernel_agrees(tuned):
    FakeCase.wrong = {"triton", "sdpa", "flex"}
    with pytest.warns(tune.KernelTuningWarning):
        assert backend.pick("attention", "auto", "cpu", SHAPE) == "reference"
    assert tuned == [["reference"]]


def test_decisions_are_cached_reused_and_invalidated_by_a_version_change(tuned, monkeypatch):
    assert backend.pick("attention", "auto", "cpu", SHAPE) == "sdpa"
    saved = json.loads(tune.cache_path().read_text())
    (entry,) = saved["machines"].values()
    assert entry["decisions"][tune.shape_key(SHAPE)]["chosen"] == "sdpa"
    assert entry["machine"]["torch"] == torch.__version__ and "kernels" in entry["machine"]
    tune._decisions.clear()  # a later process: nothing in memory, the file on disk
    n = len(tuned)
    assert backend.pick("attention", "auto", "cpu", SHAPE) == "sdpa"
    assert len(tuned) == n and tune.decisions()[tune.shape_key(SHAPE)].note == "cache"
    # another triton: another machine as far as speed goes; measured again, the old entry kept beside it
    real = tune._version
    monkeypatch.setattr(tune, "_version", lambda d: "99.0" if d == "triton" else real(d))
    tune.fingerprint.cache_clear()
    tune._decisions.clear()
    assert backend.pick("attention", "auto", "cpu", SHAPE) == "sdpa"
    assert len(tuned) == n + 1
    assert len(json.loads(tune.cache_path().read_text())["machines"]) == 2
    tune.fingerprint.cache_clear()


def test_a_corrupt_cache_is_said_once_and_rewritten(tuned):
    tune.cache_path().parent.mkdir(parents=True, exist_ok=True)
    tune.cache_path().write_text("{not json")
    with pytest.warns(tune.KernelTuningWarning, match="ignoring the tuner's cache"):
        assert backend.pick("attention", "auto", "cpu", SHAPE) == "sdpa"
    assert json.loads(tune.cache_path().read_text())["format"] == tune.FORMAT


def test_explicit_backends_and_unmeasured_devices_are_not_tuned(tuned):
    assert backend.pick("attention", "sdpa", "cpu", SHAPE) == "sdpa"
    assert backend.pick("attention", "auto", "cpu", None) == "reference"  # no class given (decoding): untuned
    tune.configure(devices=("cuda",))
    assert backend.pick("attention", "auto", "cpu", SHAPE) == "reference"  # the CPU: the reference, unmeasured
    assert FakeCase.calls == [] and tuned == []


def test_no_measurement_inside_a_compile_trace(tuned):
    """As in a compiled block: the class is built from the tensors inside the traced code, `pick` is a constant."""
    def f(q, k):
        shape = attention_shape(q, k, k, "none", docs=False)
        return q + (1.0 if backend.pick_for("attention", "auto", q, k, shape=shape) == "sdpa" else 0.0)

    q, k = torch.zeros(1, 64, 2, 8, requires_grad=True), torch.zeros(1, 64, 1, 8)
    train_shape = attention_shape(q, k, k, "none", docs=False)
    assert train_shape == SHAPE
    assert backend.pick("attention", "auto", "cpu", train_shape) == "sdpa"  # measured eagerly (a first step)
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    with torch.no_grad():  # evaluation: the forward-only twin of a measured class takes its choice
        assert compiled(q, k).flatten()[0].item() == 1.0
    with pytest.warns(tune.KernelTuningWarning, match="inside a torch.compile trace"):
        out = compiled(torch.zeros(1, 100, 2, 8, requires_grad=True), torch.zeros(1, 100, 1, 8))
    assert out.flatten()[0].item() == 0.0  # an unknown class (T 128): AUTO_ORDER's (the CPU's reference), untimed
    assert len(tuned) == 1
    eval_key = tune.shape_key((SHAPE[0], tuple((n, False if n == "grad" else v) for n, v in SHAPE[1])))
    assert tune.decisions()[eval_key].note.startswith("as attention[")


def _choose_in_process(cache_dir, prefer, out):
    tune.configure(devices=("cpu",), cache_dir=cache_dir, cases={"attention": FakeCase},
                   timer=fake_timer({"triton": 1.0 if prefer == "triton" else 5.0,
                                     "sdpa": 1.0 if prefer == "sdpa" else 5.0, "flex": 5.0}))
    chosen = backend.pick("attention", "auto", "cpu", SHAPE)
    out.put((prefer, chosen, tune.decisions()[tune.shape_key(SHAPE)].note))


def test_processes_of_one_machine_share_one_decision(tmp_path):
    """Two processes whose own timings disagree meet one class at once: one measures under the cache's lock, the
    other waits and reads its decision."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_choose_in_process, args=(tmp_path, p, q)) for p in ("triton", "sdpa")]
    for p in ps:
        p.start()
    got = [q.get(timeout=120) for _ in ps]
    for p in ps:
        p.join(timeout=60)
    assert len({chosen for _, chosen, _ in got}) == 1, got
    assert sorted(note for _, _, note in got) == ["", "cache"], got  # one measured, one read


class _FakeMesh:
    def __init__(self, rank0: dict):
        self.distributed, self.is_main, self.rank0 = True, False, rank0

    def broadcast(self, obj):
        return self.rank0


def test_every_rank_runs_rank_0s_decisions(tuned, tmp_path):
    from hybridtron.train import kernel_choice

    assert backend.pick("attention", "auto", "cpu", SHAPE) == "sdpa"  # this rank measured sdpa...
    rank0 = {tune.shape_key(SHAPE): {"chosen": "triton", "times_ms": {"triton": 1.0}, "dropped": {}, "measured": ""}}
    kernel_choice.share(_FakeMesh(rank0), tmp_path, print)  # ... rank 0 measured triton: every rank runs triton
    assert backend.pick("attention", "auto", "cpu", SHAPE) == "triton"
    other = (SHAPE[0], tuple((k, 256 if k == "T" else v) for k, v in SHAPE[1]))
    with pytest.warns(tune.KernelTuningWarning, match="after rank 0's decisions were installed"):
        assert backend.pick("attention", "auto", "cpu", other) == "reference"  # no rank measures on its own now
    assert not (tmp_path / kernel_choice.KERNELS_JSON).exists()  # written by rank 0 only


def test_shape_classes_of_calls():
    q = torch.randn(2, 100, 4, 16, requires_grad=True)
    k = torch.randn(2, 100, 2, 16)
    shape = dict(attention_shape(q, k, k, "headwise", docs=True)[1])
    assert shape == {"dtype": "float32", "B": 2, "T": 128, "H": 4, "KV": 2, "D": 16, "gate": "headwise", "docs": True,
                     "grad": True}
    with torch.no_grad():
        assert dict(attention_shape(q, k, k, "none", docs=False)[1])["grad"] is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dict(attention_shape(q, k, k, "none", docs=False)[1])["dtype"] == "bfloat16"
    assert [bucket(t) for t in (1, 64, 65, 4096, 4097)] == [64, 64, 128, 4096, 8192]


def test_refusals_name_the_backend_and_the_way_out():
    with pytest.raises(backend.BackendError, match="model.kernels.delta_rule=fla cannot run on cpu: fla runs on CUDA"):
        backend.resolve("delta_rule", "fla", "cpu")
    with pytest.raises(backend.BackendError, match="causal-conv1d runs on CUDA GPUs only"):
        backend.resolve("conv", "causal-conv1d", "cpu")
    with pytest.raises(backend.BackendError, match="sdpa does not implement norm"):
        backend.check_choice("norm", "sdpa")
    with pytest.raises(backend.BackendError, match="fla does not implement attention"):
        backend.check_choice("attention", "fla")
    assert backend.resolve("attention", "sdpa", "cpu") == "sdpa"


def test_tuning_warnings_are_one_line_each(tuned):
    FakeCase.crash = {"flex"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.pick("attention", "auto", "cpu", SHAPE)
    assert caught and all("\n" not in str(w.message) for w in caught)


def test_a_class_first_met_under_activation_checkpointing(tuned):
    """torch's non-reentrant checkpoint packs every tensor saved in the block's forward; the candidates' own autograd
    graphs must not be caught in it (their backward would recompute the block)."""
    from torch.utils.checkpoint import checkpoint

    def block(x):
        scale = 2.0 if backend.pick("attention", "auto", "cpu", SHAPE) == "sdpa" else 3.0
        return (x * x).sin() * scale

    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * torch.cos(x * x) * 2 * x)
    assert tuned == [["flex", "sdpa", "triton"]]  # measured once, in the first forward
