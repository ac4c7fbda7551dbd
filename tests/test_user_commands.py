"""The commands of README.md and docs/ as a user runs them: each in a subprocess, in the environment `./run.sh` gives
a user, and nothing of the suite's own set-up.

The suite's process (tests/conftest.py) sets TRITON_INTERPRET=1, hides fla from transformers, points the tuner's
cache elsewhere and runs in `.venv-dev`, whose test-only packages (triton, fla-core, torchao) a user's `.venv` does
not have. None of that reaches these commands: each runs with the executables of the user's environment
(`HYBRIDTRON_USER_VENV`, which `./run.sh test` sets to the `.venv` that `./run.sh train` makes; run directly, this
file makes that environment itself through `./run.sh`), an environment built from nothing but PATH, HOME (a fresh
directory: a new user's caches), LANG and the suite's thread budget (OMP_NUM_THREADS: a speed setting, without which
two test workers' processes oversubscribe the cores), in a directory laid out like a fresh checkout. Each must
exit 0 and leave stderr with no traceback and no line that is not ours (`FOREIGN`): a dependency's warning there is
a defect too.

The commands are read from the markdown itself, so the pages and this test cannot drift apart. A command that
trains or prepares gets small step counts appended (a later `--section.field` override wins over an earlier one), a
small vocabulary, and a capped stdlib corpus unless it names its own corpus or a synthetic task. Commands a CPU
cannot run (a job for 8 GPUs) have their config and layout checked by `hybridtron submit --dry-run` for the same
cluster shape instead, which reads both the way the job would.
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
DOCS = REPO / "docs"
FRONT_PAGE_MAX_LINES = 140

SHORT = ["--train.max_steps", "4", "--train.eval_every", "2",  # the presets' warm-up scales down to a short run
         "--train.eval_batches", "1", "--checkpoint.every", "2"]
SMALL_CORPUS = ["--data.sources", "[{path: stdlib, max_files: 30}]"]
SMALL_VOCAB = ["--data.tokenizer.vocab_size", "400"]
TRAINS = ("train", "prepare", "ablate")
TINY_PRESETS = ("tiny", "tiny_hybrid", "tiny_deltaproduct", "tiny_hax", "tiny_moe", "tiny_structured", "tiny_scale")

# A stderr line that is ours: our log lines, our one-line errors and run.sh's own lines.
OURS = re.compile(r"^(\[hybridtron\]|\[run\.sh\]|hybridtron [a-z]+( \(rank \d+/\d+\))?: )")
# Lines a command may print that are not ours, each with the command it belongs to and why it is accepted:
# torchrun is the user's own launcher (not our process); it announces the thread count it gives each worker.
LAUNCHER = re.compile(r"torch/distributed/run\.py:\d+\]|^\*{10,}$|Setting OMP_NUM_THREADS environment variable")
# The loading snippet is the user's own script, where transformers speaks for itself: its progress bar, and on a
# Gated DeltaNet model the notice that it takes its torch path because fla / causal-conv1d are not installed (on a
# CPU that is the only path: both packages' kernels need a GPU; docs/export.md#loading-on-a-cpu).
TRANSFORMERS = re.compile(r"^Loading weights: +\d+%|^\[transformers\] `\w+` is falling back to its reference PyTorch "
                          r"implementation because `(causal_conv1d|flash-linear-attention)` is not installed")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a markdown text, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def bash_commands(body: str) -> list[list[str]]:
    """The commands of a bash block as argv lists: continuation lines joined, comments dropped."""
    return [argv for line in body.replace("\\\n", " ").splitlines() if (argv := shlex.split(line, comments=True))]


def page_steps(text: str) -> list[tuple[str, list[str] | str]]:
    """("bash", argv) and ("python", source) in the page's order."""
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
        return argv[argv.index("hybridtron.cli") + 1]
    return argv[1] if len(argv) > 1 else ""


