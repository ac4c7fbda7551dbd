"""Data directories that never collide (data_pipeline/data_dir.py): each corpus, tokenizer and synthetic task gets
a directory of its own by default, an explicit data.out_dir holding another one's tokenizer is refused by name,
pretrained tokenizers are told apart by content, and a command stopped on bad input leaves no folders behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from hybridtron.cli import main
from hybridtron.configs import load_config
from hybridtron.data_pipeline import prepare_data
from hybridtron.data_pipeline.data_dir import default_data_dir, resolve_out_dir
from hybridtron.train.run_dir import check_resume_compatible, resolve_data_dir

SMALL = ["--data.sources", "[{path: stdlib, max_files: 20}]", "--data.tokenizer.vocab_size", "300"]


def data_cfg(*overrides: tuple[str, str]):
    return load_config("tiny", [("data.sources", "[{path: stdlib, max_files: 20}]"),
                                ("data.tokenizer.vocab_size", "300"), *overrides]).data


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_default_dirs_differ_by_corpus_tokenizer_and_task(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"any": "bytes"}')
    dirs = {
        "bpe": default_data_dir(data_cfg()),
        "parity": default_data_dir(data_cfg(("data.synthetic.task", "parity"))),
        "joint_recall": default_data_dir(data_cfg(("data.synthetic.task", "joint_recall"))),
        "pretrained": default_data_dir(data_cfg(("data.tokenizer.kind", "pretrained"), ("data.tokenizer.path", str(tok)))),
    }
    assert len(set(dirs.values())) == 4, dirs
    assert all(d.parent == Path("data") for d in dirs.values())
    assert dirs["bpe"].name.startswith("stdlib-bpe300-") and dirs["parity"].name.startswith("parity-")
    assert dirs["pretrained"].name.startswith("stdlib-pretrained-")
    # every setting that changes what prepare writes moves the directory ...
    for key, value in [("data.tokenizer.vocab_size", "400"), ("data.tokenizer.sample_mb", "0.001"),
                       ("data.tokenizer.kind", "sentencepiece"), ("data.sources", "[{path: stdlib, max_files: 21}]"),
                       ("data.seed", "1"), ("data.val_fraction", "0.1"), ("data.shard_docs", "10"),
                       ("data.max_record_mb", "8")]:
        assert default_data_dir(data_cfg((key, value))) != dirs["bpe"], key
    assert default_data_dir(data_cfg(("data.synthetic.task", "joint_recall"), ("data.synthetic.n_keys", "2"))) \
        != dirs["joint_recall"]
    # ... and what is used only when reading it does not
    for key, value in [("data.seq_len", "64"), ("data.streaming", "false"), ("data.num_workers", "1"),
                       ("data.on_bad_record", "error"), ("data.on_source_change", "rebuild")]:
        assert default_data_dir(data_cfg((key, value))) == dirs["bpe"], key
    assert default_data_dir(data_cfg(("data.synthetic.task", "parity"), ("data.synthetic.train_rows", "7"))) \
        == dirs["parity"]
    # a pretrained tokenizer is its content: a byte-identical copy elsewhere maps to the same directory, other bytes
    # at the same path to another
    copy = tmp_path / "elsewhere" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(tok, copy)
    pre = [("data.tokenizer.kind", "pretrained"), ("data.tokenizer.path", str(copy))]
    assert default_data_dir(data_cfg(*pre)) == dirs["pretrained"]
    copy.write_text('{"other": "bytes"}')
    assert default_data_dir(data_cfg(*pre)) != dirs["pretrained"]


def test_a_readable_name_stays_short_and_safe():
    cfg = data_cfg(("data.sources", "[{path: stdlib, name: '../We ird/näme*" + "x" * 80 + "'}, {path: stdlib, name: b}]"))
    name = default_data_dir(cfg).name
    assert name.startswith("We_ird_n_me_") and "-and1-bpe300-" in name and len(name) < 70, name
    assert resolve_out_dir(cfg).out_dir == str(default_data_dir(cfg))
    given = data_cfg(("data.out_dir", "my/data"))
    assert resolve_out_dir(given).out_dir == "my/data"  # a given directory is kept as is


def test_a_resumed_run_keeps_its_own_data_dir(tmp_path):
    """A run directory whose saved config names its data directory (data/stdlib, from before directories were named
    by corpus) keeps it when the same data is asked for with --config; other data gets its own directory."""
    run = tmp_path / "run"
    run.mkdir()
    old = load_config("tiny", [("data.out_dir", "data/stdlib")])
    (run / "config.yaml").write_text(old.to_yaml())
    assert resolve_data_dir(load_config("tiny"), run).data.out_dir == "data/stdlib"
    other = load_config("tiny", [("data.tokenizer.vocab_size", "300")])
    assert resolve_data_dir(other, run).data.out_dir == str(default_data_dir(other.data))
    assert resolve_data_dir(load_config("tiny"), tmp_path / "new_run").data.out_dir == \
        str(default_data_dir(load_config("tiny").data))


def test_a_command_on_a_run_dirs_config_with_other_data_gets_that_datas_dir(tmp_path):
    """`hybridtron prepare --data.sources X` with the default run directory takes that run's saved config as its
    base; the run's directory was chosen for the run's corpus, so X gets its own (the README's `prepare` of a user
    corpus after `./run.sh train` used to land in, and be refused by, the stdlib directory)."""
    import argparse

    from hybridtron.train.run_dir import resolve_job

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(resolve_data_dir(data_cfg_job(), run).to_yaml())
    ran = load_config(str(run / "config.yaml")).data.out_dir

    def job(*overrides):
        args = argparse.Namespace(config=None, run_dir=str(run), overrides=list(overrides))
        cfg, run_dir = resolve_job(args)
        return resolve_data_dir(cfg, run_dir).data

    assert job().out_dir == ran  # the run's own data: its directory
    other = job("--data.sources", "[{path: corpus/*.jsonl, text_field: text}]")
    assert other.out_dir == str(default_data_dir(other)) != ran
    assert job("--data.out_dir", "mine").out_dir == "mine"


def data_cfg_job():
    return load_config("tiny", [("data.sources", "[{path: stdlib, max_files: 20}]"),
                                ("data.tokenizer.vocab_size", "300")])


def test_a_pretrained_tokenizer_at_another_path_resumes(tmp_path):
    """The tokenizer's path is not what a run is compared on (its content is, by check_resume_tokenizer)."""
    run = tmp_path / "run"
    run.mkdir()
    saved = load_config("tiny", [("data.tokenizer.kind", "pretrained"), ("data.tokenizer.path", "/a/tokenizer.json")])
    (run / "config.yaml").write_text(saved.to_yaml())
    check_resume_compatible(load_config("tiny", [("data.tokenizer.kind", "pretrained"),
                                                 ("data.tokenizer.path", "/b/tokenizer.json")]), run)
    with pytest.raises(ValueError, match="data.tokenizer.kind"):
        check_resume_compatible(load_config("tiny"), run)


