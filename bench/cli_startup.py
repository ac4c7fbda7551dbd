"""CPU seconds of the command line's quick answers: ``hybridtron --help``, a mistyped flag, an unknown config key.

    python -m hybridtron.bench.cli_startup                       # this checkout, 5 runs a command
    python -m hybridtron.bench.cli_startup --before DIR --runs 9  # beside another checkout, alternating

``--before DIR``: a directory holding another version of the package as ``DIR/hybridtron`` (e.g. ``mkdir -p
/tmp/old/hybridtron && git archive HEAD~5 | tar -x -C /tmp/old/hybridtron``), run with ``PYTHONPATH=DIR``; the two
alternate command by command, so a drift in the machine's speed moves both. Each figure is the median of the
runs' user + system seconds of the whole process (``resource.getrusage(RUSAGE_CHILDREN)`` around it), start-up
included: what a user waits for on an idle core; the wall seconds beside it depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "hybridtron --help": ["--help"],
    "a mistyped flag (train --run-dri runs/x)": ["train", "--run-dri", "runs/x"],
    "an unknown key (train --train.lerning_rate 1e-3)": ["train", "--train.lerning_rate", "1e-3"],
}


def cpu_seconds(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float, int]:
    """(user + system seconds, wall seconds, exit code) of one ``python -m hybridtron.cli ARGV`` process."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    code = subprocess.run([sys.executable, "-m", "hybridtron.cli", *argv], env=env, cwd=cwd,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600).returncode
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall, code


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--before", default=None, metavar="DIR", help="DIR/hybridtron: the version to compare with")
    args = ap.parse_args(argv)
    sides = {"this checkout": dict(os.environ)}
    if args.before:
        sides = {"before": {**os.environ, "PYTHONPATH": os.path.abspath(args.before)}, **sides}
    with tempfile.TemporaryDirectory() as cwd:  # runs/ and data/ the commands might name stay out of the checkout
        cpu = {(c, s): [] for c in COMMANDS for s in sides}
        wall = {(c, s): [] for c in COMMANDS for s in sides}
        codes = {}
        for name, cmd in COMMANDS.items():
            for env in sides.values():
                cpu_seconds(cmd, env, cwd)  # warm-up: the page cache, .pyc files
            for _ in range(args.runs):
                for side, env in sides.items():
                    c, w, codes[name, side] = cpu_seconds(cmd, env, cwd)
                    cpu[name, side].append(c)
                    wall[name, side].append(w)
    print(f"| command (median of {args.runs}) | {' | '.join(f'{s}: CPU s | wall s' for s in sides)} | exit |")
    print(f"| --- | {' | '.join('---: | ---:' for _ in sides)} | ---: |")
    for name in COMMANDS:
        cells = [f"{statistics.median(cpu[name, s]):.2f} | {statistics.median(wall[name, s]):.2f}" for s in sides]
        print(f"| {name} | {' | '.join(cells)} | {'/'.join(str(codes[name, s]) for s in sides)} |")


if __name__ == "__main__":
    main()