# torchao's compiled extensions are built for CUDA torch: on the CPU build it says it cannot load them, and its
# Enums meet torch's pytree deprecation. Only .venv-dev pairs torchao with a CPU torch (a user's fp8 extra goes with a
# CUDA build); our commands drop these lines (quiet.py), a user's own script there shows them.
TORCHAO = re.compile(r"^Failed to load .*torchao/_C|torch/utils/_pytree\.py:\d+\] <enum '\w+'> is an Enum subclass")


def foreign(stderr: str, *allowed: re.Pattern) -> list[str]:
    """The lines of ``stderr`` that are not ours, nor match one of ``allowed``."""
    return [ln for ln in stderr.splitlines()
            if ln.strip() and not OURS.match(ln) and not any(a.search(ln) for a in allowed)]


def write_corpus(root: Path) -> None:
    """The `corpus/*.jsonl` (field `text`) the own-corpus commands read: 60 stdlib modules; `books/` (text) and
    `code/*.parquet` (field `content`) for docs/data.md's blend."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    (root / "corpus").mkdir()
    for part in range(2):
        rows = [json.dumps({"text": p.read_text(errors="replace")}) for p in stdlib[part::2]]
        (root / "corpus" / f"part-{part}.jsonl").write_text("\n".join(rows) + "\n")
    (root / "books").mkdir()
    for p in stdlib[:20]:
        (root / "books" / f"{p.stem}.txt").write_text(p.read_text(errors="replace"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "code").mkdir()
    pq.write_table(pa.table({"content": [p.read_text(errors="replace") for p in stdlib[20:40]]}),
                   root / "code" / "part-0.parquet")


def user_venv() -> Path:
    """The user's environment: `HYBRIDTRON_USER_VENV` (set by `./run.sh test`), else the checkout's `.venv` as
    `./run.sh` sets it up (made or brought up to date by a `./run.sh train --help`, the cheapest user command)."""
    given = os.environ.get("HYBRIDTRON_USER_VENV")
    if given:
        return Path(given)
    venv = REPO / ".venv"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VIRTUAL_ENV", "PYTHONPATH")}
    p = subprocess.run([str(REPO / "run.sh"), "train", "--help"], env={**env, "HYBRIDTRON_VENV": str(venv)},
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f"./run.sh could not set up {venv}:\n{p.stderr[-3000:]}"
    return venv


class User:
    """Runs commands in a checkout-like directory with the user's environment (see the module docstring)."""

    def __init__(self, root: Path, venv: Path, home: Path):
        self.root, self.venv = root, venv
        path = os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
        self.env = {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
                    "HYBRIDTRON_VENV": str(venv)}
        if "OMP_NUM_THREADS" in os.environ:
            self.env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        self.empty_slurm_conf = home / "empty-slurm.conf"
        self.empty_slurm_conf.touch()

    def ensure_run(self, preset: str) -> str:
        """runs/e2e_<preset>, trained two steps unless an earlier test of this file trained it."""
        run_dir = f"runs/e2e_{preset}"
        if not (self.root / run_dir / "checkpoints").is_dir():
            self.run(self.argv(["hybridtron", "train", "--config", preset, "--run-dir", run_dir])
                     + ["--train.max_steps", "2", "--train.eval_every", "0"], f"train {preset}")
        return run_dir

    def argv(self, argv: list[str]) -> list[str]:
        """The page's argv as run here: small settings appended where the command trains or prepares."""
        head = argv[0]
        if head not in ("./run.sh", "hybridtron", "torchrun"):
            pytest.fail(f"command {shlex.join(argv)!r} starts with {head!r}: this test runs ./run.sh, hybridtron and "
                        f"torchrun lines; teach it the new one or move the line out of a bash block")
        cmd = list(argv)
        if subcommand(argv) in TRAINS:
            cmd += SHORT
            if "--data.synthetic.task" not in argv:  # a synthetic task keeps its own data settings
                cmd += SMALL_VOCAB if "--data.sources" in argv else SMALL_CORPUS + SMALL_VOCAB
        return cmd

    def run(self, cmd: list[str] | str, shown: str, *, python: bool = False, extra_env: dict | None = None,
            timeout: int = 900, interpreter: str | None = None, allowed: tuple[re.Pattern, ...] = ()
            ) -> subprocess.CompletedProcess:
        """Run ``cmd`` (argv, or with ``python`` a Python source run by the environment's interpreter, or by
        ``interpreter``); fail with its output unless it exits 0 with nothing foreign on stderr (but ``allowed``,
        torchrun's lines where it launched the command, and transformers' in a Python source)."""
        if python:
            cmd = [interpreter or str(self.venv / "bin" / "python"), "-c", cmd]
        env = {**self.env, **(extra_env or {})}
        # submit --dry-run asks sinfo about the partition where SLURM answers; this suite's SLURM tests may have a
        # local cluster up: run as on a login node whose sinfo reaches no controller (an empty file: it stops at once)
        if not python and subcommand(cmd) == "submit":
            env["SLURM_CONF"] = str(self.empty_slurm_conf)
        p = subprocess.run(cmd, cwd=self.root, env=env, capture_output=True, text=True, timeout=timeout)
        bad = foreign(p.stderr, *allowed, *([TRANSFORMERS] if python else []),
                      *([LAUNCHER] if not python and cmd[0] == "torchrun" else []))
        if p.returncode != 0 or bad:
            errors = "\n".join(ln for ln in p.stderr.splitlines() if ": error:" in ln)[-2000:]
            pytest.fail(f"{shown}: exit {p.returncode}" + (", foreign stderr lines:\n" + "\n".join(bad[:20])
                                                           if bad else "")
                        + f"\n(run as: {cmd if python else shlex.join(cmd)})\n--- error lines ---\n{errors}\n"
                        f"--- stderr tail ---\n{p.stderr[-3000:]}\n--- stdout tail ---\n{p.stdout[-1500:]}")
        return p


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> User:
    root = tmp_path_factory.mktemp("checkout")
    (root / "run.sh").symlink_to(REPO / "run.sh")  # run.sh cds to its own directory: here, a checkout's root
    write_corpus(root)
    return User(root, user_venv(), tmp_path_factory.mktemp("home"))