def test_a_tokenizer_recorded_by_an_older_version_is_reused(tmp_path):
    """Data prepared before the tokenizer's recipe named its corpus (e.g. data/stdlib) stays usable."""
    cfg = data_cfg(("data.out_dir", str(tmp_path / "stdlib")), ("data.tokenizer.sample_mb", "0.1"))
    prepare_data(cfg, log=lambda _: None)
    meta_f = tmp_path / "stdlib" / "tokenizer" / "tokenizer_meta.json"
    meta = json.loads(meta_f.read_text())
    meta["config"] = {"kind": "bpe", "vocab_size": 300, "path": None}  # what the older version recorded
    meta_f.write_text(json.dumps(meta))
    logs: list[str] = []
    prepare_data(cfg, log=logs.append)
    assert not any("training" in m or "tokenizing" in m for m in logs), logs
    cfg.tokenizer.vocab_size = 400
    with pytest.raises(ValueError, match=r"made from bpe training \(vocab_size 300\).*vocab_size 400"):
        prepare_data(cfg, log=lambda _: None)


@pytest.mark.slow
def test_parity_then_the_default_corpus_both_stay_usable(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "--data.synthetic.task", "parity"]) == 0
    assert main(["prepare", *SMALL]) == 0
    parity, corpus = default_data_dir(data_cfg(("data.synthetic.task", "parity"))), default_data_dir(data_cfg())
    assert sorted(p.name for p in Path("data").iterdir()) == sorted([parity.name, corpus.name])
    assert json.loads((parity / "tokenizer" / "tokenizer_meta.json").read_text())["config"] == {"synthetic": "parity"}
    assert (corpus / "stdlib" / "train" / "manifest.json").is_file()
    before = {p: p.stat().st_mtime_ns for p in Path("data").rglob("*") if p.is_file() and ".hf_cache" not in p.parts}
    capsys.readouterr()
    assert main(["prepare", "--data.synthetic.task", "parity"]) == 0  # a second prepare of the first: a no-op
    assert main(["prepare", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "tokenizer in" not in out and "training" not in out and "tokenizing" not in out, out
    after = {p: p.stat().st_mtime_ns for p in Path("data").rglob("*") if p.is_file() and ".hf_cache" not in p.parts}
    assert {p: t for p, t in after.items() if p.name != "prepare_config.json"} == \
        {p: t for p, t in before.items() if p.name != "prepare_config.json"}


@pytest.mark.slow
def test_an_explicit_dir_holding_another_tokenizer_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", *SMALL, "--data.out_dir", "corpus"]) == 0
    assert main(["prepare", "--data.synthetic.task", "parity", "--data.out_dir", "task"]) == 0
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    # a synthetic task over a corpus's tokenizer (it used to overwrite it silently)
    assert main(["prepare", "--data.synthetic.task", "joint_recall", "--data.out_dir", "corpus"]) == 2
    err = one_error_line(capsys)
    assert "corpus/tokenizer holds a tokenizer made from bpe training (vocab_size 300" in err, err
    assert "asks for one made from synthetic task joint_recall" in err and "leave data.out_dir unset" in err, err
    # another task over a task's
    assert main(["prepare", "--data.synthetic.task", "modadd", "--data.out_dir", "task"]) == 2
    err = one_error_line(capsys)
    assert "made from synthetic task parity, but this config asks for one made from synthetic task modadd" in err
    # a corpus (or another BPE) over a task's or a corpus's
    assert main(["prepare", *SMALL, "--data.out_dir", "task"]) == 2
    err = one_error_line(capsys)
    assert "made from synthetic task parity" in err and "one made from bpe training (vocab_size 300" in err, err
    assert main(["prepare", *SMALL, "--data.tokenizer.vocab_size", "400", "--data.out_dir", "corpus"]) == 2
    err = one_error_line(capsys)
    assert "(vocab_size 300" in err and "(vocab_size 400" in err, err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written, nothing removed


@pytest.mark.slow
def test_bad_input_leaves_no_new_folders(tmp_path, monkeypatch, capsys):
    cwd, empty = tmp_path / "cwd", tmp_path / "empty"
    cwd.mkdir()
    empty.mkdir()
    (empty / "a.txt").write_text("")  # a source without text: found once prepare has made its directory
    monkeypatch.chdir(cwd)
    missing = ["--data.sources", f"[{{path: {tmp_path}/missing}}]"]
    for argv in (["prepare", *missing], ["train", *missing], ["train", *missing, "--run-dir", "runs/deep/x"],
                 ["prepare", *missing, "--data.out_dir", "a/b/c"],
                 ["prepare", "--data.sources", f"[{{path: {empty}}}]", "--data.out_dir", "a/b/c"],
                 ["train", "--data.sources", f"[{{path: {empty}}}]", "--run-dir", "runs/deep/x"],
                 ["ablate", *missing, "--variant", "a:", "--variant", "b:train.lr=0.001"],
                 ["train", "--data.tokenizer.kind", "pretrained", "--data.tokenizer.path", "nowhere/tokenizer.json"]):
        assert main(argv) == 2, argv
        err = one_error_line(capsys)
        assert any(s in err for s in ("matches no files", "no text to train", "tokenizer.json is not a file")), err
        assert list(cwd.iterdir()) == [], (argv, list(cwd.rglob("*")))


@pytest.mark.slow
def test_init_from_a_copied_export_reuses_the_data_dir(tok_dir, tmp_path, monkeypatch, capsys):
    """--init-from needs no --data.out_dir: the tokenizer's content picks the directory, so a byte-identical
    tokenizer.json in another export directory finds the data already tokenized."""
    pytest.importorskip("transformers")
    import torch

    from hybridtron.configs import ModelConfig
    from hybridtron.model import GatedLM
    from hybridtron.train.hf.export import export_model

    torch.manual_seed(0)
    model = GatedLM(ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64), 320)
    model.init_weights()
    export_model(model.eval(), tok_dir, tmp_path / "hf_a", log=lambda _: None)
    shutil.copytree(tmp_path / "hf_a", tmp_path / "hf_b")
    monkeypatch.chdir(tmp_path)
    run = ["--data.sources", "[{path: stdlib, max_files: 20}]", "--data.seq_len", "32", "--train.max_steps", "1",
           "--train.micro_batch_size", "2", "--train.warmup_steps", "0", "--train.eval_every", "0",
           "--train.progress_bar", "false", "--checkpoint.every", "0"]
    assert main(["train", *run, "--init-from", f"hf:{tmp_path / 'hf_a'}", "--run-dir", "runs/a"]) == 0
    assert "tokenizing" in capsys.readouterr().out
    assert main(["train", *run, "--init-from", f"hf:{tmp_path / 'hf_b'}", "--run-dir", "runs/b"]) == 0
    out = capsys.readouterr().out
    assert "tokenizing" not in out and "initialised from Hugging Face weights" in out, out
    dirs = [yaml.safe_load(Path(f"runs/{r}/config.yaml").read_text())["data"]["out_dir"] for r in "ab"]
    assert dirs[0] == dirs[1] and Path(dirs[0]).parent == Path("data") and "-pretrained-" in dirs[0], dirs
    assert [p.name for p in Path("data").iterdir()] == [Path(dirs[0]).name]
