"""The command line answers --help, usage errors and config and layout mistakes without importing torch (issue 39):
each case runs as its own process, the way users run it (``python -m hybridtron.cli`` and the installed
``hybridtron`` script), under ``-X importtime``, whose report on stderr names every module the process imported;
torch must not be among them. Importing torch and the trainer at the top of cli.py cost each of these ~4.5 s of CPU
on a 2-core VM (bench/RESULTS.md); without them ~0.2 s."""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# (argv, exit code, a piece of the one line it answers with; for --help a piece of the help)
CASES = [
    (["--help"], 0, "exit codes"),
    *[([cmd, "--help"], 0, "--debug") for cmd in
      ("prepare", "train", "ablate", "plan", "export", "eval", "sample", "kernels", "submit", "status")],
    (["trian"], 2, "invalid choice: 'trian'"),  # a mistyped command (its suggestion: test_did_you_mean.py)
    (["train", "--config"], 2, "expected one argument"),  # a flag without its argument
    (["export", "runs/x"], 2, "the following arguments are required: --out"),  # a missing argument
    (["train", "--foo"], 2, "override '--foo' has no value"),  # an unknown flag
    (["train", "--run-dri", "runs/x"], 2, "unknown option --run-dri; did you mean --run-dir?"),  # a mistyped one
    (["status", "runs/x", "--jsn"], 2, "unrecognized arguments: --jsn"),
    (["train", "--train.lerning_rate", "1e-3"], 2, "unknown config key 'train.lerning_rate'"),
    (["train", "--config", "dense1b"], 2, "config 'dense1b' is neither a file nor a preset"),
    (["train", "--train.lr", "-1"], 2, "train.lr=-1.0 must be > 0"),  # a bad value
    (["train", "--train.dtype", "fp16"], 2, "train.dtype: value 'fp16' is not allowed"),
    (["train", "--parallel.zero_stage", "1"], 2, "parallel.zero_stage=1 (optimizer state sharded alone) needs"),
    (["train", "--parallel.tp", "3"], 2, "needs a multiple of 3 processes, but the launcher started 1"),
    (["train", "--model.kernels.cross_entropy", "flash-attn"], 2, "flash-attn does not implement cross_entropy"),
    (["prepare", "--data.seq_len", "0"], 2, "data.seq_len"),
    (["ablate", "--variant", "base:", "--variant", "a:model.n_layer=2"], 2,
     "variant 'a': unknown config key 'model.n_layer'"),
    (["plan", "--nodes", "0"], 2, "--nodes 0 must be >= 1"),
    (["plan", "--parallel.tp", "3", "--gpus-per-node", "8"], 2, "needs a multiple of 3 processes"),
    (["sample", "--max-new-tokens", "-3"], 2, "--max-new-tokens -3 must be >= 0"),
    (["eval", "--train.devcie", "cpu"], 2, "unknown config key 'train.devcie'"),
    (["kernels", "--config", "tiny_mo"], 2, "config 'tiny_mo' is neither a file nor a preset"),
    (["submit", "--dry-run", "--nodes", "2", "--gpus-per-node", "4"], 0, "#SBATCH"),  # the whole dry run
    (["submit", "--nodes", "2", "--gpus-per-node", "1", "--parallel.tp", "2"], 2, "parallel.tp=2 spans more"),
]
WALL_S = 10.0  # generous: with torch imported these took 10-15 s of wall time on a busy 2-core VM
CPU_S = 1.5  # measured ~0.2-0.3 s each under -X importtime; torch's import alone is ~2 s


def _script() -> str | None:
    beside = Path(sys.executable).with_name("hybridtron")
    return str(beside) if beside.is_file() else shutil.which("hybridtron")


