"""`hybridtron submit` without a cluster: the rendered script, and every refusal that comes before sbatch.

The script is checked for what a cluster needs of it (the #SBATCH lines, one torchrun per node with c10d
rendezvous, the warning signal, requeue, per-node logs) and by `bash -n`; the refusals name the problem and the
fix, and write nothing. `hybridtron status` is checked on a run directory without SLURM. The same code against
a real SLURM cluster: test_cluster.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from hybridtron.cli import main
from hybridtron.slurm import status as slurm_status
from hybridtron.slurm.submit import PLACEHOLDER, TEMPLATE, parse_time
from hybridtron.train.run_dir import LAST_STOP

GPU_JOB = ["--nodes", "4", "--gpus-per-node", "8", "--partition", "p", "--time", "24:00:00", "--account", "a",
           "--qos", "q", "--constraint", "h100", "--exclusive", "--sbatch-arg=--mem=0"]


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    """These tests run as if no SLURM were installed, even where test_cluster.py's cluster is up (its sinfo would
    refuse this file's made-up partitions)."""
    from hybridtron.slurm import cluster

    monkeypatch.setattr(cluster, "find_binary", lambda name: None)


def submit(argv, capsys):
    code = main(["submit", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dry_run_renders_a_complete_job_script_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    code, script, err = submit(["--config", "tiny", "--run-dir", str(run), *GPU_JOB, "--dry-run",
                                "--train.max_steps", "100"], capsys)
    assert code == 0, err
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=p",
                 "#SBATCH --time=24:00:00", "#SBATCH --account=a", "#SBATCH --qos=q", "#SBATCH --constraint=h100",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "#SBATCH --mem=0", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@300", f"#SBATCH --output={run}/logs/job-%j.out", "#SBATCH --open-mode=append",
                 "NPROC_PER_NODE=8", f"RUN_DIR={run}"):
        assert line in script.splitlines(), line
    assert "--rdzv-backend=c10d" in script and '--nnodes="$SLURM_JOB_NUM_NODES"' in script
    assert '--output="$LOG_DIR/job-%j.$2.node%n.log"' in script  # one log per node and training (see below)
    assert "MAX_RESTARTS=3 " in script  # --max-restarts' default
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script and f"$RUN_DIR/{LAST_STOP}" in script
    assert not PLACEHOLDER.search(script)  # every {{ name }} filled
    assert "--train.max_steps 100" in script  # the command that made it, in its header
    assert not run.exists()  # a dry run writes nothing
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_container_image_runs_torchrun_of_the_image(tmp_path, capsys):
    code, script, err = submit(["--run-dir", str(tmp_path / "r"), "--gpus-per-node", "8", "--container-image",
                                "nvcr.io/nvidia/pytorch:25.01-py3", "--container-mounts", "/lustre:/lustre",
                                "--dry-run"], capsys)
    assert code == 0, err
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in script
    assert "--container-mounts=/lustre:/lustre" in script and "TORCHRUN=torchrun" in script


def test_cpu_job_asks_for_no_gpus(tmp_path, capsys):
    code, script, err = submit(["--run-dir", str(tmp_path / "r"), "--nodes", "2", "--gpus-per-node", "0", "--dry-run"],
                               capsys)
    assert code == 0, err
    assert not [ln for ln in script.splitlines() if ln.startswith(("#SBATCH --gpus", "#SBATCH --gres"))]
    assert "NPROC_PER_NODE=1" in script


@pytest.mark.parametrize("argv, message", [
    (["--time", "00:01:00"], "--warning-seconds 300 is not shorter than --time 00:01:00 (60 s)"),
    (["--time", "tomorrow"], "--time 'tomorrow' is not a SLURM time limit; write HH:MM:SS"),
    (["--nodes", "0"], "--nodes 0 must be at least 1"),
    (["--gpus-per-node", "8", "--nproc-per-node", "4"], "each training process drives one GPU"),
    (["--nodes", "2", "--gpus-per-node", "0", "--parallel.dp", "4"],
     "--nodes 2 x 1 processes per node = 2 processes, but the layout parallel.dp=4"),
    (["--nodes", "2", "--gpus-per-node", "0", "--parallel.tp", "2"], "parallel.tp=2 spans more than one node"),
    (["--gpus-per-node", "0", "--parallel.backend", "nccl"], "parallel.backend=nccl needs GPUs"),
    (["--config", "no_such_preset"], "config 'no_such_preset' is neither a file nor a preset"),
    (["--model.n_heads", "3"], "model.n_heads"),
    (["--data.sources", "[{path: /no/such/corpus/*.jsonl}]"], "data source '/no/such/corpus/*.jsonl' matches no file"),
    (["--sbatch-arg", "mem=0"], "--sbatch-arg 'mem=0' is not an sbatch option"),
])
def test_bad_submissions_are_refused_before_anything_is_written(argv, message, tmp_path, capsys):
    run = tmp_path / "run"
    code, _out, err = submit(["--run-dir", str(run), "--dry-run", *argv], capsys)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    assert not run.exists()


def test_run_dir_with_a_space_is_refused(tmp_path, capsys):
    code, _out, err = submit(["--run-dir", str(tmp_path / "my run"), "--dry-run"], capsys)
    assert code == 2 and "holds a space or '%'" in err, err


def test_resubmitting_a_run_with_another_model_is_refused(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(small_data_dir, run, ["--train.max_steps", "1", "--train.warmup_steps", "0",
                                                      "--train.eval_every", "0"])) == 0
    capsys.readouterr()
    argv = [a for a in cli_args(small_data_dir, run, ["--model.n_layers", "3", "--dry-run"]) if a != "train"]
    code, _out, err = submit(argv, capsys)
    assert code == 2 and "holds a run with model.n_layers=2, but this config has model.n_layers=3" in err, err
    # the run's own settings pass (vocab_size derived from the tokenizer is not a difference)
    argv = [a for a in cli_args(small_data_dir, run, ["--dry-run"]) if a != "train"]
    code, _out, err = submit(argv, capsys)
    assert code == 0, err


def test_own_template(tmp_path, capsys):
    mine = tmp_path / "mine.sbatch"
    mine.write_text(TEMPLATE.read_text().replace("#SBATCH --requeue", "#SBATCH --requeue\n#SBATCH --mail-type=END"))
    code, script, err = submit(["--run-dir", str(tmp_path / "r"), "--template", str(mine), "--dry-run"], capsys)
    assert code == 0 and "#SBATCH --mail-type=END" in script, err
    mine.write_text("#!/bin/bash\n#SBATCH --nodes={{ nodes }}\necho {{ nodez }}\n")
    code, _script, err = submit(["--run-dir", str(tmp_path / "r"), "--template", str(mine), "--dry-run"], capsys)
    assert code == 2 and "uses {{ nodez }}, which hybridtron does not fill; the placeholders are:" in err, err
    assert "nodes" in err


def test_show_template_prints_the_shipped_template(capsys):
    assert main(["submit", "--show-template"]) == 0
    assert capsys.readouterr().out == TEMPLATE.read_text()


@pytest.mark.parametrize("text, seconds", [("90", 5400), ("30:15", 1815), ("24:00:00", 86400), ("2-00:00:00", 172800),
                                           ("1-12", 129600), ("1-0:30", 88200), ("UNLIMITED", None), ("0", None)])
def test_slurm_time_formats(text, seconds):
    assert parse_time(text) == seconds


def test_no_sbatch_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("hybridtron.slurm.cluster.find_binary", lambda name: None)
    code, _out, err = submit(["--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2 and "sbatch not found: submit from a SLURM login node" in err, err


def test_status_without_slurm_shows_the_run(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "jobs.jsonl").write_text(json.dumps({"job_id": "77", "script": "s"}) + "\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 9, "loss": 3.5}, {"step": 10, "loss": 3.25, "val_loss": 3.4}, {"step": 11, "loss": 3.125})) + '{"st')
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000010")
    (run / LAST_STOP).write_text(json.dumps({"stopped_by": "signal", "step": 10, "max_steps": 50}))
    (run / "config.yaml").write_text("train:\n  max_steps: 50\n")
    (run / "logs").mkdir()
    (run / "logs" / "job-77.out").write_text("")
    (run / "logs" / "job-5.out").write_text("")  # an older job's log
    monkeypatch.setattr(slurm_status, "_run", lambda cmd: None)  # no SLURM commands here
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "job 77" in out and "UNKNOWN (squeue is not available here)" in out, out
    assert "step 11 of 50, loss 3.1250, val_loss 3.4000 at step 10" in out, out
    assert f"{run}/checkpoints/step_00000010" in out and "step 10 (signal)" in out
    assert "job-77.out" in out and "job-5.out" not in out
    assert main(["status", str(run), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["step"] == 11 and s["jobs"][0]["state"] == "UNKNOWN"
    assert main(["status", str(tmp_path / "none")]) == 2
    assert "no run directory" in capsys.readouterr().err


def test_status_shows_every_submission_of_the_run(tmp_path, capsys, monkeypatch):
    """A job that failed, then a resubmission (a chain of two): all three jobs stay in the history."""
    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in (
        {"job_id": "70", "script": "a.sbatch", "submitted": "2026-11-24T10:00:00"},
        {"job_id": "81", "script": "b.sbatch", "submitted": "2026-11-24T12:00:00"},
        {"job_id": "82", "script": "b.sbatch", "submitted": "2026-11-24T12:00:00"})))
    (run / "logs").mkdir()
    for j in ("70", "81"):
        (run / "logs" / f"job-{j}.out").write_text("")
    states = {"70": "FAILED", "81": "COMPLETED", "82": "COMPLETED"}
    monkeypatch.setattr(slurm_status, "query_job", lambda job: {"state": states[job], "source": "sacct"})
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"job 70 +FAILED \(submission 1 of 2, 2026-11-24T10:00:00\)", out), out
    assert re.search(r"job 81 +COMPLETED \(submission 2 of 2", out) and re.search(r"job 82 +COMPLETED", out), out
    assert "job-70.out" in out and "job-81.out" in out


def test_status_shows_restarts_and_stragglers(tmp_path, capsys, monkeypatch):
    """The job script's restarts (restarts.jsonl: how many, the last one's reason) and the slow ranks that the last
    metrics record names; neither row where there are none."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 40, "loss": 3.0}) + "\n")
    monkeypatch.setattr(slurm_status, "_run", lambda cmd: None)
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"^(restarts|stragglers) ", out, re.M), out
    (run / "restarts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"time": "2026-11-24T10:00:00", "job_id": "70", "attempt": 0, "restart": 1, "max_restarts": 3, "exit_code": 1,
         "reason": "a process or node died", "from_step": 10, "last_step": 13, "checkpoint": "step_00000010"},
        {"time": "2026-11-24T11:00:00", "job_id": "70", "attempt": 0, "restart": 2, "max_restarts": 3, "exit_code": 1,
         "reason": "hang at step 34 in backward, late ranks: 1", "from_step": 30, "last_step": 34,
         "checkpoint": "step_00000030"})) + '{"time": "2026')  # a torn last line: the job was killed writing it
    def slow(rank, host, slower, busy, median, stall):
        return {"rank": rank, "host": host, "slower": slower, "busy_s": busy, "median_busy_s": median,
                "stall_s": stall, "data_s": 0.01, "compute_s": busy - 0.01, "wait_s": 0.0, "step_s": busy}
    window = {"median": {}, "slowest": {}}  # the split itself is the trainer's business; status reads the stragglers
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 36, "loss": 3.1, "rank_times": window, "stragglers": [slow(3, "gpu002", 0.9, 2.0, 1.0, 0.0)]},
        {"step": 38, "loss": 3.0, "rank_times": window, "stragglers": [
            slow(1, "gpu007", 0.382, 1.52, 1.1, 0.0), slow(5, "gpu009", 0.25, 1.5, 1.2, 0.3)]},
        {"step": 40, "loss": 2.9})))  # a log step that closed no window: the latest judgement still stands
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"restarts +2 after failures; last: job 70 restart 2 of 3 at 2026-11-24T11:00:00, hang at step 34 "
                     r"in backward, late ranks: 1 \(exit 1\), from step 30", out), out
    assert re.search(r"stragglers +over the window to step 38: rank 1 \(gpu007\) 38% slower: busy 1.520 s/step against "
                     r"a median of 1.100, not running 0.000; rank 5 \(gpu009\) 25% slower: busy 1.500 s/step against a "
                     r"median of 1.200, not running 0.300$", out, re.M), out
    assert main(["status", str(run), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [r["restart"] for r in s["restarts"]] == [1, 2] and s["stragglers"][0]["host"] == "gpu007"
    with open(run / "metrics.jsonl", "a") as f:  # a later window without a slow rank: it caught up
        f.write(json.dumps({"step": 42, "loss": 2.8, "rank_times": window}) + "\n")
    assert main(["status", str(run)]) == 0
    assert not re.search(r"^stragglers ", capsys.readouterr().out, re.M)
    assert main(["status", str(run), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [r["restart"] for r in s["restarts"]] == [1, 2] and s["stragglers"] == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_job_script_decides_requeue_from_the_stop_file(tmp_path, capsys):
    """The script's tail run by bash with srun and scontrol replaced by stubs: it requeues a run that a USR1
    stopped with progress, and nothing else (a finished run, a TERM stop, a crash, a stop without progress)."""
    code, script, err = submit(["--run-dir", str(tmp_path / "run"), "--gpus-per-node", "0", "--dry-run"], capsys)
    assert code == 0, err
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1" = requeue ] && echo "REQUEUED $2" && exit 0\n'
                                      '[ "$2" = hostnames ] && echo node1\n[ "$2" = node ] && echo NodeAddr=10.0.0.1\n'
                                      '[ "$2" = job ] && echo "JobId=42 JobState=COMPLETING Restarts=${RESTARTS:-0}"\n'
                                      'exit 0\n')
    # srun stands for the training step: it writes the stop file the trainer would, then sends a signal, or fails
    (bin_dir / "srun").write_text('#!/bin/bash\nmkdir -p "$RUN/checkpoints"\ntouch "$RUN/srun-ran"\n'
                                  '[ -n "$STOP" ] && echo "$STOP" > "$RUN/last_stop.json"\n'
                                  '[ -n "$STEP" ] && echo "step_0000000$STEP" > "$RUN/checkpoints/latest"\n'
                                  '[ -n "$SIG" ] && kill -"$SIG" "$PPID"\nsleep 0.3\nexit "${RC:-0}"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    path = tmp_path / "job.sbatch"
    path.write_text(script)

    def job(stop: dict | None, sig: str = "", rc: int = 0, step: int = 5, before: int | None = None, restarts=0):
        run = tmp_path / "run"
        shutil.rmtree(run, ignore_errors=True)
        if before is not None:
            (run / "checkpoints").mkdir(parents=True)
            (run / "checkpoints" / "latest").write_text(f"step_{before:08d}")
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1",
               "SLURM_JOB_NUM_NODES": "1", "RUN": str(run), "STOP": json.dumps(stop) if stop else "", "SIG": sig,
               "RC": str(rc), "STEP": str(step), "RESTARTS": str(restarts)}
        res = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
        return res.returncode, res.stdout + res.stderr

    signal_stop = {"stopped_by": "signal", "step": 5, "max_steps": 9, "checkpoint": "step_00000005"}
    code, out = job(signal_stop, sig="USR1")
    assert code == 0 and "REQUEUED 42" in out and "time-limit warning" in out, out
    code, out = job(signal_stop, sig="TERM")  # scancel: checkpoint, no requeue
    assert code == 0 and "REQUEUED" not in out and "stopped at step 5 (signal)" in out and "resume with: cd " in out, out
    code, out = job(signal_stop, sig="TERM", restarts=1)  # `scontrol requeue` (or a requeueing preemption)
    assert code == 0 and "SLURM requeued job 42, which resumes from that checkpoint by itself" in out, out
    assert "resume with:" not in out and "REQUEUED 42" not in out, out
    code, out = job({"stopped_by": "max_steps", "step": 9, "max_steps": 9, "checkpoint": "step_00000009"}, sig="USR1",
                    step=9)
    assert code == 0 and "REQUEUED" not in out and "training finished at step 9" in out, out
    code, out = job(None, rc=1)  # a process died: no stop file; trained again, it dies at the same place: no requeue
    assert code == 1 and "REQUEUED" not in out and "FAILED" in out and "latest complete checkpoint is" in out, out
    assert "restart 1 of 3" in out and "no progress between the two failures" in out, out
    code, out = job(signal_stop, sig="USR1", before=5)  # warned again before any progress: would loop
    assert code == 1 and "REQUEUED" not in out and "without progress" in out, out
    code, out = job(None, before=600)  # tiny's max_steps: a chained job after the run finished starts nothing
    assert code == 0 and "already finished (checkpoint at step 600 of 600)" in out, out
    assert not (tmp_path / "run" / "srun-ran").exists()


# srun standing for one training per call, by the call's item of $PLAN ("RC:CHECKPOINT:LAST_STEP[:hang|done]"):
# it leaves the checkpoint and the last metrics line such a training would, the hang watch's or the trainer's
# stop file, and exits with RC. Each call's arguments go to $RUN/srun-calls.
PLAN_SRUN = r"""#!/bin/bash
n=$(cat "$RUN/srun-count" 2>/dev/null || echo 0); echo $((n + 1)) > "$RUN/srun-count"
echo "$*" >> "$RUN/srun-calls"
IFS=: read -r rc ckpt step kind <<< "$(echo $PLAN | cut -d' ' -f$((n + 1)))"
mkdir -p "$RUN/checkpoints"
[ "$ckpt" != - ] && printf 'step_%08d\n' "$ckpt" > "$RUN/checkpoints/latest"
echo "{\"step\": $step, \"loss\": 2.5}" >> "$RUN/metrics.jsonl"
[ "$kind" = hang ] && echo "{\"stopped_by\": \"hang\", \"step\": $step, \"phase\": \"backward\", \"reported_by\": 0, \"late_ranks\": [1], \"late\": [\"host n2, not responding\"], \"checkpoint\": null, \"exit_code\": 6}" > "$RUN/last_stop.json"
[ "$kind" = done ] && echo "{\"stopped_by\": \"max_steps\", \"step\": $step, \"max_steps\": $step}" > "$RUN/last_stop.json"
[ "$kind" = term ] && kill -TERM "$PPID"
sleep 0.2
exit "$rc"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_job_script_restarts_a_failed_training_and_knows_when_to_stop(tmp_path, capsys):
    """The script run by bash with srun standing for the training (see PLAN_SRUN): a training that died or hung
    runs again from the latest checkpoint, recorded, until it finishes; not when there is no checkpoint, when it
    fails again without progress, past --max-restarts (counted over the job's attempts), after a signal, or with
    --max-restarts 0."""
    run = tmp_path / "run"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$2" = hostnames ] && echo node1\n'
                                      '[ "$2" = node ] && echo NodeAddr=10.0.0.1\n'
                                      '[ "$2" = job ] && echo "JobId=42 JobState=COMPLETING Restarts=0"\nexit 0\n')
    (bin_dir / "srun").write_text(PLAN_SRUN)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    scripts = {}
    for bound in (3, 2, 0):
        code, script, err = submit(["--run-dir", str(run), "--gpus-per-node", "0", "--max-restarts", str(bound),
                                    "--dry-run"], capsys)
        assert code == 0, err
        assert re.search(rf"^MAX_RESTARTS={bound} ", script, re.M), script
        assert ("--max-restarts 2" in script) == (bound == 2)  # the resubmit command keeps a bound not the default
        scripts[bound] = tmp_path / f"job{bound}.sbatch"
        # torchrun's own rendezvous store (as in a container job): the script's store would start a Python with torch
        # for each of the jobs below, seconds each, for a store that no training here uses
        scripts[bound].write_text(re.sub(r"^TORCHRUN=.*$", "TORCHRUN=torchrun", script, flags=re.M))

    def job(plan: str, bound: int = 3, attempt: int = 0, restarts: list[dict] = ()) -> tuple[int, list[str]]:
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        if restarts:
            (run / "restarts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in restarts))
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1",
               "SLURM_JOB_NUM_NODES": "1", "SLURM_RESTART_COUNT": str(attempt), "RUN": str(run), "PLAN": plan}
        res = subprocess.run(["bash", str(scripts[bound])], env=env, capture_output=True, text=True, timeout=60)
        lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("[hybridtron job 42]")]
        return res.returncode, lines

    def calls() -> list[str]:
        return (run / "srun-calls").read_text().splitlines()

    # a process killed after checkpoint 10 (last logged step 13), then a hang after checkpoint 20: two restarts
    code, lines = job("1:10:13 1:20:24:hang 0:30:30:done")
    assert code == 0 and "training finished at step 30" in lines[-1], lines
    restarts = slurm_status.read_restarts(run)
    assert [(r["job_id"], r["attempt"], r["restart"], r["max_restarts"], r["exit_code"], r["from_step"],
             r["last_step"], r["checkpoint"]) for r in restarts] == [
        ("42", 0, 1, 3, 1, 10, 13, "step_00000010"), ("42", 0, 2, 3, 1, 20, 24, "step_00000020")], restarts
    assert restarts[0]["reason"] == "a process or node died" and "time" in restarts[0]
    assert restarts[1]["reason"] == "hang at step 24 in backward, late ranks: 1", restarts[1]
    assert restarts[1]["hang"]["late"] == ["host n2, not responding"]  # the watch's whole stop file
    said = [ln for ln in lines if "restart " in ln]
    assert len(said) == 2 and "restart 1 of 3: training ended without stopping cleanly (srun exit 1): a process or " \
        "node died (node logs" in said[0] and "job-42.0.node*.log); training again from checkpoint step 10 (" in \
        said[0] and "last logged step 13" in said[0], said
    assert "restart 2 of 3" in said[1] and "(srun exit 1; hang at step 24 in backward, late ranks: 1): the hang " \
        "watch stopped every process (node logs" in said[1], said
    assert "job-42.0.r2.node*.log" in said[1], said
    # each training is a step of its own: a fresh rendezvous id, its own node logs
    assert [re.search(r"--rdzv-id=(\S+)", c).group(1) for c in calls()] == ["42", "42.r1", "42.r2"]
    assert [re.search(r"job-%j\.(\S+)\.node%n\.log", c).group(1) for c in calls()] == ["0", "0.r1", "0.r2"]

    # a failure before the first checkpoint: a config or data problem, not restarted
    code, lines = job("1:-:3")
    assert code == 1 and "FAILED: training ended without stopping cleanly (srun exit 1)" in lines[-1], lines
    assert "not restarting: there is no checkpoint yet" in lines[-1] and "resume from it with: cd " in lines[-1]
    assert len(calls()) == 1 and not (run / "restarts.jsonl").exists()

    # the same checkpoint and the same last logged step as the failure before: no progress, one restart only
    code, lines = job("1:10:13 1:10:13 0:30:30:done")
    assert code == 1 and len(calls()) == 2 and len(slurm_status.read_restarts(run)) == 1, lines
    assert "failed again where it failed before restart 1 (checkpoint step 10, last logged step 13): no progress" \
        in lines[-1] and lines[-1].count("FAILED") == 1, lines
    # a later last step from the same checkpoint is progress (it got further before failing again)
    code, lines = job("1:10:13 1:10:17 0:30:30:done")
    assert code == 0 and len(calls()) == 3, lines

    # the bound, with progress every time
    code, lines = job("1:10:13 1:20:23 1:30:33 0:40:40:done", bound=2)
    assert code == 1 and len(calls()) == 3, lines
    assert "not restarting: job 42 was restarted 2 times already, the bound (--max-restarts 2)" in lines[-1], lines
    assert "job-42.0.r2.node*.log say which and why" in lines[-1]
    # counted over the job's attempts: after a requeue the bound holds with the restarts made before it (another
    # job's restarts do not count)
    before = [{"job_id": "42", "attempt": 0, "restart": k, "from_step": 5 * k, "last_step": 5 * k + 2}
              for k in (1, 2)]
    code, lines = job("1:20:23", bound=2, attempt=1, restarts=[{"job_id": "41", "restart": 1}, *before])
    assert code == 1 and "restarted 2 times already" in lines[-1], lines
    code, lines = job("1:20:23 0:30:30:done", bound=3, attempt=1, restarts=before)
    assert code == 0 and "restart 3 of 3" in "\n".join(lines), lines
    assert "attempt 1 follows one that ended without a clean stop: SLURM requeued the job" in lines[0], lines

    # told to stop (scancel) and then dead: SLURM ends the job, no restart
    code, lines = job("1:10:13:term 0:30:30:done")
    assert code == 1 and len(calls()) == 1 and "not restarting: the job was sent SIGTERM while it trained" \
        in lines[-1], lines
    # --max-restarts 0: today's behaviour
    code, lines = job("1:10:13 0:30:30:done", bound=0)
    assert code == 1 and len(calls()) == 1 and "not restarting: restarts are off (--max-restarts 0)" in lines[-1]
    assert "The latest complete checkpoint is " in lines[-1] and "step_00000010;" in lines[-1]


def test_a_deepspeed_json_the_trainer_would_refuse_is_refused_at_submission(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text('{"scheduler": {"type": "WarmupLR"}}')
    run = tmp_path / "run"
    code, _out, err = submit(["--run-dir", str(run), "--dry-run", "--gpus-per-node", "0", "--parallel.engine",
                              "deepspeed", "--parallel.deepspeed_config", str(ds)], capsys)
    assert code == 2 and 'sets "scheduler"' in err and "train.schedule" in err, err
    assert not run.exists()


def test_a_skipped_partition_check_is_said(tmp_path, capsys, monkeypatch):
    """Without SLURM's sinfo the partition and node count cannot be checked: the dry run says so on stderr (stdout
    stays the script alone)."""
    from hybridtron.slurm import cluster

    monkeypatch.setattr(cluster, "find_binary", lambda name: None)
    code, script, err = submit(["--run-dir", str(tmp_path / "r"), "--nodes", "2", "--partition", "gpu", "--dry-run"],
                               capsys)
    assert code == 0 and script.startswith("#!/bin/bash"), err
    assert "sinfo is not installed here, so --partition 'gpu' and --nodes 2 were not checked" in err, err


def test_a_run_dir_that_is_a_file_is_refused_before_submitting(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    code, _out, err = submit(["--run-dir", str(taken), "--dry-run"], capsys)
    assert code == 2 and "is a file, not a directory" in err, err
    code, _out, err = submit(["--run-dir", str(taken / "run"), "--dry-run"], capsys)
    assert code == 2 and "cannot be created" in err, err
    assert taken.read_text() == "not a directory"
