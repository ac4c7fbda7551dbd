"""`hybridtron submit` and `status` against a real SLURM cluster (slurmctld + two slurmd nodes on localhost).

Every job is a two-node CPU job: one torchrun per node with one gloo process each, c10d rendezvous on the
first node. The uninterrupted job (submitted as a chain of two) is compared with one process taking the same
global batch (the tolerance of the data-parallel tests), and the interrupted ones (the time-limit warning sent
by hand and by SLURM itself, scancel, a killed rank that the job restarts by itself) with the uninterrupted job,
step by step. The schedule is constant so that a run's length does not change its steps.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from hybridtron.cli import main
from hybridtron.slurm.status import read_restarts
from hybridtron.train.checkpoint import CheckpointManager, verify_manifest
from hybridtron.train.metrics import read_metrics
from hybridtron.train.run_dir import LAST_STOP

pytestmark = pytest.mark.slow

STEPS = 150  # long enough that a signal sent at step 10 arrives mid-run (a step takes ~20-50 ms here)
FLAT = ["--train.schedule", "constant", "--train.warmup_steps", "0", "--train.eval_every", "0",
        "--train.micro_batch_size", "4", "--checkpoint.every", "50"]
TWO_NODES = ["--nodes", "2", "--gpus-per-node", "0", "--time", "00:10:00", "--warning-seconds", "60"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


def submit_argv(small_argv, data_dir, run, extra=()) -> list[str]:
    train = small_argv(data_dir, run, [*FLAT, "--train.max_steps", str(STEPS)])
    return ["submit", *TWO_NODES, *train[1:], *extra]  # train[0] is the subcommand


def run_main(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def submit(argv) -> str:
    code, out, err = run_main(argv)
    assert code == 0, err
    return re.search(r"submitted job (\d+)", out).group(1)


def logs(run: Path, job: str) -> str:
    """The job's batch log and node logs, for a failure message."""
    parts = []
    for p in sorted((run / "logs").glob(f"job-{job}*")):
        parts.append(f"==== {p.name}\n{p.read_text(errors='replace')[-4000:]}")
    return "\n".join(parts) or f"(no logs in {run / 'logs'})"


def wait_for(cond, timeout: float, what: str, run: Path, job: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs(run, job)}"
        time.sleep(0.2)


def wait_end(cluster, job: str, run: Path, timeout: float = 240) -> str:
    wait_for(lambda: cluster.job_field(job, "JobState") in ENDED, timeout, f"job {job} to end", run, job)
    return cluster.job_field(job, "JobState")


def wait_steps(cluster, job: str, run: Path, n: int) -> None:
    def logged() -> bool:
        assert cluster.job_field(job, "JobState") not in ENDED, f"job {job} ended early\n{logs(run, job)}"
        return (run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= n

    wait_for(logged, 180, f"step {n}", run, job)


def steps(run) -> list[tuple[int, float, float, int]]:
    return [(r["step"], r["loss"], r["grad_norm"], r["tokens_seen"]) for r in read_metrics(run)]


def assert_same_steps(got, want):
    assert [s[0] for s in got] == [s[0] for s in want] and [s[3] for s in got] == [s[3] for s in want], (got, want)
    for g, w in zip(got, want, strict=True):
        assert g[1] == pytest.approx(w[1], rel=1e-5, abs=1e-6), (g, w)
        assert g[2] == pytest.approx(w[2], rel=1e-4, abs=1e-6), (g, w)


def node_logs(run: Path, job: str, attempt: int | str) -> str:
    """The node logs of one training of the job: ``attempt`` (0, 1, ... after requeues), or "0.r1" for its first
    restart after a failure."""
    files = sorted((run / "logs").glob(f"job-{job}.{attempt}.node*.log"))
    assert len(files) == 2, f"expected one log per node for attempt {attempt}: {files}\n{logs(run, job)}"
    return "\n".join(f.read_text(errors="replace") for f in files)


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, small_data_dir, small_argv, tmp_path_factory):
    """The reference job, submitted as a chain of two: the second starts when the first ends and finds nothing to do."""
    run = tmp_path_factory.mktemp("slurm_runs") / "uninterrupted"
    code, out, err = run_main(submit_argv(small_argv, small_data_dir, run, ["--chain", "2"]))
    assert code == 0, err
    job, follower = re.search(r"submitted jobs (\d+), (\d+) \(each starts when the previous one ends\)", out).groups()
    return {"run": run, "job": job, "state": wait_end(slurm_cluster, job, run), "follower": follower}


