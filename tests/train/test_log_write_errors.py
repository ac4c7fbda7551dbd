"""A write of the run's logs that fails ends the run in one line naming the file, and never loses a checkpoint.

The full disk is real: `hybridtron train` runs in a mount namespace of its own (``unshare``) where a tiny tmpfs holds
the log file under test, while the checkpoints live on the ordinary disk. TensorBoard's events once failed in a
writer thread (its traceback on stderr, then an OSError naming no file); metrics.jsonl's error was replaced by the
one its close raised, naming no file either. The run-directory files written once (config.yaml, last_stop.json,
grads_step1.pt) meet their full disk from a write helper that, like a buffered write, names no file.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtron.cli import main
from hybridtron.train.checkpoint import CheckpointManager, verify_manifest
from hybridtron.train.metrics import read_metrics

FLAT = ["--train.eval_every", "0", "--train.warmup_steps", "1", "--checkpoint.every", "2"]

# Mount a tmpfs of $SIZE on $MNT, run $SETUP (links into it), then the command; copy what it left on the tmpfs to
# $KEEP before the namespace, and the tmpfs with it, goes away.
IN_NAMESPACE = """set -e
mount -t tmpfs -o size="$SIZE" tmpfs "$MNT"
eval "$SETUP"
set +e
"$@"
rc=$?
cp -R "$MNT"/. "$KEEP"
exit $rc
"""


@pytest.fixture(scope="module")
def own_mounts(tmp_path_factory) -> list[str]:
    """The command prefix that gives a process a mount namespace in which it may mount a tmpfs: `unshare -m` for
    root, a user namespace as well (`unshare -Urm`) for anyone else where the kernel allows one."""
    probe = tmp_path_factory.mktemp("probe")
    tried = []
    for prefix in ([["unshare", "-m"]] if os.geteuid() == 0 else []) + [["unshare", "-Urm"]]:
        try:
            res = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(probe)],
                                 capture_output=True, text=True, timeout=30)
        except FileNotFoundError as e:
            pytest.skip(f"unshare is not installed: {e}")
        if res.returncode == 0:
            return prefix
        tried.append(f"{' '.join(prefix)}: {res.stderr.strip()}")
    pytest.skip("cannot mount a tmpfs in a namespace of our own here: " + "; ".join(tried))


def train_on_small_fs(prefix, argv, mnt: Path, keep: Path, size: str, setup: str = "") -> subprocess.CompletedProcess:
    mnt.mkdir()
    keep.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MNT": str(mnt), "KEEP": str(keep), "SIZE": size, "SETUP": setup}
    env.pop("HYBRIDTRON_DEBUG", None)
    cmd = [*prefix, "sh", "-c", IN_NAMESPACE, "sh", sys.executable, "-m", "hybridtron.cli", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def assert_one_line_naming(res: subprocess.CompletedProcess, file: str) -> str:
    """Exit 4 and stderr exactly one line (no thread's or main's traceback) that names ``file``."""
    err = res.stderr
    assert res.returncode == 4, res.stdout[-2000:] + err[-3000:]
    assert "Traceback" not in err and "Exception in thread" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("hybridtron train: error: no space left on device writing " + file), lines[0]
    return lines[0]


def assert_latest_complete(ckpt_dir: Path, before: int) -> int:
    """``latest`` names a complete checkpoint (every file as its manifest says) of a step before ``before``, and no
    partial checkpoint is left; returns its step."""
    mgr = CheckpointManager(ckpt_dir.parent)
    latest = mgr.latest()
    assert latest is not None and (ckpt_dir / "latest").read_text().strip() == latest.name
    verify_manifest(latest)
    step = int(latest.name.split("_")[1])
    assert 0 < step < before, (step, before)
    assert not [p.name for p in ckpt_dir.iterdir() if p.name.startswith(".")]
    return step


@pytest.mark.slow  # the real CLI in a process of its own
def test_full_disk_under_metrics_jsonl_ends_the_run_in_one_line(own_mounts, small_data_dir, small_argv, tmp_path):
    # The run directory on a 12 KiB tmpfs (config.yaml and a few dozen lines of metrics.jsonl fit), its checkpoints
    # and TensorBoard events on the ordinary disk.
    host = tmp_path / "host"
    (host / "checkpoints").mkdir(parents=True)
    (host / "tensorboard").mkdir()
    mnt, keep = tmp_path / "fs", tmp_path / "left"
    setup = (f'mkdir "$MNT/run" && ln -s {host / "checkpoints"} "$MNT/run/checkpoints" && '
             f'ln -s {host / "tensorboard"} "$MNT/run/tensorboard"')
    res = train_on_small_fs(own_mounts, small_argv(small_data_dir, mnt / "run", [*FLAT, "--train.max_steps", "200"]),
                            mnt, keep, "12k", setup)
    assert_one_line_naming(res, f"{mnt / 'run' / 'metrics.jsonl'};")
    # The line that did not fit was cut off again: every line left is whole, and the run stopped at that step.
    text = (keep / "run" / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    logged = [json.loads(ln)["step"] for ln in text.splitlines()]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) >= 3
    assert_latest_complete(host / "checkpoints", before=len(logged) + 1)  # the failed step saved nothing


@pytest.mark.slow  # the real CLI in a process of its own
def test_full_disk_under_tensorboard_ends_the_run_in_one_line_and_the_run_resumes(own_mounts, small_data_dir,
                                                                                  small_argv, tmp_path):
    # TensorBoard's directory on a 4 KiB tmpfs: a dozen steps of events fit.
    run = tmp_path / "run"
    run.mkdir()
    mnt, keep = tmp_path / "fs", tmp_path / "left"
    (run / "tensorboard").symlink_to(mnt)
    argv = small_argv(small_data_dir, run, [*FLAT, "--train.max_steps", "100"])
    res = train_on_small_fs(own_mounts, argv, mnt, keep, "4k")
    line = assert_one_line_naming(res, str(run / "tensorboard" / "events.out.tfevents."))
    events = Path(line.split(" writing ", 1)[1].split(";", 1)[0])
    assert (keep / events.name).is_file()  # the file named is the one that was being written
    failed_at = read_metrics(run)[-1]["step"]  # metrics.jsonl (ordinary disk) took that step's line first
    step = assert_latest_complete(run / "checkpoints", before=failed_at)  # the failed step saved nothing
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # What fitted is readable, up to the step before; the failed step's events were cut off whole.
    acc = EventAccumulator(str(keep))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, failed_at))
    # Once there is room (outside the namespace the link leads to an empty directory of the ordinary disk), the same
    # command resumes from that checkpoint; each step is logged once, in metrics.jsonl and in TensorBoard.
    until = ["--train.max_steps", str(failed_at + 2)]
    assert main(small_argv(small_data_dir, run, [*FLAT, *until])) == 0
    assert [r["step"] for r in read_metrics(run)] == list(range(1, failed_at + 3))
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(step + 1, failed_at + 3))


def test_tensorboard_shows_each_step_once_after_a_resume(small_data_dir, small_argv, tmp_path):
    """The events files written in the training thread are TensorBoard's own format, and a resume hides the steps
    the interrupted run logged after its checkpoint (written again by the resumed one)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert main(small_argv(small_data_dir, run, [*FLAT, "--train.max_steps", "3"])) == 0
    # As if killed after step 3 was logged, with step 2's checkpoint the last one saved.
    mgr = CheckpointManager(run)
    for ckpt in mgr.complete()[1:]:
        shutil.rmtree(ckpt)
    (mgr.dir / "latest").write_text("step_00000002")
    assert main(small_argv(small_data_dir, run, [*FLAT, "--train.max_steps", "4"])) == 0
    assert len(list((run / "tensorboard").iterdir())) == 2
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    by_step = {r["step"]: r["loss"] for r in read_metrics(run)}
    assert [e.value for e in loss] == pytest.approx([by_step[s] for s in range(1, 5)], rel=1e-6)


