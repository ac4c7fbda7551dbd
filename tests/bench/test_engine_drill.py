"""bench/engine_drill.py: the before/after drill of every engine and layout (issue 42), run on one of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybridtron.bench import engine_drill

PACKAGE = Path(engine_drill.__file__).resolve().parents[1]


def test_the_drill_refuses_a_directory_without_the_package_and_unknown_layouts(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        engine_drill.main(["--before", str(tmp_path)])
    assert e.value.code == 2 and "holds no hybridtron package" in capsys.readouterr().err
    (tmp_path / "hybridtron").symlink_to(PACKAGE)
    with pytest.raises(SystemExit) as e:
        engine_drill.main(["--before", str(tmp_path), "ddp", "zero4"])
    assert e.value.code == 2 and "unknown layout zero4" in capsys.readouterr().err


@pytest.mark.slow
def test_the_drill_finds_this_checkout_equal_to_itself_and_its_resume_exact(tmp_path):
    """The one-process layout, this checkout as both versions: bitwise equal, and both resumes reach the same step 4."""
    (tmp_path / "hybridtron").symlink_to(PACKAGE)
    done = subprocess.run([sys.executable, "-m", "hybridtron.bench.engine_drill", "--before", str(tmp_path), "single"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("single: before == after bitwise: True; resumed to the same step 4 (before, after): "
                           "True, True; last (4, "), line