def test_two_node_job_completes_and_trains_like_one_process(uninterrupted, slurm_cluster, small_data_dir, small_argv,
                                                            tmp_path):
    run, job = uninterrupted["run"], uninterrupted["job"]
    assert uninterrupted["state"] == "COMPLETED", logs(run, job)
    batch_log = (run / "logs" / f"job-{job}.out").read_text()
    assert "attempt 0 on node[1-2]: 2 x torchrun --nproc-per-node 1" in batch_log, batch_log
    assert f"training finished at step {STEPS}" in batch_log, batch_log
    assert "2 processes, dp=2" in node_logs(run, job, 0)
    follower = uninterrupted["follower"]
    assert wait_end(slurm_cluster, follower, run) == "COMPLETED", logs(run, follower)
    assert f"the run is already finished (checkpoint at step {STEPS} of {STEPS}): nothing to do" in \
        (run / "logs" / f"job-{follower}.out").read_text()
    ref = tmp_path / "one_process"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the job's processes have one thread each; two here only contend with other work
    try:
        assert main(small_argv(small_data_dir, ref, [*FLAT, "--train.max_steps", str(STEPS),
                                                     "--train.grad_accum_steps", "2"])) == 0
    finally:
        torch.set_num_threads(threads)
    assert_same_steps(steps(run), steps(ref))


def test_status_shows_state_step_checkpoint_and_logs(uninterrupted):
    run, job = uninterrupted["run"], uninterrupted["job"]
    code, out, err = run_main(["status", str(run)])
    assert code == 0, err
    assert re.search(rf"job {job} +COMPLETED, ran \S+ of 10:00 on node\[1-2\]", out), out
    assert f"step {STEPS} of {STEPS}, loss " in out and f"{run}/checkpoints/step_{STEPS:08d}" in out, out
    assert f"step {STEPS} (max_steps)" in out and f"{run}/logs/job-{job}.out" in out, out
    assert f"{run}/logs/job-{job}.0.node1.log" in out, out


def test_warning_signal_checkpoints_requeues_and_resumes_to_the_same_losses(
        uninterrupted, slurm_cluster, small_data_dir, small_argv, tmp_path):
    run = tmp_path / "run"
    job = submit(submit_argv(small_argv, small_data_dir, run))
    wait_steps(slurm_cluster, job, run, 10)
    # What SLURM sends --warning-seconds before the time limit (#SBATCH --signal=B:USR1@60): USR1 to the batch shell.
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job, check=True)
    wait_for(lambda: slurm_cluster.job_field(job, "Restarts") == "1" and
             slurm_cluster.job_field(job, "JobState") == "PENDING", 120, "the job to requeue itself", run, job)
    stop = json.loads((run / LAST_STOP).read_text())
    assert stop["stopped_by"] == "signal" and 10 <= stop["step"] < STEPS, stop
    latest = CheckpointManager(run).latest()
    assert latest.name == f"step_{stop['step']:08d}"
    verify_manifest(latest)
    code, out, _ = run_main(["status", str(run)])
    assert re.search(rf"job {job} +PENDING \(\w+\), requeued 1x", out), out  # held back for cred_expire seconds
    assert f"step {stop['step']} (signal)" in out, out
    assert wait_end(slurm_cluster, job, run) == "COMPLETED", logs(run, job)
    batch_log = (run / "logs" / f"job-{job}.out").read_text()
    for line in ("time-limit warning (SIGUSR1)", f"requeueing job {job} to resume from it", "attempt 1 on node[1-2]",
                 f"from step {stop['step']}", f"training finished at step {STEPS}"):
        assert line in batch_log, batch_log
    # rank 0 logs the signal, or that another rank had it first: both then stop at the same step
    assert re.search(r"received signal (SIGUSR1|on another rank); saving a checkpoint at step", node_logs(run, job, 0))
    assert f"resumed from {latest} (step {stop['step']})" in node_logs(run, job, 1)
    assert_same_steps(steps(run), steps(uninterrupted["run"]))


