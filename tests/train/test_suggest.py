"""plan --suggest: the scaling-law rules, fits that recover known constants, and refusals of what cannot be fitted."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml

from hybridtron.cli import main
from hybridtron.configs import ConfigError, load_config
from hybridtron.model.lm import GatedLM
from hybridtron.train.suggest import (
    ROUNDING,
    RoutedFit,
    fit_routed,
    fit_tau,
    optimum_of_sweep,
    suggest,
    tau,
)


def test_the_config_is_its_own_answer_at_its_own_budget_and_scales_by_the_laws():
    cfg = load_config("tiny", [("train.lr", "1e-3"), ("train.weight_decay", "0.1"), ("train.max_steps", "1000")])
    t = cfg.train
    batch = t.micro_batch_size * t.grad_accum_steps * cfg.data.seq_len
    same = suggest(cfg, 10_000_000, 5_000_000, batch * 1000)
    assert same["batch_tokens"] == batch and same["steps"] == 1000
    assert same["lr"] == pytest.approx(1e-3) and same["weight_decay"] == pytest.approx(0.1)
    more = suggest(cfg, 10_000_000, 5_000_000, batch * 1000 * 16)
    # B_opt ~ D^0.383, lr ~ sqrt(B), tau_opt ~ TPP^-0.53, wd = 1 / (lr tau steps): checked from the formulas
    # rounded to a multiple of sequences that data-parallel ranks split, by at most ROUNDING
    assert more["batch_tokens"] == pytest.approx(batch * 16 ** 0.383, rel=ROUNDING)
    b = more["batch_tokens"] / batch
    assert more["lr"] == pytest.approx(1e-3 * math.sqrt(b))
    tau_ref = 1 / (1e-3 * 0.1 * 1000)
    expect_tau = tau_ref * 16 ** -0.53
    assert more["weight_decay"] == pytest.approx(1 / (more["lr"] * expect_tau * more["steps"]))
    with pytest.raises(ConfigError, match="at least one step"):
        suggest(cfg, 10_000_000, 5_000_000, batch - 1)


def _sweep(c, m, tpps, seed=0):
    """Losses that are best at tau_opt = c TPP^m, parabolic in log tau, with small noise."""
    rng = np.random.default_rng(seed)
    groups = {}
    for tpp in tpps:
        best = c * tpp ** m
        taus = best * np.geomspace(0.25, 4.0, 7)
        groups[tpp] = [(float(t), 2.0 + 0.05 * math.log(t / best) ** 2 + float(rng.normal(0, 1e-4))) for t in taus]
    return groups


def test_tau_fit_recovers_c_and_m_from_sweeps_at_several_tpp():
    fit = fit_tau(_sweep(0.3, -0.5, [10, 40, 160, 640]))
    assert fit.c == pytest.approx(0.3, rel=0.05) and fit.m == pytest.approx(-0.5, abs=0.02) and fit.r2 > 0.99


def test_tau_fit_at_one_tpp_uses_the_papers_exponent():
    fit = fit_tau(_sweep(0.7, -0.53, [20]))
    assert fit.m == -0.53 and fit.c == pytest.approx(0.7, rel=0.05)


def test_tau_sweeps_that_cannot_be_fitted_are_refused():
    with pytest.raises(ConfigError, match="at least 3 distinct"):
        optimum_of_sweep([0.1, 0.2], [2.0, 1.9])
    with pytest.raises(ConfigError, match="outside the swept range|no minimum"):
        optimum_of_sweep([0.1, 0.2, 0.4, 0.8], [2.3, 2.2, 2.1, 2.05])  # still falling at the edge


def test_routed_law_fit_recovers_known_constants():
    truth = RoutedFit(a=-0.08, b=-0.1, c=0.009, d=1.1, e_start=1.8, e_max=300.0, rmse=0.0)
    runs = [(n, e, float(math.exp(truth.log_loss(n, e)))) for n in (1e7, 1e8, 1e9) for e in (1, 4, 16, 64, 256)]
    fit = fit_routed(runs)
    assert fit.rmse < 1e-3
    for n, e in ((3e8, 8), (3e8, 128), (2e9, 32)):  # held-out points
        assert float(fit.log_loss(n, e)) == pytest.approx(float(truth.log_loss(n, e)), abs=2e-3)
    assert fit.b == pytest.approx(truth.b, rel=0.15) and fit.c == pytest.approx(truth.c, rel=0.25)
    assert fit.favoured_experts(3e8) == truth.favoured_experts(3e8)
    with pytest.raises(ConfigError, match="at least 6 runs"):
        fit_routed(runs[:4])


def _fake_ablation(root, variants, preset="tiny"):
    """What `hybridtron ablate` leaves: ablation.json, and per variant config.yaml and metrics.jsonl."""
    out = {}
    for name, (over, loss, active) in variants.items():
        cfg = load_config(preset, over)
        (root / name).mkdir(parents=True)
        (root / name / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
        t = cfg.train
        tokens = t.max_steps * t.micro_batch_size * t.grad_accum_steps * cfg.data.seq_len
        (root / name / "metrics.jsonl").write_text(json.dumps({"step": t.max_steps, "tokens_seen": tokens}) + "\n")
        out[name] = {"overrides": over, "final_val_loss": loss, "final_train_loss": loss, "steps": t.max_steps,
                     "params": active, "active_params": active}
    (root / "ablation.json").write_text(json.dumps({"preset": preset, "variants": out}))


def test_cli_fits_a_weight_decay_sweep_and_reports_the_fit(tmp_path, capsys):
    steps, lr = 200, 1e-3
    best_wd = 0.08
    cfg = load_config("tiny")
    with torch.device("meta"):
        active = GatedLM(cfg.model, cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)).num_active_params()
    variants = {}
    for wd in (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64):
        t = tau(lr, wd, steps)
        t_best = tau(lr, best_wd, steps)
        variants[f"wd{wd}"] = ([("train.lr", str(lr)), ("train.weight_decay", str(wd)), ("train.max_steps", str(steps))],
                               3.0 + 0.04 * math.log(t / t_best) ** 2, active)
    _fake_ablation(tmp_path / "sweep", variants)
    assert main(["plan", "--config", "tiny", "--gpus-per-node", "1", "--train.lr", str(lr), "--train.max_steps",
                 str(steps), "--suggest", "--fit", str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    assert "tau fit:" in out and "R^2" in out
    # at the sweep's own budget and batch the suggested weight decay is the sweep's best
    row = next(ln for ln in out.splitlines() if ln.startswith("| train.weight_decay"))
    assert float(row.split("|")[2]) == pytest.approx(best_wd, rel=0.03)


def test_cli_refuses_a_directory_without_a_sweep(tmp_path, capsys):
    assert main(["plan", "--config", "tiny", "--suggest", "--fit", str(tmp_path)]) == 2
    assert "no ablation.json" in capsys.readouterr().err


def _suggested(capsys, *args) -> dict:
    assert main(["plan", "--config", "tiny", "--suggest", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("tokens", [[], ["--tokens", "2e10"]])  # the config's own budget, and a large one
def test_the_suggestion_is_the_same_on_any_cluster_and_every_cut_splits_the_batch(tokens, capsys):
    shapes = [(1, 1), (1, 2), (1, 8)] + ([(n, g) for n in (2, 3, 4) for g in (1, 2, 8)] if tokens else [])
    seen = {}
    for nodes, gpus in shapes:
        s = _suggested(capsys, "--nodes", str(nodes), "--gpus-per-node", str(gpus), *tokens)
        seen[nodes, gpus] = {k: s[k] for k in ("batch_tokens", "batch_sequences", "steps", "lr", "weight_decay",
                                               "tokens")}
        cuts = {c["dp"]: c for c in s["cuts"]}
        assert nodes * gpus in cuts  # this cluster's cut is among those printed
        for c in s["cuts"]:
            assert c["dp"] * c["micro_batch_size"] * c["grad_accum_steps"] == s["batch_sequences"], c
            assert c["micro_batch_size"] <= 16  # never above the config's micro-batch (its memory)
    assert len({json.dumps(v, sort_keys=True) for v in seen.values()}) == 1, seen


def test_the_text_names_the_cuts_the_rounding_and_the_sources(capsys):
    assert main(["plan", "--config", "tiny", "--suggest", "--gpus-per-node", "8", "--tokens", "3e8"]) == 0
    out = capsys.readouterr().out
    s = _suggested(capsys, "--gpus-per-node", "8", "--tokens", "3e8")
    assert f"rounded to {s['batch_sequences']}, a multiple of" in out
    rows = [ln.split("|")[1:4] for ln in out.split("the batch cut over data-parallel ranks")[1].splitlines()
            if ln.startswith("| ") and ln[2].isdigit()]
    assert rows and all(int(d) * int(m) * int(a) == s["batch_sequences"] for d, m, a in rows), out
    assert "<- this cluster" in out
    for source in ("arXiv 2505.13738", "arXiv 2202.01169", "square-root", "ours:"):
        assert source in out.split("constants and their sources:")[1]


def test_the_expert_count_says_still_gaining_when_the_candidates_stop_below_the_optimum():
    law = RoutedFit(a=-0.08, b=-0.1, c=0.004, d=1.1, e_start=1.8, e_max=300.0, rmse=0.0)
    assert law.favoured_experts(1e7) == (512, False)  # reached within the candidates
    assert law.favoured_experts(1e7, candidates=(1, 2, 4, 8)) == (8, True)  # cut below it: still gaining at 8
    far = RoutedFit(a=-0.08, b=-0.1, c=0.004, d=1.1, e_start=1.8, e_max=1e6, rmse=0.0)
    cfg = load_config("tiny_moe")
    out = suggest(cfg, 20_000_000, 10_000_000, 1e9, routed=far)
    assert out["experts"] == 512 and "still gaining at the largest candidate, 512" in out["experts_rule"]
    assert "still gaining" not in suggest(cfg, 20_000_000, 10_000_000, 1e9, routed=law)["experts_rule"]
