"""The synthetic tasks as a data source (data.synthetic): joint recall rows read back by a decoder written from
the task's definition, seeded rows per split, the task's tokenizer, config refusals, the length evaluation on
models whose answers are known, and `hybridtron train` + `eval` end to end on parity."""

from __future__ import annotations

import json

import pytest
import torch

from hybridtron.configs import ConfigError, load_config
from hybridtron.data_pipeline import build_dataset, build_loader, prepare_data
from hybridtron.data_pipeline.synthetic import IGNORE, joint_recall_layout, joint_recall_row, length_accuracy


def synthetic_cfg(tmp_path, task="parity", extra=()):
    return load_config("tiny", [("data.synthetic.task", task), ("data.seq_len", "32"),
                                ("data.out_dir", str(tmp_path / "data")), *extra])


@pytest.mark.parametrize("n_contexts, n_keys, pool", [(1, 1, 1), (3, 4, 6), (5, 2, 5)])
def test_joint_recall_rows_ask_every_key_of_every_context_once(n_contexts, n_keys, pool):
    V = 7
    ids = joint_recall_layout(n_keys, V, pool)
    x, y = joint_recall_row(n_contexts, n_keys, V, pool, torch.Generator().manual_seed(n_keys), length=100)
    x, y = x.tolist(), y.tolist()
    n = 2 + 2 * n_contexts * (1 + 2 * n_keys)
    assert x[n:] == [ids["pad"]] * (100 - n) and y[n:] == [IGNORE] * (100 - n)
    sep = x.index(ids["sep"])
    table, asked, context = {}, [], None
    for t in range(n):
        tok = x[t]
        if ids["context"] <= tok < ids["sep"]:
            context = tok
        elif ids["key"] <= tok < ids["context"]:
            value = x[t + 1]
            assert 0 <= value < V
            if t < sep:
                assert (context, tok) not in table
                table[(context, tok)] = value
                assert y[t] == IGNORE
            else:
                assert y[t] == table[(context, tok)] == value  # the value this key has in this context
                asked.append((context, tok))
        else:
            assert y[t] == IGNORE
    assert len(table) == n_contexts * n_keys and sorted(asked) == sorted(table)


def test_rows_are_seeded_per_split_and_load_like_a_corpus(tmp_path):
    cfg = synthetic_cfg(tmp_path, "modadd", [("data.synthetic.min_length", "8"), ("data.synthetic.train_rows", "500")])
    train, val = build_dataset(cfg.data, "train"), build_dataset(cfg.data, "val")
    assert len(train) == cfg.data.synthetic.train_rows and len(val) == 1000
    a, b = train[5], build_dataset(cfg.data, "train")[5]
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["input_ids"], val[5]["input_ids"])
    x, y = a["input_ids"], a["labels"]
    n = int((y != IGNORE).sum())
    assert 8 <= n <= 32 and torch.equal(y[:n], x[:n].cumsum(0) % 5)  # running sums mod 5, then padding
    batch = next(iter(build_loader(train, 4, 1, seed=0)))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)


def test_prepare_writes_the_task_tokenizer_once(tmp_path):
    cfg = synthetic_cfg(tmp_path, "joint_recall", [("data.seq_len", "80")])
    messages = []
    first = prepare_data(cfg.data, log=messages.append)
    again = prepare_data(cfg.data, log=messages.append)
    assert len(messages) == 1 and first.tokenizer.fingerprint == again.tokenizer.fingerprint
    s = cfg.data.synthetic  # values, keys, a context pool for the longest evaluation, sep, pad, eos
    assert first.tokenizer.vocab_size == s.n_values + s.n_keys + s.n_contexts * max(s.eval_scales) + 3
    assert first.tokenizer.encode("v3 k0 <sep>") == [3, s.n_values, s.n_values + s.n_keys + 16]


@pytest.mark.parametrize("extra, match", [
    ([("data.synthetic.task", "joint_recall"), ("data.synthetic.n_keys", "8")], "takes 138 tokens"),
    ([("data.synthetic.eval_scales", "[0, 2]")], "eval_scales"),
    ([("data.synthetic.min_length", "40")], "min_length=40"),
    ([("data.synthetic.task", "modadd"), ("data.synthetic.modulus", "1")], "modulus=1"),
])
def test_bad_synthetic_settings_are_refused(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        synthetic_cfg(tmp_path, "parity", extra).data.validate()


class Oracle(torch.nn.Module):
    """Logits that put the running parity (or its negation) first: accuracy 1 (or 0) at every length."""

    def __init__(self, wrong=False):
        super().__init__()
        self.wrong = wrong

    def forward(self, x):
        state = (x.clamp(max=1).cumsum(1) + int(self.wrong)) % 2
        return torch.nn.functional.one_hot(state, 4).float()


def test_length_accuracy_scores_known_answers(tmp_path):
    cfg = synthetic_cfg(tmp_path, "parity", [("model.layer_pattern", "L"), ("data.synthetic.eval_scales", "[1, 3]")])
    right = length_accuracy(Oracle(), cfg, rows=8)
    assert [(r["scale"], r["length"], r["accuracy"]) for r in right] == [(1, 32, 1.0), (3, 96, 1.0)]
    assert right[0]["beyond"] is None and right[1]["beyond"] == 1.0
    assert all(r["accuracy"] == 0.0 for r in length_accuracy(Oracle(wrong=True), cfg, rows=8))
    cfg.model.layer_pattern, cfg.model.max_seq_len = "A", 64  # attention past its rotary table: not scored
    assert [r["accuracy"] for r in length_accuracy(Oracle(), cfg, rows=8)] == [1.0, None]


@pytest.mark.slow
def test_ablate_and_eval_on_parity_from_the_command_line(tmp_path, capsys):
    """Two variants trained by `hybridtron ablate` (the table gains accuracy by length), then `eval` of one."""
    from hybridtron.cli import main

    over = {"data.synthetic.task": "parity", "data.seq_len": "16", "data.out_dir": str(tmp_path / "data"),
            "model.layer_pattern": "L", "model.n_layers": "1", "model.d_model": "32", "model.n_heads": "2",
            "model.n_kv_heads": "2", "model.max_seq_len": "64", "model.deltanet.chunk_size": "16",
            "train.max_steps": "3", "train.warmup_steps": "1", "train.micro_batch_size": "4",
            "train.eval_every": "0", "train.eval_batches": "1", "train.progress_bar": "false",
            "checkpoint.every": "0"}
    argv = ["ablate", "--config", "tiny", "--run-dir", str(tmp_path / "abl"), "--variant", "beta01:",
            "--variant", "negeig:model.deltanet.neg_eigval=true"]
    for k, v in over.items():
        argv += [f"--{k}", v]
    assert main(argv) == 0
    table = (tmp_path / "abl" / "ablation.md").read_text()
    assert "accuracy (length: acc)" in table and table.count("16: ") == 2 and table.count("64: ") == 2
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(tmp_path / "abl" / "negeig")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["length"] for r in out["accuracy"]] == [16, 32, 64]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in out["accuracy"])
