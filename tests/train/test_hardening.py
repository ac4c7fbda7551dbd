"""Bad state on disk gets a one-line answer naming the file and what to do, never a silent resume and never a
traceback (unless --debug / HYBRIDTRON_DEBUG=1): checksummed checkpoints, torn or missing files, damaged
configs, foreign tokenizers and data settings, full disks, torn and duplicated metrics, stale pointers."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil

import pytest

from hybridtron.cli import main
from hybridtron.train import checkpoint as ck
from hybridtron.train.metrics import read_metrics

FAST = ["--train.max_steps", "4", "--checkpoint.every", "2", "--train.eval_every", "0", "--train.warmup_steps", "1",
        "--train.eval_batches", "1"]
STEP2, STEP4 = "step_00000002", "step_00000004"


def steps_arg(n: int) -> list[str]:
    return ["--train.max_steps", str(n), *FAST[2:]]


@pytest.fixture(scope="module")
def trained_run(small_data_dir, small_argv, tmp_path_factory):
    """4 steps, checkpoints at 2 and 4 (latest = 4); every test works on a copy."""
    run = tmp_path_factory.mktemp("hard") / "run"
    assert main(small_argv(small_data_dir, run, FAST)) == 0
    return run


@pytest.fixture
def run_copy(trained_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(trained_run, dst)
    return dst


def run_cli(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err


def assert_one_line_error(code, err, *needles, exit_code=2):
    """Exit code, exactly one line on stderr (the error), no traceback, and the line names what it must."""
    assert code == exit_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("hybridtron "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---- checksums -----------------------------------------------------------------------------------
def test_checkpoint_manifest_lists_every_file_with_its_sha256(trained_run):
    ckpt = trained_run / "checkpoints" / STEP4
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = {p.relative_to(ckpt).as_posix(): p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert sorted(files) == sorted(on_disk)
    assert {"model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json", "config.yaml"} <= set(files)
    assert any(f.startswith("tokenizer/") for f in files)
    for rel, p in on_disk.items():
        assert files[rel] == {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}


def test_same_size_overwrite_is_refused_by_train_eval_and_sample(run_copy, small_data_dir, cli_args, capsys):
    f = run_copy / "checkpoints" / STEP4 / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])  # other values, same size (the last bytes are tensor data)
    f.write_bytes(bytes(data))
    code, err = run_cli(cli_args(small_data_dir, run_copy, steps_arg(6)), capsys)
    # Refused with the way out (delete it: the run resumes from the checkpoint before it), no silent fallback.
    assert_one_line_error(code, err, f"{STEP4}: model.safetensors does not match its checksum", f"delete {run_copy}",
                          f"resume from {STEP2}")
    assert not (run_copy / "checkpoints" / "step_00000006").exists()
    assert (run_copy / "checkpoints" / "latest").read_text() == STEP4
    for cmd in (["eval"], ["sample", "--max-new-tokens", "2"]):
        code, err = run_cli([*cmd, "--run-dir", str(run_copy)], capsys)
        assert_one_line_error(code, err, "model.safetensors does not match its checksum")
    # The intact older checkpoint still serves.
    code, err = run_cli(["sample", "--run-dir", str(run_copy), "--checkpoint", str(run_copy / "checkpoints" / STEP2),
                         "--max-new-tokens", "2"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("name, damage, needle", [
    ("model.safetensors", "truncate", "model.safetensors has"),
    ("optimizer.pt", "truncate", "optimizer.pt has"),
    ("rng.pt", "delete", "rng.pt is missing (the manifest lists it)"),
    ("trainer_state.json", "garbage", "trainer_state.json"),
    ("config.yaml", "garbage", "config.yaml"),
])
def test_damaged_checkpoint_files_are_named(name, damage, needle, run_copy, small_data_dir, cli_args, capsys):
    ckpt = run_copy / "checkpoints" / STEP4
    f = ckpt / name
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "delete":
        f.unlink()
    else:
        f.write_bytes(b"\x00\xffnot json, not yaml: {[")
    code, err = run_cli(cli_args(small_data_dir, run_copy, steps_arg(6)), capsys)
    assert_one_line_error(code, err, needle, str(ckpt))
    if name == "config.yaml":
        return  # the checkpoint's copy of the config is only read by eval/sample/export
    # Without the manifest (a checkpoint of an older version) the load itself still ends in one line naming the
    # file (besides, at most, a warning that the files cannot be verified).
    (ckpt / "manifest.json").unlink()
    code, err = run_cli(cli_args(small_data_dir, run_copy, steps_arg(6)), capsys)
    errors = [ln for ln in err.strip().splitlines() if not ln.startswith("[hybridtron] warning:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert name in errors[0] and str(ckpt) in errors[0], errors[0]


def test_debug_flag_and_env_show_the_traceback_and_bugs_always_do(run_copy, small_data_dir, cli_args, capsys,
                                                                  monkeypatch):
    (run_copy / "checkpoints" / STEP4 / "rng.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="rng.pt is missing"):
        main(cli_args(small_data_dir, run_copy, [*FAST, "--debug"]))
    monkeypatch.setenv("HYBRIDTRON_DEBUG", "1")
    with pytest.raises(ck.CheckpointError, match="rng.pt is missing"):
        main(cli_args(small_data_dir, run_copy, FAST))
    monkeypatch.delenv("HYBRIDTRON_DEBUG")
    with pytest.raises(ck.CheckpointError):
        main(["eval", "--debug", "--run-dir", str(run_copy), "--checkpoint", str(run_copy / "nothing")])

    # An exception that is none of the documented kinds is a bug: it keeps its traceback.
    def bug(*_a, **_k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("hybridtron.train.recipe.train_run", bug)  # cmd_train imports it when it runs
    with pytest.raises(ZeroDivisionError):
        main(cli_args(small_data_dir, run_copy, FAST))


# ---- configs -------------------------------------------------------------------------------------
def test_garbage_run_config_and_invalid_yaml_config(run_copy, small_data_dir, cli_args, capsys, tmp_path):
    (run_copy / "config.yaml").write_bytes(bytes(range(256)) * 4)
    code, err = run_cli(["train", "--run-dir", str(run_copy)], capsys)  # resuming: the saved config is read
    assert_one_line_error(code, err, f"{run_copy / 'config.yaml'} is unreadable",
                          str(run_copy / "checkpoints" / STEP4 / "config.yaml"))
    code, err = run_cli(cli_args(small_data_dir, run_copy, FAST), capsys)  # with --config: compared against it
    assert_one_line_error(code, err, f"{run_copy / 'config.yaml'} is unreadable")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {d_model: [unclosed\n")
    code, err = run_cli(["train", "--config", str(bad), "--run-dir", str(tmp_path / "x")], capsys)
    assert_one_line_error(code, err, "bad.yaml is not valid YAML")


@pytest.mark.parametrize("override, was, now", [
    (["--data.seq_len", "32"], "data.seq_len=64", "data.seq_len=32"),
    (["--data.sources", "[{path: stdlib, max_files: 30}]"], "data.sources[0].max_files=40",
     "data.sources[0].max_files=30"),
    (["--data.tokenizer.vocab_size", "300"], "data.tokenizer.vocab_size=512", "data.tokenizer.vocab_size=300"),
    (["--data.val_fraction", "0.2"], "data.val_fraction=0.1", "data.val_fraction=0.2"),
])
def test_resume_with_other_data_settings_is_refused(override, was, now, run_copy, small_data_dir, cli_args, capsys):
    before = sorted(p.relative_to(small_data_dir) for p in small_data_dir.rglob("*"))
    code, err = run_cli(cli_args(small_data_dir, run_copy, [*steps_arg(6), *override]), capsys)
    assert_one_line_error(code, err, was, now, str(run_copy))
    # Refused before prepare touched the data directory for the other settings.
    assert sorted(p.relative_to(small_data_dir) for p in small_data_dir.rglob("*")) == before


@pytest.mark.slow
def test_resume_on_data_of_another_tokenizer_of_the_same_size_is_refused(run_copy, small_data_dir, cli_args,
                                                                          capsys, tmp_path):
    # Another data.out_dir with the same sources and tokenizer settings but a tokenizer trained on less text:
    # the same vocabulary size, other merges, so other tokens for the same text.
    other = tmp_path / "other_data"
    argv = cli_args(small_data_dir, tmp_path / "unused", ["--data.out_dir", str(other),
                                                          "--data.tokenizer.sample_mb", "0.03"])
    assert main(["prepare", *argv[1:]]) == 0
    own = json.loads((small_data_dir / "tokenizer" / "tokenizer_meta.json").read_text())
    theirs = json.loads((other / "tokenizer" / "tokenizer_meta.json").read_text())
    assert own["vocab_size"] == theirs["vocab_size"] and own["fingerprint"] != theirs["fingerprint"]
    capsys.readouterr()
    # prepare itself refuses a tokenizer whose recipe differs ...
    code, err = run_cli(cli_args(small_data_dir, run_copy, [*steps_arg(6), "--data.out_dir", str(other)]), capsys)
    assert_one_line_error(code, err, "sample_mb 0.03", "sample_mb 20.0", str(other))
    # ... but data prepared by an older version recorded only the kind and size: the checkpoint's tokenizer decides
    meta_f = other / "tokenizer" / "tokenizer_meta.json"
    meta_f.write_text(json.dumps({**theirs, "config": {"kind": "bpe", "vocab_size": theirs["vocab_size"], "path": None}}))
    code, err = run_cli(cli_args(small_data_dir, run_copy, [*steps_arg(6), "--data.out_dir", str(other)]), capsys)
    assert_one_line_error(code, err, f"tokenizer {own['fingerprint'][:12]}", f"tokenizer {theirs['fingerprint'][:12]}",
                          str(other))
    assert not (run_copy / "checkpoints" / "step_00000006").exists()
    # The data directory the run was prepared with (copied elsewhere: out_dir alone is no reason to refuse) resumes.
    moved = tmp_path / "moved_data"
    shutil.copytree(small_data_dir, moved)
    code, err = run_cli(cli_args(small_data_dir, run_copy, ["--data.out_dir", str(moved), *steps_arg(5)]), capsys)
    assert code == 0, err


# ---- full disk -----------------------------------------------------------------------------------
def _torch_zip_failure(real):
    def save(obj, f, *a, **k):
        if str(f).endswith("optimizer.pt"):  # what torch.save says when its zip writer hits ENOSPC
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 662")
        return real(obj, f, *a, **k)

    return save


def _safetensors_failure(*_a, **_k):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _copytree_failure(src, dst, *a, **k):
    raise shutil.Error([(str(src), str(dst), f"[Errno 28] No space left on device: '{src}' -> '{dst}'")])


@pytest.mark.parametrize("writer, file", [("torch", "optimizer.pt"), ("safetensors", "model.safetensors"),
                                          ("copytree", "tokenizer")])
def test_full_disk_during_save_keeps_the_previous_checkpoint(writer, file, run_copy, small_data_dir, cli_args, capsys,
                                                             monkeypatch):
    if writer == "torch":
        monkeypatch.setattr(ck.torch, "save", _torch_zip_failure(ck.torch.save))
        monkeypatch.setattr(ck, "_free_bytes", lambda _p: 4096)  # the file system is full
    elif writer == "safetensors":
        monkeypatch.setattr(ck, "save_model", _safetensors_failure)
    else:
        monkeypatch.setattr(ck.shutil, "copytree", _copytree_failure)
    code, err = run_cli(cli_args(small_data_dir, run_copy, steps_arg(5)), capsys)
    line = assert_one_line_error(code, err, "no space left on device", f"writing {file}", "step_00000005",
                                 str(run_copy / "checkpoints"), f"still names {STEP4}", exit_code=4)
    assert "inline_container" not in line and "Errno" not in line
    mgr = ck.CheckpointManager(run_copy)
    assert mgr.latest().name == STEP4 and (mgr.dir / "latest").read_text() == STEP4
    assert sorted(p.name for p in mgr.dir.iterdir()) == sorted([STEP2, STEP4, "latest"])  # nothing partial left
    if writer == "torch":
        monkeypatch.undo()
        code, err = run_cli(cli_args(small_data_dir, run_copy, steps_arg(5)), capsys)  # space freed: resumes
        assert code == 0, err
        assert [r["step"] for r in read_metrics(run_copy)] == [1, 2, 3, 4, 5]


def test_torch_write_failure_with_free_space_is_not_called_a_full_disk(run_copy, small_data_dir, cli_args,
                                                                       monkeypatch):
    monkeypatch.setattr(ck.torch, "save", _torch_zip_failure(ck.torch.save))  # the disk has room: unexplained
    with pytest.raises(RuntimeError, match="inline_container"):
        main(cli_args(small_data_dir, run_copy, steps_arg(5)))
    mgr = ck.CheckpointManager(run_copy)
    assert mgr.latest().name == STEP4 and not [p for p in mgr.dir.iterdir() if ".tmp-" in p.name]


def test_full_disk_elsewhere_names_the_file(run_copy, small_data_dir, cli_args, capsys, monkeypatch):
    def full(path, _text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("hybridtron.train.metrics.write_text_atomic", full)
    code, err = run_cli(cli_args(small_data_dir, run_copy, steps_arg(5)), capsys)
    assert_one_line_error(code, err, "no space left on device", str(run_copy / "metrics.jsonl"), exit_code=4)


# ---- metrics -------------------------------------------------------------------------------------
def test_run_killed_before_first_checkpoint_with_a_torn_line_leaves_no_duplicates(small_data_dir, cli_args, tmp_path,
                                                                                   capsys):
    run = tmp_path / "run"
    run.mkdir()
    old = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3))
    (run / "metrics.jsonl").write_text(old + '{"step": 4, "loss": 9.')  # killed mid-write, no checkpoint yet
    code, err = run_cli(cli_args(small_data_dir, run, FAST), capsys)
    assert code == 0, err
    assert "dropped 1 unreadable line" in err and str(run / "metrics.jsonl") in err
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and all(r["loss"] != 9.0 for r in recs)


def test_torn_metrics_line_does_not_block_a_resume(run_copy, small_data_dir, cli_args, capsys):
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 3.1')
    assert [r["step"] for r in read_metrics(run_copy)] == [1, 2, 3, 4]  # a reader skips the torn tail too
    code, err = run_cli(cli_args(small_data_dir, run_copy, steps_arg(5)), capsys)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(run_copy)] == [1, 2, 3, 4, 5]


# ---- what goes into a checkpoint, and which one is resumed --------------------------------------
def test_tokenizer_temp_files_stay_out_of_checkpoints(run_copy, small_data_dir, cli_args, capsys, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(small_data_dir, data)
    junk = [".tokenizer.json.tmp-4242", ".tokenizer_meta.json.tmp-4242", ".tokenizer.json.tmp-other-node-4242",
            "tokenizer.json.tmp", ".DS_Store"]
    for name in junk:
        (data / "tokenizer" / name).write_text("half a tokenizer")
    code, err = run_cli(cli_args(data, run_copy, steps_arg(5)), capsys)
    assert code == 0, err
    ckpt = run_copy / "checkpoints" / "step_00000005"
    copied = sorted(p.name for p in (ckpt / "tokenizer").iterdir())
    assert copied == sorted(p.name for p in (data / "tokenizer").iterdir() if p.name not in junk)
    assert "tokenizer_meta.json" in copied
    assert not [f for f in json.loads((ckpt / "manifest.json").read_text())["files"] if "tmp" in f]


def test_a_resume_removes_the_save_a_killed_run_left_and_says_so(run_copy, small_data_dir, cli_args, capsys, dead_pid):
    from hybridtron.atomic import this_host

    ckpts = run_copy / "checkpoints"
    killed = ckpts / f".step_00000006.tmp-{this_host()}-{dead_pid}"  # a save killed midway
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    code = main(cli_args(small_data_dir, run_copy, steps_arg(5)))
    out_err = capsys.readouterr()
    assert code == 0, out_err.err
    said = [ln for ln in out_err.out.splitlines() if "scratch" in ln]
    assert said == [f"[hybridtron] removed 1 scratch entry of interrupted writes in {ckpts}: {killed.name}"]
    assert not killed.exists() and ck.CheckpointManager(run_copy).latest().name == "step_00000005"


def test_latest_naming_a_missing_checkpoint_says_which_one_is_used(run_copy, small_data_dir, cli_args, capsys):
    (run_copy / "checkpoints" / "latest").write_text("step_00000099")
    code, out_err = main(cli_args(small_data_dir, run_copy, steps_arg(5))), capsys.readouterr()
    assert code == 0, out_err.err
    warnings = [ln for ln in out_err.err.splitlines() if "step_00000099" in ln]
    assert len(warnings) == 1 and STEP4 in warnings[0], out_err.err  # said once, naming both
    assert f"resumed from {run_copy / 'checkpoints' / STEP4}" in out_err.out
    assert (run_copy / "checkpoints" / "latest").read_text() == "step_00000005"


def test_processes_share_the_hashing_and_one_of_them_finds_a_damaged_file(run_copy):
    """Resuming under n processes, each hashes one share of the checkpoint's bytes: every file in exactly one
    share, so a damaged file is found by exactly one process (and the job stops on all; trainer.py)."""
    ckpt = run_copy / "checkpoints" / STEP4
    for i in range(3):
        ck.verify_manifest(ckpt, share=(i, 3))
    f = ckpt / "optimizer.pt"
    data = bytearray(f.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    f.write_bytes(bytes(data))
    found = []
    for i in range(3):
        try:
            ck.verify_manifest(ckpt, share=(i, 3))
        except ck.CheckpointError as e:
            found.append((i, str(e)))
    assert len(found) == 1 and "optimizer.pt does not match its checksum" in found[0][1], found