def loading_snippet(export_dir: Path, custom_code: bool) -> str:
    """README.md's python block for ``export_dir``; for a custom-code export with docs/export.md's
    ``trust_remote_code=True`` on both loads."""
    blocks = [body for lang, body in fenced_blocks(README.read_text()) if lang == "python"]
    assert len(blocks) == 1, "README.md should hold one python block: the loading snippet"
    src, n = re.subn(r'from_pretrained\("export/tiny"\)',
                     f"from_pretrained({str(export_dir)!r}{', trust_remote_code=True' if custom_code else ''})",
                     blocks[0])
    assert n == 2, "the README's loading snippet should load export/tiny's model and tokenizer"
    return src


def test_front_page_stays_short():
    n = len(README.read_text().splitlines())
    assert n < FRONT_PAGE_MAX_LINES, (
        f"README.md has {n} lines; keep the front page under {FRONT_PAGE_MAX_LINES} and move detail to docs/")


def test_front_page_has_the_commands_a_newcomer_needs():
    steps = page_steps(README.read_text())
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


def test_foreign_lines_are_found():
    """The stderr check itself: dependency warnings, tracebacks and progress bars are foreign, ours are not."""
    ours = ("[hybridtron] step 4: loss 5.1\n[run.sh] creating virtual environment .venv\n"
            "hybridtron train: error: unknown config key 'x'\nhybridtron train (rank 1/2): error: lost\n")
    assert foreign(ours) == []
    for line in ("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library",
                 "W1128 03:37:04.043000 3612 torch/utils/_pytree.py:630] <enum 'K'> is an Enum subclass",
                 "/x/fla/utils/hardware.py:62: UserWarning: Triton is not supported on current platform",
                 "USDT:2026-11-28 03:41:26 5037:5037 SyncActivityProfilerHandler.cpp:52] profiler_start",
                 "Traceback (most recent call last):", "Loading weights: 100%|##########| 55/55",
                 "[transformers] `chunk_gated_delta_rule` is falling back to its reference PyTorch implementation"):
        assert foreign(ours + line) == [line]
    launcher = "W1128 10:00:00.000000 1 torch/distributed/run.py:803] Setting OMP_NUM_THREADS environment variable"
    assert foreign(launcher, LAUNCHER) == [] and foreign(launcher) == [launcher]
    bar = "Loading weights: 100%|##########| 55/55 [00:00<00:00, 5984.24it/s]"
    assert foreign(bar, TRANSFORMERS) == [] and foreign(bar) == [bar]


