"""`hybridtron submit prepare` on the suite's local SLURM cluster (2 nodes, 1 CPU each): the parts tokenized by
one task per node (--nodes 2) or by an array of 2 tasks (--array 2), then merged, give a data directory whose
tokenizer, shards and manifests are byte-identical to a one-process `hybridtron prepare` of the same sources; an
array task killed with SIGKILL mid-way leaves parts that the merge job finishes, to the same bytes. The commands
run as users run them, in a subprocess. Without a cluster: the dry runs and refusals here, and
tests/data_pipeline/test_prepare_tasks.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
N_FILES = 14


def data_args(corpus: Path, out: Path) -> list[str]:
    return ["--data.sources", f"[{{path: {corpus}}}]", "--data.tokenizer.kind", "bpe",
            "--data.tokenizer.vocab_size", "300", "--data.tokenizer.sample_mb", "0.1", "--data.part_mb", "0.015",
            "--data.workers", "1", "--data.shard_docs", "4", "--data.out_dir", str(out)]


def cli(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridtron.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def data_bytes(root: Path) -> dict[str, bytes]:
    """The tokenizer, shards and manifests (not the jobs' own files under .slurm/, nor caches)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not {".slurm", ".hf_cache"} & set(p.relative_to(root).parts)
            and p.name not in ("prepare_config.json", ".verified.json")}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:N_FILES]
    for i, f in enumerate(files):
        (root / f"{i:03d}.txt").write_text(f.read_text(errors="replace")[:12_000])
    return root


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("ref") / "data"
    res = cli("prepare", *data_args(corpus, out))
    assert res.returncode == 0, res.stderr
    got = data_bytes(out)
    assert any(k.endswith("train/manifest.json") for k in got) and "tokenizer/tokenizer.json" in got
    return got


def logs(data: Path) -> str:
    parts = [f"==== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
             for p in sorted((data / ".slurm" / "logs").glob("*"))]
    return "\n".join(parts) or "(no logs)"


def wait_for(cond, timeout: float, what: str, data: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs(data)}"
        time.sleep(0.3)


def wait_end(cluster, job: str, data: Path, timeout: float = 90) -> str:
    wait_for(lambda: cluster.job_field(job, "JobState") in ENDED, timeout, f"job {job} to end", data)
    return cluster.job_field(job, "JobState")


def cancel(cluster, ids: list[str]) -> None:
    if ids:
        cluster.run("scancel", *ids)


@pytest.mark.slow
def test_one_task_per_node_writes_the_one_process_bytes(slurm_cluster, corpus, reference, tmp_path):
    data = tmp_path / "data"
    res = cli("submit", "prepare", "--nodes", "2", *data_args(corpus, data))
    assert res.returncode == 0, res.stderr
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    try:
        assert wait_end(slurm_cluster, job, data) == "COMPLETED", logs(data)
        got = data_bytes(data)
        assert sorted(got) == sorted(reference)
        assert [k for k in got if got[k] != reference[k]] == []
        text = logs(data)
        assert "task 0 of 2" in text and "task 1 of 2" in text, text  # one on each node
        n, done = map(int, re.search(r"(\d+) parts of <= [\d.]+ MB, (\d+) done", text).groups())
        assert n >= 4 and done == n, text  # the tasks did every part; the merge only merged
        assert not list(data.glob("*/.parts")), "the merge removes the parts"
        status = cli("status", str(data))
        assert status.returncode == 0 and "ready:" in status.stdout, status.stdout + status.stderr
    finally:
        cancel(slurm_cluster, [job])


