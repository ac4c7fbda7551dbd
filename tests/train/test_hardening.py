"""Bad state on disk gets a one-line answer naming the file and what to do, never a silent resume:
checksummed checkpoints, torn or missing files, foreign tokenizers and data, full disks, torn metrics."""

from __future__ import annotations

import errno
import json
import shutil

import pytest

from hybridtron.train import checkpoint as ck
from hybridtron.train.cli import main

FAST = ["--train.max_steps", "4", "--checkpoint.every", "2", "--train.eval_every", "0", "--train.warmup_steps", "1"]


@pytest.fixture(scope="module")
def trained_run(small_data_dir, small_argv, tmp_path_factory):
    run = tmp_path_factory.mktemp("hard") / "run"
    assert main(small_argv(small_data_dir, run, FAST)) == 0
    return run


@pytest.fixture
def run_copy(trained_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(trained_run, dst)
    return dst


def resume(cli_args, data_dir, run, capsys, extra=()):
    code = main(cli_args(data_dir, run, [*FAST[:1], "6", *FAST[2:], *extra]))
    err = capsys.readouterr().err
    return code, [ln for ln in err.splitlines() if ln.startswith("hybridtron train")], err


def one_line_error(code, lines, err, *needles):
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


def test_checkpoint_has_manifest_of_every_file(trained_run):
    ckpt = trained_run / "checkpoints" / "step_00000004"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(files) == on_disk and "model.safetensors" in files and "tokenizer/tokenizer.json" in files


def test_same_size_overwrite_of_weights_is_caught(run_copy, small_data_dir, cli_args, capsys):
    f = run_copy / "checkpoints" / "step_00000004" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-8:] = bytes(8 - i for i in range(8))  # other values, same size (the last bytes are tensor data)
    f.write_bytes(bytes(data))
    one_line_error(*resume(cli_args, small_data_dir, run_copy, capsys), "model.safetensors",
                   "does not match its checksum", "delete")


@pytest.mark.parametrize("name, damage, needle", [
    ("model.safetensors", "truncate", "bytes, the manifest says"),
    ("optimizer.pt", "truncate", "optimizer.pt"),
    ("rng.pt", "delete", "has no rng.pt"),
    ("trainer_state.json", "garbage", "trainer_state.json"),
])
def test_damaged_checkpoint_files_are_named(name, damage, needle, run_copy, small_data_dir, cli_args, capsys):
    ckpt = run_copy / "checkpoints" / "step_00000004"
    f = ckpt / name
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "delete":
        f.unlink()
    else:
        f.write_bytes(b"\x00\xffnot json")
    one_line_error(*resume(cli_args, small_data_dir, run_copy, capsys), needle)
    # Without the manifest the load itself still fails with one line (an older checkpoint, or a torn manifest).
    (ckpt / "manifest.json").unlink()
    code, lines, err = resume(cli_args, small_data_dir, run_copy, capsys)
    one_line_error(code, lines, err, name)