def _enospc_for(name: str, real):
    """``real`` (an atomic write) failing for ``name`` the way a buffered write on a full disk does: no file named."""
    def write(path, data):
        if Path(path).name == name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    return write


@pytest.mark.parametrize("name, where", [("config.yaml", "recipe"), ("last_stop.json", "recipe"),
                                         ("grads_step1.pt", "grad_dump")])
def test_full_disk_under_a_run_file_names_it(name, where, small_data_dir, small_argv, tmp_path, capsys, monkeypatch):
    from hybridtron.train import grad_dump, recipe

    if where == "recipe":
        monkeypatch.setattr(recipe, "write_text_atomic", _enospc_for(name, recipe.write_text_atomic))
    else:
        monkeypatch.setattr(grad_dump, "write_bytes_atomic", _enospc_for(name, grad_dump.write_bytes_atomic))
    run = tmp_path / "run"
    extra = ["--train.dump_grads", "[norm.weight]"] if name == "grads_step1.pt" else []
    code = main(small_argv(small_data_dir, run, [*FLAT, "--train.max_steps", "2", *extra]))
    err = capsys.readouterr().err
    assert code == 4, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hybridtron train: error: no space left on device writing "
                                                   f"{run / name};"), err


@pytest.mark.slow  # two processes under torchrun
def test_the_other_ranks_name_rank_0s_full_disk(own_mounts, small_data_dir, small_argv, tmp_path):
    """Rank 0 alone writes the logs: when its write fails, the others used to end with "lost the connection to
    another process" (their collective broke as rank 0 exited). Rank 0 leaves its line in the rendezvous store
    first, and they print that cause."""
    run = tmp_path / "run"
    run.mkdir()
    mnt, keep = tmp_path / "fs", tmp_path / "left"
    mnt.mkdir()
    keep.mkdir()
    (run / "tensorboard").symlink_to(mnt)  # TensorBoard's events on a 4 KiB tmpfs: a dozen steps fit
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MNT": str(mnt), "KEEP": str(keep), "SIZE": "4k", "SETUP": ""}
    for k in ("HYBRIDTRON_DEBUG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    argv = small_argv(small_data_dir, run, [*FLAT, "--train.max_steps", "100"])
    cmd = [*own_mounts, "sh", "-c", IN_NAMESPACE, "sh", sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "-m", "hybridtron.cli", *argv]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    lines = res.stderr.splitlines()
    out = res.stdout[-2000:] + res.stderr[-4000:]
    rank0 = [ln for ln in lines if ln.startswith("hybridtron train (rank 0/2): error: ")]
    rank1 = [ln for ln in lines if ln.startswith("hybridtron train (rank 1/2): error: ")]
    assert res.returncode != 0 and len(rank0) == 1 and len(rank1) == 1, out
    cause = rank0[0].removeprefix("hybridtron train (rank 0/2): error: ")
    assert cause.startswith(f"no space left on device writing {run / 'tensorboard' / 'events.out.tfevents.'}"), out
    assert rank1[0] == f"hybridtron train (rank 1/2): error: rank 0 stopped: {cause}", out
    # torchrun's summary: rank 0's exit 4 and line as the root cause (rank 1, stopped by torchrun's SIGTERM as it
    # exited, may be listed with -15)
    root = res.stderr.rsplit("Root Cause (first observed failure):", 1)[1]
    assert "exitcode  : 4" in root and f"traceback : {rank0[0]}" in root, out
