"""A full disk during ``hybridtron prepare`` ends in exit 4 and one line naming the file being written and its
directory. The ENOSPC comes the way a write that ran out of space reports it: from ``fsync`` (or ``write``) of an open
file, an OSError that names no file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from hybridtron.atomic import write_bytes_atomic
from hybridtron.cli import main


def full_under(directory: Path, name_part: str, monkeypatch) -> None:
    """``os.fsync`` of a file under ``directory`` whose name holds ``name_part`` fails as on a full disk."""
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(str(directory)) and name_part in os.path.basename(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an open file through /proc")
def test_an_atomic_write_that_fails_names_the_file_asked_for(tmp_path, monkeypatch):
    full_under(tmp_path, "shard", monkeypatch)
    with pytest.raises(OSError) as caught:
        write_bytes_atomic(tmp_path / "shard_00000.bin", b"x" * 100)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "shard_00000.bin")
    assert os.listdir(tmp_path) == []  # no scratch file left


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an open file through /proc")
@pytest.mark.parametrize("failing, written", [("tokenizer.json", "tokenizer/tokenizer.json"),
                                              ("shard_", "stdlib/train/shard_00000.bin")])
def test_prepare_on_a_full_disk_names_the_file_and_its_directory(failing, written, tmp_path, tokenizer_json, capsys,
                                                                 monkeypatch):
    out = tmp_path / "data"
    full_under(out, failing, monkeypatch)
    code = main(["prepare", "--config", "tiny", "--data.sources", "[{path: stdlib, max_files: 4}]",
                 "--data.tokenizer.kind", "pretrained", "--data.tokenizer.path", str(tokenizer_json),
                 "--data.out_dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 4 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    file = out / written
    assert err == (f"hybridtron prepare: error: no space left on device writing {file}; free space in {file.parent}, "
                   f"then run the same command again")
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]  # the write removed its scratch
