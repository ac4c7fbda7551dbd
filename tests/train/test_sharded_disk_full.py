"""A full disk during a multi-process (DCP) checkpoint, for real: the run directory lives on a small tmpfs.

Two gloo processes under FSDP2 resume a run whose next checkpoint does not fit. Every rank says so in one line,
the partial checkpoint disappears, `latest` keeps naming the previous one, and once there is room the same
command resumes from it and trains the steps one process trains. Mounting a tmpfs needs root (CI has it).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from hybridtron.cli import main
from hybridtron.train.checkpoint import CheckpointManager, verify_manifest

from .test_data_parallel import STEPS, assert_same_steps, steps, torchrun

pytestmark = pytest.mark.slow


def _kib(path) -> int:
    return int(subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()

    def mount(kib: int, remount: bool = False) -> None:
        opts = f"{'remount,' if remount else ''}size={kib}k"
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True, text=True)
        if res.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.strip()}")

    yield mnt, mount
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_full_disk_during_a_sharded_save_keeps_the_previous_checkpoint(small_fs, small_data_dir, small_argv, tmp_path):
    mnt, mount = small_fs
    layout = [*STEPS, "--parallel.zero_stage", "3"]
    first = tmp_path / "first"
    res = torchrun(small_argv(small_data_dir, first, [*layout, "--train.max_steps", "2"]))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # Room for the run as it is and half of one more checkpoint.
    mount(_kib(first) + _kib(first / "checkpoints" / "step_00000002") // 2)
    run = mnt / "run"
    shutil.copytree(first, run)
    argv = small_argv(small_data_dir, run, layout)
    res = torchrun(argv)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    for rank in (0, 1):
        assert (f"hybridtron train (rank {rank}/2): error: no space left on device writing dcp of checkpoint "
                f"step_00000004") in out, out[-3000:]
    assert "latest still names step_00000002" in out and "[rank0]: Traceback" not in out  # one line, no traceback
    mgr = CheckpointManager(run)
    assert mgr.latest().name == "step_00000002"
    assert sorted(p.name for p in mgr.dir.iterdir()) == ["latest", "step_00000002"]  # nothing partial left
    verify_manifest(mgr.latest())
    # Space freed: the same command resumes from step 2 and trains what one process trains.
    mount(4 * _kib(first), remount=True)
    res = torchrun(argv)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} (step 2)" in res.stdout
    # One process through the same history: 2 steps (a schedule that ends at step 2, kept on resume), then 4.
    ref = tmp_path / "ref"
    one = [*STEPS, "--train.grad_accum_steps", "2"]
    assert main(small_argv(small_data_dir, ref, [*one, "--train.max_steps", "2"])) == 0
    assert main(small_argv(small_data_dir, ref, one)) == 0
    assert_same_steps(steps(run), steps(ref))