def test_time_limit_warning_from_slurm_itself_checkpoints_and_requeues(
        slurm_cluster, small_data_dir, small_argv, tmp_path):
    """The warning as SLURM sends it, from #SBATCH --signal=B:USR1@40 with a one-minute limit: its time-limit check
    runs every 30 s, so the warning comes 20 to 50 s in, while training runs; the job checkpoints and requeues."""
    run = tmp_path / "run"
    job = submit(submit_argv(small_argv, small_data_dir, run, ["--time", "00:01:00", "--warning-seconds", "40",
                                                               "--train.max_steps", "1000000", "--train.log_every",
                                                               "50"]))
    try:
        wait_for(lambda: slurm_cluster.job_field(job, "Restarts") == "1", 120, "the job to requeue itself", run, job)
        assert "time-limit warning (SIGUSR1)" in (run / "logs" / f"job-{job}.out").read_text(), logs(run, job)
        stop = json.loads((run / LAST_STOP).read_text())
        assert stop["stopped_by"] == "signal" and stop["step"] > 0, stop
        verify_manifest(CheckpointManager(run).latest())
    finally:
        slurm_cluster.run("scancel", job)
    assert wait_end(slurm_cluster, job, run) == "CANCELLED"


def test_scancel_leaves_a_readable_checkpoint_and_resubmission_resumes(
        uninterrupted, slurm_cluster, small_data_dir, small_argv, tmp_path):
    run = tmp_path / "run"
    argv = submit_argv(small_argv, small_data_dir, run)
    job = submit(argv)
    wait_steps(slurm_cluster, job, run, 10)
    slurm_cluster.run("scancel", job, check=True)  # SIGTERM to every process of the job, SIGKILL after KillWait
    assert wait_end(slurm_cluster, job, run) == "CANCELLED"
    assert "SIGTERM (scancel or preemption)" in (run / "logs" / f"job-{job}.out").read_text(), logs(run, job)
    stop = json.loads((run / LAST_STOP).read_text())  # the trainer got SIGTERM and checkpointed where it stopped
    assert stop["stopped_by"] == "signal" and 10 <= stop["step"] < STEPS, stop
    latest = CheckpointManager(run).latest()
    assert latest.name == f"step_{stop['step']:08d}"
    verify_manifest(latest)
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]
    nodes = node_logs(run, job, 0)  # torchrun ends with its processes: no SignalException traceback after them
    assert "Traceback" not in nodes and "SignalException" not in nodes, nodes[-3000:]
    code, out, err = run_main(["eval", "--run-dir", str(run), "--batches", "1"])  # readable, on one process
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["checkpoint"] == str(latest), err
    job2 = submit(argv)  # the same command again
    assert wait_end(slurm_cluster, job2, run) == "COMPLETED", logs(run, job2)
    assert f"resumed from {latest} (step {stop['step']})" in node_logs(run, job2, 0)
    assert_same_steps(steps(run), steps(uninterrupted["run"]))


def test_scontrol_requeue_resumes_and_the_log_says_slurm_requeued_it(
        uninterrupted, slurm_cluster, small_data_dir, small_argv, tmp_path):
    """`scontrol requeue` (what an admin or a requeueing preemption does): SIGTERM, a checkpoint, and SLURM starts
    the job again by itself; the log says so instead of asking for a resubmission that would run a second job."""
    run = tmp_path / "run"
    job = submit(submit_argv(small_argv, small_data_dir, run))
    wait_steps(slurm_cluster, job, run, 10)
    slurm_cluster.run("scontrol", "requeue", job, check=True)
    assert wait_end(slurm_cluster, job, run, timeout=300) == "COMPLETED", logs(run, job)
    assert slurm_cluster.job_field(job, "Restarts") == "1"
    batch_log = (run / "logs" / f"job-{job}.out").read_text()
    assert f"SLURM requeued job {job}, which resumes from that checkpoint by itself" in batch_log, batch_log
    assert "resume with:" not in batch_log, batch_log
    # the job script serves the rendezvous store: no node's torchrun takes it away from the others' exit barrier
    # (whichever torchrun hosted it and ended first left the other's log ending in a DistNetworkError traceback)
    assert "rendezvous store did not start" not in batch_log, batch_log
    assert "Traceback" not in node_logs(run, job, 0) + node_logs(run, job, 1)
    assert "resumed from" in node_logs(run, job, 1)
    assert_same_steps(steps(run), steps(uninterrupted["run"]))