@pytest.mark.slow
class TestAsUsersRunIt:
    """Every command of the pages, in the user's environment (module docstring); the file's tests share one
    checkout-like directory, as a user's session does (its data prepared once)."""

    def test_readme_commands_in_order(self, user):
        steps = page_steps(README.read_text())
        first_train = None
        for kind, step in steps:
            if kind == "python":
                # the loading snippet reads export/tiny, which the export line above it wrote
                user.run(step, "the README's python block", python=True)
                continue
            if step[0] == "./run.sh" and subcommand(step) == "test":
                continue  # the whole suite, which is running this test
            if step[0] == "./run.sh" and subcommand(step) == "train" and first_train is None:
                first_train = step
            user.run(user.argv(step), shlex.join(step))
        assert first_train is not None, "README.md has no ./run.sh train"
        user.run(user.argv(first_train), f"{shlex.join(first_train)} (again, after every other README command)")

    def test_every_preset_trains_exports_and_loads(self, user):
        """Each tiny preset: trained a few steps, exported, and loaded by the README's snippet (the custom-code
        ones with trust_remote_code=True, as docs/export.md says), greedy decoding 20 tokens."""
        snippets = []
        for preset in TINY_PRESETS:
            run_dir, out = user.ensure_run(preset), user.root / f"export/e2e_{preset}"
            user.run(["hybridtron", "export", run_dir, "--out", str(out)], f"export {preset}")
            custom = bool(json.loads((out / "hybridtron_export.json").read_text())["custom_code"])
            snippets.append(f"print('== {preset}')\n" + loading_snippet(out, custom))
        # one interpreter loads them all: the snippet's own imports repeat harmlessly
        p = user.run("\n".join(snippets), "the README's loading snippet on every preset's export", python=True)
        printed = p.stdout.split("== ")[1:]
        assert [block.splitlines()[0] for block in printed] == list(TINY_PRESETS)
        for block in printed:
            assert block.splitlines()[1:] and block.splitlines()[1].startswith("def"), block

    def test_docs_commands(self, user):
        """docs/*.md's commands: those a CPU runs, run (small settings appended); those for GPUs checked by
        `submit --dry-run` for the same cluster shape."""
        ran, checked = [], []
        on_front_page = [step for kind, step in page_steps(README.read_text()) if kind == "bash"]
        for page in sorted(DOCS.glob("*.md")):
            for kind, step in page_steps(page.read_text()):
                where = f"{page.name}: {step if kind == 'python' else shlex.join(step)}"
                if kind == "python" or step in on_front_page:
                    # docs/export.md's loads: the preset and peer-kernel tests run them; the front page's commands:
                    # test_readme_commands_in_order
                    ran.append(where)
                    continue
                # RUN: a trained run; the cluster's shared directory: a dry run's, or for `status` a trained run
                # (a dry run makes no directory for status to read)
                shared = "runs/e2e_tiny" if subcommand(step) == "status" else "runs/e2e_dryrun"
                step = [{"RUN": "runs/e2e_tiny", "/shared/runs/d1b": shared}.get(a, a) for a in _without_optional(step)]
                if "runs/e2e_tiny" in step:
                    user.ensure_run("tiny")
                gpus = _gpu_shape(step)
                if gpus is None:
                    if subcommand(step) == "ablate" and "--seeds" in step:
                        step = step + ["--seeds", "1"]  # one seed of the three: the seeds' loop is tested elsewhere
                    user.run(user.argv(step), where)
                    ran.append(where)
                else:
                    user.run(_dry_run(step, *gpus), f"{where} (as submit --dry-run)")
                    checked.append(where)
        assert ran and checked, (ran, checked)

    def test_export_with_the_peer_kernels_installed(self, user):
        """A CPU machine where fla-core and torchao are installed (a login node with the gpu extras, or .venv-dev):
        every preset's export and its logit check take transformers' torch paths, docs/export.md's loading works
        on each, and stderr stays clean."""
        dev = Path(sys.executable).parent
        env = {"PATH": os.pathsep.join([str(dev), user.env["PATH"]])}
        p = subprocess.run([sys.executable, "-c", "import fla, torchao, triton"], capture_output=True, text=True)
        assert p.returncode == 0, f"the dev environment lacks a peer kernel package: {p.stderr[-500:]}"
        # every preset: the Gated DeltaNet ones are what transformers would bind fla's kernels into, the custom-code
        # ones run our own modelling code beside the installed packages
        hide = next(body for lang, body in fenced_blocks((DOCS / "export.md").read_text())
                    if lang == "python" and 'sys.modules["fla"]' in body)
        snippets = [hide]
        for preset in TINY_PRESETS:
            out = user.root / f"export/e2e_peers_{preset}"
            user.run([str(dev / "hybridtron"), "export", user.ensure_run(preset), "--out", str(out)],
                     f"export {preset} with fla-core and torchao installed", extra_env=env)
            custom = bool(json.loads((out / "hybridtron_export.json").read_text())["custom_code"])
            snippets.append(f"print('== {preset}')\n" + loading_snippet(out, custom))
        # and the loading snippet on each, with docs/export.md's line that hides the two packages from transformers
        p = user.run("\n".join(snippets), "the loading snippet with fla-core installed, as docs/export.md says",
                     python=True, extra_env=env, interpreter=sys.executable, allowed=(TORCHAO,))
        assert [block.splitlines()[0] for block in p.stdout.split("== ")[1:]] == list(TINY_PRESETS), p.stdout


