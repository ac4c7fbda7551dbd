"""Every architecture switch trains through the real CLI and resumes bitwise-exactly, including across
the step where self-guided FFN weights leave the model and optimizer; MoE statistics are logged."""

from __future__ import annotations

import json

import pytest

from hybridtron.cli import main
from hybridtron.train.metrics import read_metrics

ARCHS = {
    "hybrid": ["--model.layer_pattern", "LA", "--model.doc_mask", "true", "--model.deltanet.chunk_size", "16"],
    "deltaproduct": ["--model.layer_pattern", "LA", "--model.deltanet.n_householder", "2",
                     "--model.deltanet.neg_eigval", "true", "--model.deltanet.chunk_size", "16"],
    "moe": ["--model.moe.n_experts", "4", "--model.moe.top_k", "2", "--model.moe.shared_expert_hidden", "32",
            "--model.moe.bias_update_rate", "0.01", "--model.moe.z_loss_coef", "0.001"],
    "structured": ["--model.ffn.kind", "lowrank", "--model.ffn.rank", "16", "--model.ffn.dense_first_layer",
                   "false", "--model.ffn.self_guided", "true", "--model.ffn.self_guided_fraction", "0.5"],
    "scale": ["--model.scale.branch_specific", "true", "--model.scale.two_sided", "true",
              "--model.scale.magnitude_direction", "true", "--model.scale.decay_rule", "true"],
}


def _losses(run_dir):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architecture_trains_and_resumes_exactly(arch, small_data_dir, cli_args, tmp_path):
    # 12 steps; the self-guided dense weights leave at step 6, between the checkpoints at 5 and 10.
    extra = ARCHS[arch] + ["--train.max_steps", "12", "--checkpoint.every", "0", "--train.eval_every", "0",
                           "--train.warmup_steps", "2"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert main(cli_args(small_data_dir, full, extra)) == 0
    for _ in range(3):
        assert main(cli_args(small_data_dir, split, extra + ["--train.exit_interval", "5"])) == 0
    a, b = _losses(full), _losses(split)
    assert sorted(a) == list(range(1, 13))
    assert a == b
    assert a[12][0] < a[1][0]


def test_moe_statistics_reach_metrics_jsonl(small_data_dir, cli_args, tmp_path):
    run = tmp_path / "moe"
    extra = ARCHS["moe"] + ["--train.max_steps", "3", "--checkpoint.every", "0", "--train.eval_every", "0",
                            "--train.warmup_steps", "1", "--train.log_every", "1"]
    assert main(cli_args(small_data_dir, run, extra)) == 0
    rec = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    # both layers are MoE (every=1); the load fractions of each layer are fractions of all routed slots
    for layer in (0, 1):
        loads = [rec[f"moe/layer{layer}/load/e{j}"] for j in range(4)]
        assert abs(sum(loads) - 1.0) < 1e-6
        assert f"moe/layer{layer}/bias/e0" in rec and f"moe/layer{layer}/aux_loss" in rec
    assert rec["moe/layer0/dropped"] == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert "moe/layer1/load/e3" in acc.Tags()["scalars"]
