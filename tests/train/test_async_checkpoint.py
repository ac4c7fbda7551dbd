"""checkpoint.async: the state is staged in host memory at the save and written in the background while training
goes on. The files are a synchronous save's; ``latest`` moves only once the write is complete and checksummed, so
kill -9 during the write leaves the previous checkpoint; a stop waits for the write; a failed write stops the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hybridtron.cli import main
from hybridtron.configs import ConfigError, load_config
from hybridtron.train import checkpoint as ck
from hybridtron.train.checkpoint import TEST_WRITE_DELAY, CheckpointManager, verify_manifest
from hybridtron.train.metrics import read_metrics
from hybridtron.train.parallel.layout import Layout

from .test_data_parallel import _kill_job, _workers, assert_same_steps, steps

FLAT = ["--train.schedule", "constant", "--train.eval_every", "0", "--train.micro_batch_size", "4",
        "--train.warmup_steps", "0", "--checkpoint.every", "2"]
ASYNC = ["--checkpoint.async", "true"]
STEP2, STEP4 = "step_00000002", "step_00000004"


# ---- the setting -------------------------------------------------------------------------------------------------
def test_the_async_key_is_read_from_yaml_and_the_command_line_and_written_back(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("checkpoint:\n  async: true\n  every: 5\n")
    cfg = load_config(str(f))
    assert cfg.checkpoint.async_save is True and cfg.checkpoint.every == 5
    assert load_config("tiny").checkpoint.async_save is False
    assert load_config("tiny", [("checkpoint.async", "true")]).checkpoint.async_save is True
    assert "  async: true\n" in cfg.to_yaml()  # config.yaml of a checkpoint says it as the user wrote it
    f.write_text(cfg.to_yaml())
    assert load_config(str(f)).checkpoint.async_save is True
    with pytest.raises(ConfigError, match=r"'async_save' is not in checkpoint; .*allowed: .*'async'"):
        load_config("tiny", [("checkpoint.async_save", "true")])
    with pytest.raises(ConfigError, match="checkpoint.async: expected true/false"):
        load_config("tiny", [("checkpoint.async", "soon")])


@pytest.mark.parametrize("overrides, needle", [
    ([("parallel.engine", "deepspeed")], "checkpoint.async=true works with parallel.engine=torch only"),
    ([("parallel.pp", "2"), ("train.grad_accum_steps", "2")], "checkpoint.async=true is not yet tested with parallel.pp=2"),
])
def test_async_saves_are_refused_where_they_do_not_work(overrides, needle):
    cfg = load_config("tiny", [("checkpoint.async", "true"), *overrides])
    with pytest.raises(ConfigError, match=needle):
        Layout.from_config(cfg, 2, "cpu")
    cfg.checkpoint.async_save = False
    Layout.from_config(cfg, 2, "cpu")  # the same layout saving synchronously is fine


def test_a_staged_state_dict_is_written_as_save_model_writes_the_model(tmp_path):
    from safetensors.torch import save_model
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied: safetensors keeps one copy and names the other in its metadata
    save_model(model, str(tmp_path / "a.safetensors"))
    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged = stager.stage(model.state_dict())
    with torch.no_grad():
        model[0].weight.add_(1)  # training goes on: the staged copy keeps the values of the save
    ck._save_model_state(staged, tmp_path / "b.safetensors")
    stager.close()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_background_saves_go_on_with_a_stager_that_empties_itself_after_each_stage(tmp_path, monkeypatch):
    """torch 2.11's DefaultStager closes its inner stager after every stage (the copy table emptied, so the next
    stage raises KeyError: <class 'type'>); three background saves in a row must still write."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from hybridtron.train.checkpoint import TrainerState

    plain = DefaultStager._stage

    def like_torch_2_11(self, state_dict, **kwargs):
        out = plain(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return out

    monkeypatch.setattr(DefaultStager, "_stage", like_torch_2_11)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    ckpt = CheckpointManager(tmp_path / "run", keep_last=3)
    state = TrainerState()
    for _ in range(3):
        state.step += 1
        ckpt.save(state, model, opt, "model: {}\n", tok, background=True)
        ckpt.wait()
    assert sorted(p.name for p in ckpt.dir.glob("step_*")) == [f"step_0000000{i}" for i in (1, 2, 3)]
    for i in (1, 2, 3):
        verify_manifest(ckpt.dir / f"step_0000000{i}")


# ---- one process, in this process --------------------------------------------------------------------------------
@pytest.mark.slow
def test_async_and_sync_runs_write_the_same_checkpoints(small_data_dir, cli_args, tmp_path):
    runs = {}
    for mode in ("false", "true"):
        runs[mode] = tmp_path / mode
        assert main(cli_args(small_data_dir, runs[mode], [*FLAT, "--train.max_steps", "4",
                                                          "--checkpoint.async", mode])) == 0
    for name in (STEP2, STEP4):
        for f in ("model.safetensors", "optimizer.pt", "rng.pt"):
            a, b = (runs[m] / "checkpoints" / name / f for m in ("false", "true"))
            assert a.read_bytes() == b.read_bytes(), (name, f)
        verify_manifest(runs["true"] / "checkpoints" / name)
    assert (runs["true"] / "checkpoints" / "latest").read_text() == STEP4
    assert steps(runs["true"]) == steps(runs["false"])


@pytest.mark.slow
def test_a_failed_background_write_stops_the_run_and_keeps_the_previous_checkpoint(small_data_dir, cli_args,
                                                                                   tmp_path, capsys, monkeypatch):
    real = ck.save_file

    def full_at_step_4(tensors, path, metadata=None):
        if STEP4 in str(path):
            raise OSError(28, "No space left on device")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(ck, "save_file", full_at_step_4)
    run = tmp_path / "run"
    code = main(cli_args(small_data_dir, run, [*FLAT, *ASYNC, "--train.max_steps", "40"]))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 4 and len(lines) == 1 and "Traceback" not in err, err
    for needle in ("no space left on device writing model.safetensors", STEP4, f"still names {STEP2}"):
        assert needle in lines[0], lines[0]
    mgr = CheckpointManager(run)
    assert (mgr.dir / "latest").read_text() == STEP2
    assert sorted(p.name for p in mgr.dir.iterdir()) == ["latest", STEP2]  # the partial checkpoint was removed
    assert read_metrics(run)[-1]["step"] < 40  # the run stopped at the failure, not at its end


# ---- kill -9 and SIGTERM while a write is in the background (real processes) -------------------------------------
def _command(nproc: int, argv: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "hybridtron.cli", *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
            "hybridtron.cli", *argv]


def _env(delay: float) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", TEST_WRITE_DELAY: str(delay)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _wait_for_step(job: subprocess.Popen, run, step: int, log) -> None:
    deadline = time.time() + 180
    while not (run / "metrics.jsonl").is_file() or not [r for r in read_metrics(run) if r["step"] >= step]:
        assert time.time() < deadline and job.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_kill_9_during_a_background_write_resumes_from_the_previous_checkpoint(nproc, small_data_dir, small_argv,
                                                                               tmp_path):
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    extra = ["--train.grad_accum_steps", "2"] if nproc == 1 else []  # a process alone takes what two ranks take
    first = subprocess.run(_command(nproc, small_argv(small_data_dir, run, [*FLAT, *extra, "--train.max_steps", "2"])),
                           env=_env(0), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # Step 4's save is written in the background and held (the test hook) before it is finished: the job is killed
    # while training has gone on past it, its shards on disk, its manifest and rename not done.
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(_command(nproc, small_argv(small_data_dir, run, [*FLAT, *extra, *ASYNC,
                                                                                "--train.max_steps", "100000"])),
                               env=_env(600), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    workers: dict[int, int] = {}
    try:
        _wait_for_step(job, run, 5, log)
        assert (ckpts / "latest").read_text() == STEP2  # step 4 is still being written, and training went on
        partial = [p.name for p in ckpts.iterdir() if p.name.startswith(".") and STEP4 in p.name]
        assert partial, sorted(os.listdir(ckpts))
        workers = _workers(job.pid)
        _kill_job(job, workers.values())
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            _kill_job(job, {*workers.values(), *_workers(job.pid).values()})
            job.wait()
    assert (ckpts / "latest").read_text() == STEP2
    verify_manifest(ckpts / STEP2)
    assert not (ckpts / STEP4).exists() and (ckpts / partial[0]).exists()
    res = subprocess.run(_command(nproc, small_argv(small_data_dir, run, [*FLAT, *extra, *ASYNC,
                                                                          "--train.max_steps", "6"])),
                         env=_env(0), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed from {ckpts / STEP2} (step 2)" in res.stdout
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]  # the partial checkpoint was removed
    assert (ckpts / "latest").read_text() == "step_00000006"
    ref = tmp_path / "ref"
    assert main(small_argv(small_data_dir, ref, [*FLAT, "--train.grad_accum_steps", "2", "--train.max_steps", "6"])) == 0
    assert_same_steps(steps(run), steps(ref))  # steps 1-2, then 3-6 resumed, as one uninterrupted process


@pytest.mark.slow
def test_sigterm_during_a_background_write_waits_for_it_and_saves_at_the_stop(small_data_dir, small_argv, tmp_path):
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(_command(1, small_argv(small_data_dir, run, [*FLAT, *ASYNC, "--train.max_steps",
                                                                           "100000"])),
                               env=_env(5), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_step(job, run, 3, log)
        assert not (ckpts / "latest").exists()  # step 2's checkpoint is still being written
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    stop = ckpts / (ckpts / "latest").read_text()
    assert stop.name > STEP2, stop
    for name in (STEP2, stop.name):  # both complete: the pending write was waited for, then the stop's save
        verify_manifest(ckpts / name)
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]
    assert "received signal SIGTERM" in log.read_text()
