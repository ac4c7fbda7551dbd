"""`ablate` reports the language-model loss and each auxiliary loss apart: metrics.jsonl logs `lm_loss` and the
MoE auxiliary loss beside `loss` (their sum), and ablation.md / ablation.json carry one column each."""

from __future__ import annotations

import json

import pytest

from hybridtron.cli import main


def test_ablation_separates_the_lm_loss_from_the_moe_aux_loss(small_data_dir, cli_args, tmp_path):
    out = tmp_path / "abl"
    argv = cli_args(small_data_dir, out, ["--train.max_steps", "3", "--train.warmup_steps", "1",
                                          "--train.eval_every", "0", "--train.eval_batches", "1",
                                          "--checkpoint.every", "0"])
    argv[0] = "ablate"
    argv += ["--variant", "base:", "--variant", "moe:model.moe.n_experts=4,model.moe.top_k=1,"
             "model.moe.aux_loss_coef=0.5,model.moe.z_loss_coef=0.01"]
    assert main(argv) == 0
    recs = {n: [json.loads(x) for x in (out / n / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
            for n in ("base", "moe")}
    for r in recs["moe"]:
        assert r["moe_aux_loss"] > 0.1  # 0.5 x a balance loss near 1, plus the z-loss
        assert r["lm_loss"] + r["moe_aux_loss"] == pytest.approx(r["loss"], rel=1e-9)
    for r in recs["base"]:
        assert r["lm_loss"] == r["loss"] and "moe_aux_loss" not in r
    res = json.loads((out / "ablation.json").read_text())["variants"]
    moe, base = res["moe"], res["base"]
    assert moe["final_lm_loss"] + moe["final_moe_aux_loss"] == pytest.approx(moe["final_train_loss"], rel=1e-9)
    assert moe["final_lm_loss"] == pytest.approx(sum(r["lm_loss"] for r in recs["moe"]) / 3)
    assert base["final_lm_loss"] == base["final_train_loss"] and "final_moe_aux_loss" not in base
    table = (out / "ablation.md").read_text()
    head = next(ln for ln in table.splitlines() if ln.startswith("| variant"))
    cols = [c.strip() for c in head.split("|")[1:-1]]
    assert cols[3:6] == ["train LM loss", "moe_aux_loss", "train total"], head
    row = {n: [c.strip() for c in ln.split("|")[1:-1]] for ln in table.splitlines()
           for n in ("base", "moe") if ln.startswith(f"| {n} |")}
    assert float(row["moe"][3]) == pytest.approx(moe["final_lm_loss"], abs=1e-4)
    assert float(row["moe"][4]) == pytest.approx(moe["final_moe_aux_loss"], abs=1e-4)
    assert row["base"][4] == "-" and "MoE load-balance" in table
