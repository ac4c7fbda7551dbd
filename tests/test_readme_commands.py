"""The README front page's commands, run in its order in one checkout-like directory, then `./run.sh train` again.

The commands are read from README.md's ```bash blocks (and its ```python block, run in a subprocess), so the front
page and this test cannot drift apart. A command that trains or prepares gets small step counts appended (a later
`--section.field` override wins over an earlier one of the same command) and a small vocabulary; one that names
its own corpus keeps it, a synthetic task all its data settings, the others read a capped stdlib corpus. `./run.sh test` is the suite this test is part
of, so it is not run; the SLURM `submit` line must carry `--dry-run` (there is no cluster here).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FRONT_PAGE_MAX_LINES = 140

SHORT = ["--train.max_steps", "4", "--train.eval_every", "2",  # the presets' warm-up scales down to a short run
         "--train.eval_batches", "1", "--checkpoint.every", "2"]
SMALL_CORPUS = ["--data.sources", "[{path: stdlib, max_files: 30}]"]
SMALL_VOCAB = ["--data.tokenizer.vocab_size", "400"]
TRAINS = ("train", "prepare", "ablate")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a markdown text, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def bash_commands(body: str) -> list[list[str]]:
    """The commands of a bash block as argv lists: continuation lines joined, comments dropped."""
    return [argv for line in body.replace("\\\n", " ").splitlines() if (argv := shlex.split(line, comments=True))]


def readme_steps(text: str) -> list[tuple[str, list[str] | str]]:
    """("bash", argv) and ("python", source) in the README's order."""
    steps = []
    for lang, body in fenced_blocks(text):
        if lang == "bash":
            steps += [("bash", argv) for argv in bash_commands(body)]
        elif lang == "python":
            steps.append(("python", body))
    return steps


def subcommand(argv: list[str]) -> str:
    """`train` of `./run.sh train ...`, `hybridtron train ...` and `torchrun ... -m hybridtron.cli train ...`."""
    if argv[0] == "torchrun":
        i = argv.index("hybridtron.cli")
        return argv[i + 1]
    return argv[1] if len(argv) > 1 else ""


def runnable(argv: list[str], cwd: Path) -> list[str]:
    """The README's argv as this test runs it: run.sh from the checkout-like cwd, the CLI and torchrun through the
    interpreter running the tests, small settings appended where the command trains or prepares."""
    head, rest = argv[0], argv[1:]
    if head == "./run.sh":
        cmd = [str(cwd / "run.sh"), *rest]
    elif head == "hybridtron":
        cmd = [sys.executable, "-m", "hybridtron.cli", *rest]
    elif head == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", *rest]
    else:
        pytest.fail(f"README command {shlex.join(argv)!r} starts with {head!r}: this test runs only ./run.sh, "
                    f"hybridtron and torchrun lines; teach it the new one or move the line out of a bash block")
    if subcommand(argv) in TRAINS:
        cmd += SHORT
        if "--data.synthetic.task" not in argv:  # a synthetic task keeps its own data settings
            cmd += SMALL_VOCAB if "--data.sources" in argv else SMALL_CORPUS + SMALL_VOCAB
    return cmd


def write_corpus(root: Path) -> None:
    """The `corpus/*.jsonl` (field `text`) the README's own-corpus commands read: 60 stdlib modules."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    (root / "corpus").mkdir()
    for part in range(2):
        rows = [json.dumps({"text": p.read_text(errors="replace")}) for p in stdlib[part::2]]
        (root / "corpus" / f"part-{part}.jsonl").write_text("\n".join(rows) + "\n")


def test_front_page_stays_short():
    n = len(README.read_text().splitlines())
    assert n < FRONT_PAGE_MAX_LINES, (
        f"README.md has {n} lines; keep the front page under {FRONT_PAGE_MAX_LINES} and move detail to docs/")


def test_front_page_has_the_commands_a_newcomer_needs():
    steps = readme_steps(README.read_text())
    cmds = [argv for kind, argv in steps if kind == "bash"]
    have = {(argv[0], subcommand(argv)) for argv in cmds}
    for need in [("./run.sh", "train"), ("./run.sh", "test"), ("hybridtron", "eval"), ("hybridtron", "sample"),
                 ("hybridtron", "prepare"), ("hybridtron", "train"), ("hybridtron", "export"),
                 ("torchrun", "train"), ("hybridtron", "submit"), ("hybridtron", "status")]:
        assert need in have, f"README.md's bash blocks lack a `{' '.join(need)}` command"
    assert any(kind == "python" for kind, _ in steps), "README.md lacks the python block that loads an export"
    for argv in cmds:
        if subcommand(argv) == "submit":
            assert "--dry-run" in argv, f"the README's submit line needs --dry-run (no cluster in tests): {argv}"


@pytest.mark.slow
def test_readme_commands_run_in_order(tmp_path):
    steps = readme_steps(README.read_text())
    (tmp_path / "run.sh").symlink_to(REPO / "run.sh")  # run.sh cds to its own directory: here, a checkout's root
    write_corpus(tmp_path)
    # run.sh sets up the environment it is pointed at: the one running the tests, already installed
    env = {**os.environ, "HYBRIDTRON_VENV": sys.prefix, "PYTHONUNBUFFERED": "1"}

    def run(cmd: list[str], shown: str, extra_env: dict | None = None) -> None:
        p = subprocess.run(cmd, cwd=tmp_path, env={**env, **(extra_env or {})}, capture_output=True, text=True,
                           timeout=600)
        if p.returncode != 0:
            # the one-line errors first: under torchrun a rank's reason is far above the launcher's summary
            errors = "\n".join(ln for ln in p.stderr.splitlines() if ": error:" in ln)[-2000:]
            pytest.fail(f"README command failed with exit {p.returncode}: {shown}\n(run as: {shlex.join(cmd)})\n"
                        f"--- error lines ---\n{errors}\n--- stderr tail ---\n{p.stderr[-2000:]}\n"
                        f"--- stdout tail ---\n{p.stdout[-1000:]}")

    empty_conf = tmp_path.parent / f"{tmp_path.name}-empty-slurm.conf"
    empty_conf.touch()
    first_train = None
    for kind, step in steps:
        if kind == "python":
            run([sys.executable, "-c", step], "the README's python block")
            continue
        if step[0] == "./run.sh" and subcommand(step) == "test":
            continue  # the whole suite, which is running this test
        if step[0] == "./run.sh" and subcommand(step) == "train" and first_train is None:
            first_train = step
        # `submit --dry-run` checks the partition and node count with sinfo where SLURM answers; the SLURM tests of
        # this suite may have a local two-node cluster up, without a "gpu" partition: the command runs as on a login
        # node whose sinfo cannot reach a controller (submit notes that it skipped the check)
        # (an empty file: sinfo stops at once; a missing one it retries for a minute)
        slurm_off = {"SLURM_CONF": str(empty_conf)} if subcommand(step) == "submit" else None
        run(runnable(step, tmp_path), shlex.join(step), slurm_off)
    assert first_train is not None, "README.md has no ./run.sh train"
    run(runnable(first_train, tmp_path), f"{shlex.join(first_train)} (again, after every other README command)")