def _without_optional(argv: list[str]) -> list[str]:
    """A synopsis without its optional groups (`[--account A --qos Q]`), which are there to be read."""
    out, inside = [], False
    for a in argv:
        inside = inside or a.startswith("[-")
        if not inside:
            out.append(a)
        inside = inside and not a.endswith("]")
    return out


def _gpu_shape(argv: list[str]) -> tuple[int, int] | None:
    """(nodes, GPUs per node) of a command meant for GPUs (a GPU preset under torchrun, or a submit without
    --dry-run), else None."""
    if argv[0] == "torchrun":
        nproc = int(argv[argv.index("--nproc-per-node") + 1])
        nnodes = int(argv[argv.index("--nnodes") + 1]) if "--nnodes" in argv else 1
        config = argv[argv.index("--config") + 1] if "--config" in argv else "tiny"
        return (nnodes, nproc) if not config.startswith("tiny") else None
    if subcommand(argv) == "submit" and "--dry-run" not in argv:
        return (int(argv[argv.index("--nodes") + 1]), int(argv[argv.index("--gpus-per-node") + 1]))
    return None


def _dry_run(argv: list[str], nodes: int, gpus: int) -> list[str]:
    """`hybridtron submit --dry-run` of a GPU command: its config and overrides, for its cluster shape."""
    if argv[0] == "torchrun":
        rest = argv[argv.index("hybridtron.cli") + 2:]
        return ["hybridtron", "submit", *rest, "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--dry-run"]
    return [*argv, "--dry-run"]
