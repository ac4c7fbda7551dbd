"""Every file-system error a run directory, a data directory or an export's --out can meet is one line and exit
2, before any data is prepared."""

from __future__ import annotations

import os
import tempfile

import pytest

from hybridtron.cli import main


def _train(tmp_path, run_dir, *extra):
    data = tmp_path / "data_never_made"
    return ["train", "--config", "tiny", "--run-dir", str(run_dir), "--data.out_dir", str(data), *extra]


def _one_line_error(capsys, rc, *needles):
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


@pytest.fixture
def afile(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    return f


def test_run_dir_that_is_a_file_or_under_one(tmp_path, afile, capsys):
    rc = main(_train(tmp_path, afile))
    _one_line_error(capsys, rc, f"--run-dir {afile} is a file, not a directory")
    rc = main(_train(tmp_path, afile / "sub" / "run"))
    _one_line_error(capsys, rc, "cannot be created", f"{afile} is a file, not a directory")
    assert not (tmp_path / "data_never_made").exists()  # nothing was prepared


def test_run_dir_dangling_link_and_misplaced_entries(tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    rc = main(_train(tmp_path, link))
    _one_line_error(capsys, rc, "symbolic link", "does not exist")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory")
    rc = main(_train(tmp_path, run))
    _one_line_error(capsys, rc, "checkpoints should be a directory but is a file")
    (run / "checkpoints").unlink()
    (run / "metrics.jsonl").mkdir()
    rc = main(_train(tmp_path, run))
    _one_line_error(capsys, rc, "metrics.jsonl should be a file but is a directory")
    assert not (tmp_path / "data_never_made").exists()


def test_name_too_long(tmp_path, capsys):
    rc = main(_train(tmp_path, tmp_path / ("r" * 300)))
    _one_line_error(capsys, rc, "too long")


def _unwritable_dir(tmp_path):
    """A directory this process cannot create files in (chmod 0500, or for root a read-only place), or None."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    for cand in (d, "/sys", "/proc/1"):
        try:
            fd, probe = tempfile.mkstemp(dir=cand)
        except OSError:
            return cand
        os.close(fd)
        os.unlink(probe)
    return None


def test_unwritable_run_dir_and_parent(tmp_path, capsys):
    ro = _unwritable_dir(tmp_path)
    if ro is None:
        pytest.skip("no unwritable directory here (root on a writable file system)")
    try:
        rc = main(_train(tmp_path, ro))
        _one_line_error(capsys, rc, "is not writable")
        rc = main(_train(tmp_path, os.path.join(ro, "new_run")))
        _one_line_error(capsys, rc, "cannot be created in")
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_data_out_dir_is_checked_by_train_and_prepare(tmp_path, afile, capsys):
    rc = main(_train(tmp_path, tmp_path / "run", "--data.out_dir", str(afile)))
    _one_line_error(capsys, rc, f"data.out_dir={afile} is a file")
    assert not (tmp_path / "run").exists()
    rc = main(["prepare", "--config", "tiny", "--data.out_dir", str(afile / "x")])
    _one_line_error(capsys, rc, "cannot be created", "is a file")


def test_export_out(tmp_path, afile, capsys):
    ckpt = tmp_path / "no_checkpoint_needed"  # the --out check comes first
    rc = main(["export", str(ckpt), "--out", str(afile)])
    _one_line_error(capsys, rc, f"--out {afile} is a file")
    rc = main(["export", str(ckpt), "--out", str(afile / "hf")])
    _one_line_error(capsys, rc, "cannot be created")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    rc = main(["export", str(ckpt), "--out", str(full)])
    _one_line_error(capsys, rc, "exists and is not empty")
