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
