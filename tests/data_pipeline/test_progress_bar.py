"""`hybridtron prepare`'s progress: a tqdm bar where stderr is a terminal (bytes, their rate, documents and tokens
per second), the lines of a log file (progress.py) where it is not, never both."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from hybridtron.data_pipeline.progress import EVERY_ENV, Progress


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bar")
    for f in range(3):
        (root / f"{f}.jsonl").write_text("".join(json.dumps({"text": f"doc {f} {r} " + "word " * (30 * r + 5)}) + "\n"
                                                 for r in range(20)))
    return root


def _cmd(corpus: Path, tokenizer_json: Path, out: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "hybridtron.cli", "prepare", "--config", "tiny",
            f"--data.sources=[{{path: {corpus}}}]", "--data.tokenizer.kind", "pretrained",
            "--data.tokenizer.path", str(tokenizer_json), "--data.seq_len", "32", "--data.out_dir", str(out),
            "--data.workers", str(workers), "--data.part_mb", "0.004"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    return {**env, EVERY_ENV: "0", "OMP_NUM_THREADS": "1"}  # lines at every step, were there lines


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_terminal_gets_a_bar_and_no_progress_lines(workers, corpus, tokenizer_json, tmp_path):
    master, slave = os.openpty()
    # a terminal of 24 x 160 (a fresh pty is 0 x 0, where tqdm's dynamic width draws nothing)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))
    job = subprocess.Popen(_cmd(corpus, tokenizer_json, tmp_path / "out", workers), stdout=subprocess.PIPE,
                           stderr=slave, text=True, env=_env())
    os.close(slave)
    screen = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                return
            if not chunk:
                return
            screen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out, _ = job.communicate(timeout=180)
    reader.join(timeout=10)
    os.close(master)
    tty = screen.decode("utf-8", "replace")
    assert job.returncode == 0, tty + out
    bar = [s for s in tty.replace("\r\n", "\n").replace("\r", "\n").split("\n") if "tokenizing:" in s]
    assert bar, tty
    final = bar[-1]
    assert "100%" in final and "60 docs" in final and "tok/s" in final and "docs/s" in final, final
    assert "kB" in final or "MB" in final, final  # bytes, scaled
    assert "% (" not in out, out  # no progress line beside the bar
    assert "documents (" in out  # the other lines stay where they were: stdout


@pytest.mark.slow
def test_a_log_file_gets_the_lines_and_no_bar(corpus, tokenizer_json, tmp_path):
    got = subprocess.run(_cmd(corpus, tokenizer_json, tmp_path / "out", 2), capture_output=True, text=True,
                         env=_env(), timeout=180)
    assert got.returncode == 0, got.stderr
    lines = [s for s in got.stdout.splitlines() if "tokenizing " in s and "% (" in s]
    assert lines and "tokenizing 100% (" in lines[-1] and "60 documents" in lines[-1], got.stdout
    assert "\r" not in got.stdout + got.stderr and "docs/s" not in got.stdout + got.stderr


def test_the_bar_counts_bytes_and_shows_the_rates(capsys):
    now = [0.0]
    p = Progress("src: tokenizing", 2_000_000, print, clock=lambda: now[0], bar=True)
    for _ in range(4):
        now[0] += 1.0
        p.add(500_000, docs=10, tokens=100_000)
    assert p.bar.n == 2_000_000 and p.bar.postfix == "40 docs, 10 docs/s, 100.00k tok/s"
    p.close()
    err = capsys.readouterr()
    assert "src: tokenizing" in err.err and "% (" not in err.out  # the bar on stderr, no line
    p = Progress("src: tokenizing", 2_000_000, print, every_s=0, clock=lambda: now[0], bar=False)
    p.add(500_000, docs=10)
    assert p.bar is None and capsys.readouterr().out.startswith("src: tokenizing 25% (500.00 kB of 2.00 MB)")
