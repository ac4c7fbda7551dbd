"""``hybridtron export`` against the faults of issue 40's drills: a full disk while writing the weights or the
tokenizer ends in exit 4 and one line naming the file and its directory, with nothing left behind; a run that is
still training (and pruning its old checkpoints) exports every time, and the checkpoint an export read is
reclaimed once it is done."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridtron.cli import main
from hybridtron.train.checkpoint_names import complete, latest_checkpoint
from hybridtron.train.checkpoint_pins import PINS

transformers = pytest.importorskip("transformers", reason="transformers is a dependency; install the project")

QUICK = ["--train.eval_every", "0", "--train.warmup_steps", "1", "--train.schedule", "constant"]


@pytest.fixture(scope="module")
def run(small_data_dir, small_argv, tmp_path_factory):
    run = tmp_path_factory.mktemp("export_faults") / "run"
    assert main(small_argv(small_data_dir, run, [*QUICK, "--train.max_steps", "2", "--checkpoint.every", "2"])) == 0
    return run


def one_line(code: int, err: str, exit_code: int = 4) -> str:
    assert code == exit_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_a_full_disk_while_writing_the_weights(run, tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)  # what a writer that ran out of space leaves
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    out = tmp_path / "exports" / "hf"  # its parent is made by the export: gone again with it
    line = one_line(main(["export", str(run), "--out", str(out)]), capsys.readouterr().err)
    assert line.startswith(f"hybridtron export: error: no space left on device writing {out / 'model.safetensors'};")
    assert f"free space in {out.parent}," in line and "SafetensorError" not in line
    assert leftovers(tmp_path) == []  # no --out, no parent made for it, no scratch directory


@pytest.mark.parametrize("how", ["write", "open"])
def test_a_full_disk_while_writing_the_tokenizer(how, run, tmp_path, capsys, monkeypatch):
    """``write`` of an open file raises ENOSPC without naming it; ``open`` (no inode left) names the scratch path."""
    def full(self, directory, *a, **k):
        f = Path(directory) / "tokenizer_config.json"
        if how == "open":
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        with open(f, "w") as fh:
            fh.write("{")
            fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", full)
    out = tmp_path / "hf"
    line = one_line(main(["export", str(run), "--out", str(out)]), capsys.readouterr().err)
    assert line.startswith(f"hybridtron export: error: no space left on device writing {out / 'tokenizer_config.json'};")
    assert f"free space in {tmp_path}," in line
    assert leftovers(tmp_path) == []
    assert (run / "checkpoints" / "step_00000002").is_dir() and not (run / "checkpoints" / PINS).exists()


def test_export_of_a_run_that_is_training_and_pruning(small_data_dir, cli_args, tmp_path, capsys):
    """A checkpoint every step, the last one kept: the checkpoint an export chose is past keep_last within a step,
    and without its pin is pruned while the export reads it ("tokenizer path ... does not exist", every time here)."""
    run = tmp_path / "run"
    argv = cli_args(small_data_dir, run, [*QUICK, "--train.max_steps", "100000", "--train.micro_batch_size", "2",
                                          "--checkpoint.every", "1", "--checkpoint.keep_last", "1"])
    log = tmp_path / "train.log"  # a file, not a pipe nobody reads while the exports run: a full pipe stops training
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "hybridtron.cli", *argv], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    exported = []
    try:
        deadline = time.time() + 120
        while latest_checkpoint(run) is None:
            assert time.time() < deadline and proc.poll() is None, "training wrote no checkpoint"
            time.sleep(0.2)
        for i in range(3):
            assert proc.poll() is None, "training ended before the exports"
            out = tmp_path / f"hf{i}"
            code = main(["export", str(run), "--out", str(out)])
            printed = capsys.readouterr()
            assert code == 0, printed.err
            exported.append(printed.out.split("exporting ", 1)[1].split(" ->", 1)[0])
            assert (out / "model.safetensors").is_file()
        # training went on saving (and pruning) while the exports read
        assert latest_checkpoint(run).name > Path(exported[0]).name
        proc.send_signal(signal.SIGTERM)  # stops with a checkpoint: a save, which prunes what the exports held
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert len(complete(run / "checkpoints")) == 1, leftovers(run / "checkpoints")  # reclaimed once released
    assert not (run / "checkpoints" / PINS).exists()