def test_debug_shows_the_traceback(run_copy, small_data_dir, cli_args, capsys, monkeypatch):
    (run_copy / "checkpoints" / "step_00000004" / "rng.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="has no rng.pt"):
        main(cli_args(small_data_dir, run_copy, [*FAST, "--debug"]))
    monkeypatch.setenv("HYBRIDTRON_DEBUG", "1")
    with pytest.raises(ck.CheckpointError):
        main(cli_args(small_data_dir, run_copy, FAST))


def test_garbage_run_config_and_invalid_yaml_config(run_copy, small_data_dir, cli_args, capsys, tmp_path):
    (run_copy / "config.yaml").write_bytes(bytes(range(256)) * 4)
    code = main(["train", "--run-dir", str(run_copy)])
    err = capsys.readouterr().err
    assert code == 2 and "config.yaml" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {d_model: [unclosed\n")
    code = main(["train", "--config", str(bad), "--run-dir", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "bad.yaml is not valid YAML" in err and "Traceback" not in err


def test_torn_metrics_line_does_not_block_resume(run_copy, small_data_dir, cli_args, capsys):
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 3.1')  # a write cut short by a kill
    code, _lines, err = resume(cli_args, small_data_dir, run_copy, capsys)
    assert code == 0, err
    assert "dropped 1 unreadable line" in err
    steps = [json.loads(ln)["step"] for ln in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6


def test_run_killed_before_first_checkpoint_leaves_no_duplicates(small_data_dir, cli_args, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3)))
    assert main(cli_args(small_data_dir, run, FAST)) == 0
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert all(json.loads(ln)["loss"] != 9.0 for ln in (run / "metrics.jsonl").read_text().splitlines())


def test_resume_with_another_tokenizer_is_refused(run_copy, tmp_path):
    """Whatever the data directory says, a checkpoint resumes only on data of its own tokenizer."""
    from hybridtron.configs import ConfigError
    from hybridtron.data_pipeline.tokenizer import load_tokenizer, train_bpe
    from hybridtron.train.cli import check_resume_tokenizer

    ckpt = run_copy / "checkpoints" / "step_00000004"
    same = load_tokenizer(ckpt / "tokenizer")
    check_resume_tokenizer(ckpt, same, tmp_path)  # the run's own: fine
    other = train_bpe(iter(["some other corpus entirely, with other merges " * 50]), 300, 10**6)
    with pytest.raises(ConfigError, match=r"trained with tokenizer \w{12} .* uses tokenizer \w{12}"):
        check_resume_tokenizer(ckpt, other, tmp_path / "elsewhere")


def test_resume_on_a_data_dir_with_another_tokenizer_is_refused(run_copy, small_data_dir, cli_args, capsys, tmp_path):
    data_copy = tmp_path / "data_copy"
    shutil.copytree(small_data_dir, data_copy)
    other = __import__("hybridtron.data_pipeline.tokenizer", fromlist=["train_bpe"]).train_bpe(
        iter(["other text " * 100]), 300, 10**6)
    (data_copy / "tokenizer" / "tokenizer.json").write_bytes(other._blob)
    code, lines, err = resume(cli_args, data_copy, run_copy, capsys)
    one_line_error(code, lines, err, "tokenizer")


def test_resume_with_other_data_settings_is_refused(run_copy, small_data_dir, cli_args, capsys):
    code, lines, err = resume(cli_args, small_data_dir, run_copy, capsys, ["--data.seq_len", "32"])
    one_line_error(code, lines, err, "data.seq_len=64", "data.seq_len=32")


def test_full_disk_during_save_keeps_previous_checkpoint(run_copy, small_data_dir, cli_args, capsys, monkeypatch):
    real = ck.torch.save

    def full(obj, f, *a, **k):
        if "optimizer" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0: file write failed")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(ck.torch, "save", full)
    code = main(cli_args(small_data_dir, run_copy, [*FAST[:1], "6", *FAST[2:]]))
    err = capsys.readouterr().err
    assert code == 4, err
    assert "no space left on device" in err and "step_00000006" in err and "inline_container" not in err
    mgr = ck.CheckpointManager(run_copy)
    assert mgr.latest().name == "step_00000004"
    assert not [p for p in mgr.dir.iterdir() if p.name.startswith(".tmp-")]


def test_enospc_oserror_is_a_disk_full_error(tmp_path):
    assert ck._is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not ck._is_disk_full(OSError(errno.EACCES, "Permission denied"))


def test_tokenizer_temp_files_stay_out_of_checkpoints(run_copy, small_data_dir, cli_args, capsys):
    (small_data_dir / "tokenizer" / ".tokenizer.json.tmp-4242").write_text("half a tokenizer")
    try:
        code, _l, err = resume(cli_args, small_data_dir, run_copy, capsys)
        assert code == 0, err
    finally:
        (small_data_dir / "tokenizer" / ".tokenizer.json.tmp-4242").unlink()
    tok = run_copy / "checkpoints" / "step_00000006" / "tokenizer"
    assert not [p for p in tok.iterdir() if "tmp" in p.name]


def test_stale_latest_pointer_is_reported(run_copy, capsys):
    (run_copy / "checkpoints" / "latest").write_text("step_00000099")
    assert ck.CheckpointManager(run_copy).latest().name == "step_00000004"
    err = capsys.readouterr().err
    assert "step_00000099" in err and "step_00000004" in err
