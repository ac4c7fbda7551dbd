"""What a user reads on stderr is ours: our warnings on one line, the dependencies' own untouched."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import warnings
from hybridtron.quiet import quiet_dependencies
from hybridtron.kernels.tune import KernelTuningWarning
quiet_dependencies()
quiet_dependencies()  # idempotent
warnings.warn("the tuner's cache entry for 'x' is not a decision: dropped, measured again", KernelTuningWarning)
warnings.warn("a library's own", DeprecationWarning)
"""


def test_our_warnings_are_one_line_and_others_keep_their_form():
    p = subprocess.run([sys.executable, "-W", "always", "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert lines[0] == ("[hybridtron] warning: the tuner's cache entry for 'x' is not a decision: dropped, measured "
                        "again"), lines
    assert "DeprecationWarning: a library's own" in lines[1], lines


WRITES = """
import os, socket, sys
from hybridtron.cli import whole_lines
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message per write(2)
os.dup2(a.fileno(), 1)
os.dup2(a.fileno(), 2)
if sys.argv[1] == "ours":
    whole_lines()
print("hybridtron train (rank 1/2): error: a line", "in parts", file=sys.stderr)
print("step 1 | loss 2.0", flush=True)
b.setblocking(False)
got = []
while True:
    try:
        got.append(b.recv(4096))
    except BlockingIOError:
        break
os.write(int(sys.argv[2]), repr(got).encode())
"""


def test_each_line_leaves_in_one_write_under_pythonunbuffered():
    """Ranks share a log: a line written in pieces can be cut by another rank's (CI's machine sets
    PYTHONUNBUFFERED=1, under which Python writes a print's pieces one by one)."""
    import ast
    import os

    def writes(mode):
        r, w = os.pipe()
        p = subprocess.run([sys.executable, "-c", WRITES, mode, str(w)], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                           pass_fds=(w,), capture_output=True, text=True, timeout=60)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            out = f.read()
        assert p.returncode == 0, p.stderr
        return ast.literal_eval(out.decode())

    assert len(writes("plain")) > 2  # what Python does unbuffered: the parts one by one
    assert writes("ours") == [b"hybridtron train (rank 1/2): error: a line in parts\n", b"step 1 | loss 2.0\n"]