@pytest.mark.slow
def test_array_task_killed_midway_is_finished_to_the_same_bytes(slurm_cluster, corpus, reference, tmp_path):
    data = tmp_path / "data"
    # each part then takes a second more, so the kill comes while the task still has parts to do
    res = cli("submit", "prepare", "--array", "2", *data_args(corpus, data),
              env={"HYBRIDTRON_TEST_PART_DELAY": "1.0"})
    assert res.returncode == 0, res.stderr
    m = re.search(r"plan (\d+), tasks (\d+) \(array of 2\), merge (\d+)", res.stdout)
    assert m, res.stdout
    plan, tasks, merge = m.groups()
    try:
        log1 = data / ".slurm" / "logs" / f"prepare-{tasks}.task1.out"

        def one_part_done() -> bool:
            return log1.is_file() and "task 1 of 2: part" in log1.read_text()

        wait_for(one_part_done, 90, "task 1's first part", data)
        pid = int(re.search(r"task 1 of 2 on \S+ \(pid (\d+)\)", log1.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        mid = cli("status", str(data))  # while the merge has not yet run: parts left, a time estimate
        assert mid.returncode == 0 and re.search(r"parts \d+ of \d+ done", mid.stdout), mid.stdout + mid.stderr
        assert "plan: COMPLETED" in mid.stdout and re.search(r"tasks: 2 tasks: \d", mid.stdout) and \
            re.search(r"of \d+ parts, .* tokens/s over", mid.stdout), mid.stdout  # the jobs, the rates
        assert wait_end(slurm_cluster, merge, data) == "COMPLETED", logs(data)
        merged = (data / ".slurm" / "logs" / f"prepare-{merge}.merge.out").read_text()
        n, done = map(int, re.search(r"(\d+) parts of <= [\d.]+ MB, (\d+) done", merged).groups())
        assert done < n, merged  # the killed task's parts were left, and the merge tokenized them
        got = data_bytes(data)
        assert sorted(got) == sorted(reference)
        assert [k for k in got if got[k] != reference[k]] == []
        again = cli("prepare", *data_args(corpus, data))  # and a rerun by hand changes nothing
        assert again.returncode == 0, again.stderr
        assert data_bytes(data) == reference
    finally:
        cancel(slurm_cluster, [plan, tasks, merge])


# ---- without a cluster: the script, and what is refused before sbatch ------------------------------------------
@pytest.fixture
def no_cluster(monkeypatch):
    from hybridtron.slurm import cluster

    monkeypatch.setattr(cluster, "find_binary", lambda name: None)


def submit(argv, capsys) -> tuple[int, str, str]:
    from hybridtron.cli import main

    code = main(["submit", "prepare", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dry_run_prints_the_script_and_the_three_sbatch_lines_and_writes_nothing(no_cluster, corpus, tmp_path,
                                                                                  capsys):
    data = tmp_path / "data"
    code, script, err = submit(["--array", "16", "--partition", "cpu", "--time", "04:00:00", "--cpus-per-node", "32",
                                *data_args(corpus, data), "--dry-run"], capsys)
    assert code == 0, err
    lines = script.splitlines()
    for line in ("#SBATCH --partition=cpu", "#SBATCH --time=04:00:00", "#SBATCH --cpus-per-task=32",
                 f"#SBATCH --output={data}/.slurm/logs/prepare-%j.out"):
        assert line in lines, line
    assert not [ln for ln in lines if ln.startswith(("#SBATCH --gpus", "#SBATCH --gres"))]  # tokenizing: CPUs
    plan = next(ln for ln in lines if ln.startswith("# plan=$(sbatch"))
    tasks = next(ln for ln in lines if ln.startswith("# tasks=$(sbatch"))
    merge = next(ln for ln in lines if ln.startswith("# merge=$(sbatch"))
    assert plan.endswith(" plan)") and "--dependency" not in plan
    assert '"--dependency=afterok:$plan"' in tasks and "--array=0-15" in tasks and tasks.endswith(" task)")
    assert '"--dependency=afterok:$plan,afterany:$tasks"' in merge and merge.endswith(" merge)")
    assert "--stage task --task \"$SLURM_ARRAY_TASK_ID\" --tasks \"$SLURM_ARRAY_TASK_COUNT\"" in script
    assert "Submitted as:  hybridtron submit prepare --cpus-per-node 32 --partition cpu --time 04:00:00 --array 16" \
        in script
    assert not data.exists()
    path = tmp_path / "prepare.sbatch"
    path.write_text(script)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_nodes_is_one_job_with_a_task_per_node(no_cluster, corpus, tmp_path, capsys):
    code, script, err = submit(["--nodes", "4", *data_args(corpus, tmp_path / "d"), "--dry-run"], capsys)
    assert code == 0, err
    assert "#SBATCH --nodes=4" in script.splitlines()
    assert '--stage task --task "$SLURM_PROCID" --tasks "$SLURM_NTASKS"' in script
    assert [ln for ln in script.splitlines() if ln.startswith("# job=$(sbatch")][0].endswith(" all)")


@pytest.mark.parametrize("argv, message", [
    (["--array", "0"], "--array 0 must be at least 1"),
    (["--array", "2", "--nodes", "2"], "each array task is one node; give one of them"),
    (["--chain", "2"], "--chain is for training jobs"),
    (["--time", "soon"], "--time 'soon' is not a SLURM time limit"),
    (["--data.sources", "[{path: /no/such/corpus}]"], "data source '/no/such/corpus' matches no file"),
])
def test_bad_prepare_submissions_are_refused_in_one_line(no_cluster, argv, message, tmp_path, capsys):
    code, _out, err = submit(["--data.out_dir", str(tmp_path / "d"), "--dry-run", *argv], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "d").exists()


def test_array_is_refused_for_a_training_job(no_cluster, tmp_path, capsys):
    from hybridtron.cli import main

    assert main(["submit", "--run-dir", str(tmp_path / "r"), "--array", "4", "--dry-run"]) == 2
    assert "--array is for `hybridtron submit prepare`" in capsys.readouterr().err


def test_show_template_of_prepare(capsys):
    from hybridtron.cli import main
    from hybridtron.slurm.submit import PREPARE_TEMPLATE

    assert main(["submit", "prepare", "--show-template"]) == 0
    assert capsys.readouterr().out == PREPARE_TEMPLATE.read_text()