def _rank_pid(job: str, rank: int) -> int | None:
    """The pid of training process ``rank`` of SLURM job ``job`` (its environment says both)."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"RANK={rank}".encode()}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                env = set((proc / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if want <= env and any(e.startswith(b"LOCAL_RANK=") for e in env):
                return int(proc.name)
    return None


def signal_rank_after_checkpoint_5(run: Path, job: str, sig: int, before=None) -> None:
    """Once the job wrote checkpoint 5: ``before()`` if given, then ``sig`` to training process 1 (second node)."""
    wait_for(lambda: (run / "checkpoints" / "step_00000005").is_dir(), 180, "checkpoint 5", run, job)
    if before is not None:
        before()
    pid = _rank_pid(job, 1)
    assert pid is not None, logs(run, job)
    os.kill(pid, sig)


def test_killed_rank_restarts_in_the_job_and_ends_with_the_same_losses(
        uninterrupted, slurm_cluster, small_data_dir, small_argv, tmp_path):
    """A training process killed with SIGKILL after a checkpoint: the job script trains again from that checkpoint in
    the same allocation (no requeue), records the restart, and the job completes with the uninterrupted losses (of
    its first 100 steps: a shorter run, the same steps)."""
    run = tmp_path / "run"
    job = submit(submit_argv(small_argv, small_data_dir, run, ["--checkpoint.every", "5", "--train.max_steps", "100"]))
    try:
        signal_rank_after_checkpoint_5(run, job, signal.SIGKILL)
        assert wait_end(slurm_cluster, job, run) == "COMPLETED", logs(run, job)
    finally:
        if slurm_cluster.job_field(job, "JobState") not in ENDED:
            slurm_cluster.run("scancel", job)
    assert slurm_cluster.job_field(job, "Restarts") == "0"  # the same allocation: SLURM requeued nothing
    restarts = read_restarts(run)
    assert len(restarts) == 1, restarts
    r = restarts[0]
    assert (r["job_id"], r["attempt"], r["restart"], r["max_restarts"], r["reason"]) == \
        (job, 0, 1, 3, "a process or node died") and r["exit_code"] != 0 and r["from_step"] >= 5, r
    batch_log = (run / "logs" / f"job-{job}.out").read_text()
    assert f"restart 1 of 3: training ended without stopping cleanly (srun exit {r['exit_code']}): a process or node " \
           f"died" in batch_log and f"training again from checkpoint step {r['from_step']}" in batch_log, batch_log
    assert "training finished at step 100" in batch_log.strip().splitlines()[-1], batch_log
    assert "SIGKILL" in node_logs(run, job, "0")  # torchrun's summary names the killed process
    resumed = run / "checkpoints" / r["checkpoint"]
    assert f"resumed from {resumed} (step {r['from_step']})" in node_logs(run, job, "0.r1")
    stop = json.loads((run / LAST_STOP).read_text())
    assert stop["stopped_by"] == "max_steps" and stop["restarts"] == restarts, stop
    code, out, _ = run_main(["status", str(run)])
    assert re.search(rf"restarts +1 after failures; last: job {job} restart 1 of 3 at \S+, a process or node died "
                     rf"\(exit {r['exit_code']}\), from step {r['from_step']}", out), out
    assert_same_steps(steps(run), steps(uninterrupted["run"])[:100])


def test_a_hung_rank_is_named_and_the_job_restarts_to_the_same_losses(
        uninterrupted, slurm_cluster, small_data_dir, small_argv, tmp_path):
    """A training process stopped by the kernel (SIGSTOP) on the second node after a checkpoint: the first node's rank
    names it within train.hang_timeout_s + 30 s and exits 6, the job script trains again from the checkpoint in the
    same allocation, and the job completes with the uninterrupted losses (of its first 100 steps)."""
    run = tmp_path / "run"
    job = submit(submit_argv(small_argv, small_data_dir, run, ["--checkpoint.every", "5", "--train.max_steps", "100",
                                                               "--train.hang_timeout_s", "8"]))
    try:
        signal_rank_after_checkpoint_5(run, job, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: read_restarts(run), 8 + 30 + 20, "the restart after the hang", run, job)
        assert time.monotonic() - stopped < 8 + 30 + 20
        assert wait_end(slurm_cluster, job, run) == "COMPLETED", logs(run, job)
    finally:
        if slurm_cluster.job_field(job, "JobState") not in ENDED:
            slurm_cluster.run("scancel", job)
    first = node_logs(run, job, "0")
    line = next((ln for ln in first.splitlines() if "hang: no progress" in ln and "rank 0/2" in ln), None)
    assert line is not None and "rank 1 (host" in line and "not responding" in line, first[-3000:]
    restarts = read_restarts(run)
    assert len(restarts) == 1 and restarts[0]["hang"]["late_ranks"] == [1], restarts
    assert restarts[0]["reason"].startswith("hang at step") and "late ranks: 1" in restarts[0]["reason"], restarts
    batch_log = (run / "logs" / f"job-{job}.out").read_text()
    assert "restart 1 of 3:" in batch_log and "the hang watch stopped every process" in batch_log, batch_log
    assert "training finished at step 100" in batch_log.strip().splitlines()[-1], batch_log
    assert_same_steps(steps(run), steps(uninterrupted["run"])[:100])


def test_a_failure_without_progress_is_not_restarted_again(slurm_cluster, small_data_dir, small_argv, tmp_path):
    """A training killed after its first checkpoint whose config then breaks (an edit gone wrong): the restart fails
    where the training before it did (the same checkpoint, no step logged since), so the job stops, FAILED, with
    one last line saying why and from where to resume, instead of using up its restarts."""
    run = tmp_path / "run"
    job = submit(submit_argv(small_argv, small_data_dir, run, ["--train.max_steps", "100000", "--checkpoint.every",
                                                               "5"]))
    try:
        config = next((run / "slurm").glob("submit-*.yaml"))  # the config the job trains with
        signal_rank_after_checkpoint_5(run, job, signal.SIGKILL, before=lambda: config.write_text("model: [\n"))
        assert wait_end(slurm_cluster, job, run) == "FAILED", logs(run, job)
    finally:
        if slurm_cluster.job_field(job, "JobState") not in ENDED:
            slurm_cluster.run("scancel", job)
    restarts = read_restarts(run)
    assert [r["restart"] for r in restarts] == [1], restarts
    assert f"config file {config} is not valid YAML" in node_logs(run, job, "0.r1")
    last = (run / "logs" / f"job-{job}.out").read_text().strip().splitlines()[-1]
    latest = CheckpointManager(run).latest()
    assert latest.name == restarts[0]["checkpoint"], (latest, restarts)
    assert "FAILED: training ended without stopping cleanly" in last and "not restarting: it failed again where it " \
        f"failed before restart 1 (checkpoint step {restarts[0]['from_step']}, last logged step " \
        f"{restarts[0]['last_step']}): no progress between the two failures" in last, last
    assert f"The latest complete checkpoint is {latest}; fix the cause, then resume from it with: cd " in last, last
    verify_manifest(latest)  # what latest names is complete, whatever the kill interrupted
    assert not (run / LAST_STOP).exists()  # the trainer did not stop cleanly


@pytest.mark.parametrize("extra, message", [
    (["--partition", "nope"], "--partition 'nope' does not exist on this cluster; its partitions: debug (sinfo)"),
    (["--nodes", "3"], "--nodes 3 is more than partition 'debug' has (2 nodes, sinfo)"),
    (["--config", "/nonexistent/run.yaml"], "config '/nonexistent/run.yaml' is neither a file nor a preset"),
    (["--parallel.dp", "4"], "--nodes 2 x 1 processes per node = 2 processes, but the layout parallel.dp=4"),
    # judged by SLURM alone (these nodes have no GPUs): its reason, in one line
    (["--gpus-per-node", "1"], "sbatch refused the job: sbatch: error: Invalid generic resource (gres) specification"),
])
def test_bad_submissions_fail_with_a_clear_message(extra, message, slurm_cluster, small_data_dir, small_argv, tmp_path):
    before = slurm_cluster.run("squeue", "-h", "-t", "all", "-o", "%i").stdout.split()
    code, _out, err = run_main(submit_argv(small_argv, small_data_dir, tmp_path / "run", extra))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert slurm_cluster.run("squeue", "-h", "-t", "all", "-o", "%i").stdout.split() == before  # nothing submitted