def run_cli(prefix: list[str], argv: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, set[str], float,
                                                                     float]:
    """(the finished process, the modules it imported, its wall and CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-X", "importtime", *prefix, *argv], cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    imported = {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", res.stderr, re.M)}
    return res, imported, wall, cpu


def _torch_modules(imported: set[str]) -> list[str]:
    return sorted(m for m in imported if m == "torch" or m.startswith("torch."))


def _check(prefix, argv, code, text, cwd):
    res, imported, wall, cpu = run_cli(prefix, argv, cwd)
    said = [ln for ln in (res.stdout + res.stderr).splitlines() if not ln.startswith("import time:")]
    assert res.returncode == code, (argv, res.returncode, said[-5:])
    assert any(text in ln for ln in said), (argv, said[-5:])
    if code == 2:  # an error: one line naming it (argparse's own errors come after their usage lines)
        errors = [ln for ln in said if ": error: " in ln]
        assert len(errors) == 1, said
    assert "hybridtron.configs" in imported  # the report is read: it lists what was imported
    assert not _torch_modules(imported), (argv, _torch_modules(imported)[:5])
    assert wall < WALL_S and cpu < CPU_S, (argv, f"wall {wall:.2f} s, CPU {cpu:.2f} s")


@pytest.mark.parametrize(("argv", "code", "text"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_the_module_answers_without_torch(argv, code, text, tmp_path):
    _check(["-m", "hybridtron.cli"], argv, code, text, tmp_path)


SCRIPT_CASES = [c for c in CASES if c[0] in (["--help"], ["train", "--train.lerning_rate", "1e-3"],
                                             ["train", "--config", "dense1b"], ["plan", "--nodes", "0"])]


@pytest.mark.parametrize(("argv", "code", "text"), SCRIPT_CASES, ids=[" ".join(c[0]) for c in SCRIPT_CASES])
def test_the_installed_script_answers_without_torch(argv, code, text, tmp_path):
    script = _script()
    if script is None:
        pytest.skip("the hybridtron script is not installed beside this Python (pip install -e .)")
    _check([script], argv, code, text, tmp_path)


def test_status_of_a_run_without_torch(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000004")
    _check(["-m", "hybridtron.cli"], ["status", "run"], 0, "step_00000004", tmp_path)


def test_the_check_sees_torch_where_it_is_imported(tmp_path):
    """The reading above can fail: a command that needs torch (``kernels`` asks it for the device) is seen to
    import it."""
    res, imported, _, _ = run_cli(["-m", "hybridtron.cli"], ["kernels", "--train.device", "cpu"], tmp_path)
    assert res.returncode == 0 and "nothing is measured here" in res.stdout, res.stderr[-500:]
    assert "torch" in _torch_modules(imported)


def test_a_valid_run_is_checked_without_torch(tmp_path):
    """check_run of a config that is valid on either device (train.device=auto) asks torch nothing: the command
    line's layout check costs no torch import unless the device decides the answer."""
    code = ("import sys; from hybridtron.configs import load_config; "
            "from hybridtron.train.parallel.layout import check_run; "
            "[check_run(load_config(p), 1) for p in ('tiny', 'tiny_hybrid', 'tiny_moe', 'hybrid_1b')]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", (res.stdout, res.stderr[-2000:])


def test_prepare_of_prepared_data_answers_without_torch(small_data_dir, tmp_path):
    """``prepare`` needs no torch (its log line used to import the trainer): on data already prepared it answers at
    once, as ``train`` does before its own work."""
    from .conftest import SMALL_OVERRIDES

    argv = ["prepare", "--config", "tiny", *[a for k, v in SMALL_OVERRIDES + [("data.out_dir", str(small_data_dir))]
                                            for a in (f"--{k}", v)]]
    res, imported, wall, cpu = run_cli(["-m", "hybridtron.cli"], argv, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "prepared data in" in res.stdout
    assert not _torch_modules(imported), _torch_modules(imported)[:5]
    assert wall < WALL_S and cpu < 2 * CPU_S, f"wall {wall:.2f} s, CPU {cpu:.2f} s"
