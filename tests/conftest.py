"""Shared fixtures: one small prepared corpus (40 stdlib files, 512-id BPE) for the train/CLI tests."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Triton decorates its own library functions (tl.zeros, ...) when it is first imported, and importing the model
# imports it (through torch's custom-op machinery), so the interpreter the CPU kernel tests need must be on before
# any test module is collected, not only from tests/kernels/conftest.py on.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The kernel tuner's cache (kernels/tune.py) goes to a directory of this process's, removed at its exit, never the
# user's ~/.cache (the tests measure on the CPU with injected timings).
if "HYBRIDTRON_CACHE_DIR" not in os.environ:
    os.environ["HYBRIDTRON_CACHE_DIR"] = tempfile.mkdtemp(prefix="hybridtron-tune-cache-")
    atexit.register(shutil.rmtree, os.environ["HYBRIDTRON_CACHE_DIR"], ignore_errors=True)

# fla-core is installed for its adapter's tests (kernels/gated_delta_rule/fla_backend.py); transformers would bind its
# GPU kernels into the Qwen3.5 models the export tests run on the CPU, so those modules are imported with it hidden.
from hybridtron.train.hf.torch_paths import import_with_torch_paths  # noqa: E402

import_with_torch_paths()

# Tests are CPU-only and must be reproducible. Under pytest-xdist (./run.sh test runs one worker per core) every
# worker, and every process it starts (torchrun ranks, CLI runs), takes one intra-op thread: more threads than
# cores make torch's parallel loops wait on each other (seen: 20x slower steps). Alone, two match the CI machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, os.cpu_count() or 1))

# The files that take the longest (minutes: several multi-process layouts, the SLURM cluster, interpreter-run
# training), collected first: pytest-xdist hands each worker whole files in collection order, so the long ones
# start at once and the short ones fill the end instead of one worker finishing a long file alone.
LONG_FIRST = ("test_user_commands.py", "train/test_data_parallel.py", "train/test_context_parallel.py",
              "kernels/test_model_kernels.py", "slurm/test_cluster.py", "model/test_state_tracking.py", "train/test_pipeline.py",
              "train/test_tensor_parallel.py", "train/test_expert_parallel.py", "train/test_composed_parallel.py",
              "train/test_plan.py", "train/test_plan_reduced.py", "train/test_hsdp.py", "bench/test_bench_train.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: the order inside each file, and of the other files, is kept


SMALL_OVERRIDES = [
    ("data.sources", "[{path: stdlib, max_files: 40}]"),
    ("data.tokenizer.vocab_size", "512"),
    ("data.seq_len", "64"),
    ("model.max_seq_len", "128"),
    ("model.d_model", "64"),
    ("model.n_layers", "2"),
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "2"),
    ("train.micro_batch_size", "8"),
    ("train.max_steps", "30"),
    ("train.warmup_steps", "5"),
    ("train.eval_every", "10"),
    ("train.eval_batches", "4"),
    ("data.val_fraction", "0.1"),
    ("train.progress_bar", "false"),
    ("checkpoint.every", "10"),
]


@pytest.fixture
def no_interpreter(monkeypatch):
    """TRITON_INTERPRET unset and the backend switch's caches cleared (before and after): Triton refused on the CPU."""
    from hybridtron.kernels import backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backend.clear_cache()
    yield
    backend.clear_cache()


@pytest.fixture(scope="session")
def small_data_dir(tmp_path_factory):
    """Prepared once per session; tests point data.out_dir here."""
    from hybridtron.configs import load_config
    from hybridtron.data_pipeline import prepare_data

    out = tmp_path_factory.mktemp("data") / "small"
    cfg = load_config("tiny", SMALL_OVERRIDES + [("data.out_dir", str(out))])
    prepare_data(cfg.data, log=lambda *_: None)
    return out


def small_train_argv(data_dir, run_dir, extra=()):
    """argv for `hybridtron train` on the small corpus."""
    args = ["train", "--config", "tiny", "--run-dir", str(run_dir)]
    for k, v in SMALL_OVERRIDES + [("data.out_dir", str(data_dir))]:
        args += [f"--{k}", v]
    return args + list(extra)


@pytest.fixture
def cli_args():
    return small_train_argv


@pytest.fixture(scope="session")
def small_argv():
    """`small_train_argv` for fixtures of wider scope than a test."""
    return small_train_argv


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    """A small multilingual BPE tokenizer directory (300 ids), for the export tests."""
    from hybridtron.data_pipeline.tokenizer import train_bpe

    texts = ["hello world, déjà vu. 你好世界 Привет мир " * 20, "def f(x):\n    return x + 1\n" * 30]
    d = tmp_path_factory.mktemp("tok")
    train_bpe(iter(texts * 50), 300, 10**6).save(d)
    return d


@pytest.fixture
def dead_pid():
    """The pid of a process that has exited and been reaped: none has it now (the kernel hands a pid out again only
    after wrapping around the pid space). The scratch of a writer killed midway is named for such a pid."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)
    return p.pid


@pytest.fixture
def live_pid():
    """The pid of a process that lives for the test (killed after it)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait(timeout=30)
