"""``hybridtron plan --suggest``: learning rate, weight decay, batch size and steps from scaling laws.

Two published laws, and fits of their constants to the user's own small sweeps (``hybridtron ablate``):

- **AdamW timescale** (Bergsma et al. 2025, "Power Lines", arXiv 2505.13738). AdamW's weights are an
  exponential moving average of its updates over ``1 / (lr * weight_decay)`` steps; as a fraction of the run,
  ``tau = 1 / (lr * weight_decay * steps)`` (= B / (lr wd D) with batch B and tokens D in one unit). The loss
  is best at ``tau_opt = c * TPP**m``, a power law in tokens per parameter ``TPP = D / N`` with ``m`` about
  -0.53. At fixed lr, N and D the best weight decay is then ``1 / (lr * tau_opt * steps)``: linear in the batch.
  The optimal batch grows as a power law in the token count alone, ``B_opt ~ D**0.383``.
- **Routed models** (Clark et al. 2022, arXiv 2202.01169): ``log L = a log N + b log Ehat + c log N log Ehat
  + d`` with N the dense (active) parameters and ``Ehat`` a saturating transform of the expert count E,
  ``1/Ehat = 1/(E - 1 + 1/(1/E_start - 1/E_max)) + 1/E_max``: more experts help less as N grows (c > 0) and
  stop helping near ``E_max``.

Constants that neither paper states in a form this tool can use for another setup are taken from a reference
point instead: without ``--fit`` or ``--tau-c``, the config itself (its lr, weight decay, batch and steps) is
taken as tuned at its own token budget, and the laws scale it to the budget asked for. ``--fit RUN_DIR...``
reads ablation sweeps (``<dir>/ablation.json`` and each variant's config and metrics) and fits ``c`` (and ``m``
when the sweeps cover several TPP), or the routed law's constants from an expert-count sweep.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridtron.configs import ConfigError, JobConfig
from hybridtron.configs.base import from_dict

TAU_EXPONENT = -0.53  # Power Lines: tau_opt = c * TPP^m
BATCH_EXPONENT = 0.383  # Power Lines: B_opt ~ D^0.383
EXPERT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SHARE_OF_GAIN = 0.9  # the favoured expert count: the smallest reaching this share of the saturated gain
# The global batch (sequences) is rounded to a multiple of the largest of these that moves it by at most
# ROUNDING: each divides the next, and 96 is split by every data-parallel size of 1, 2, 4 or 8 GPUs per node on 1
# to 4 nodes (1, 2, 3, 4, 6, 8, 12, 16, 24, 32), 48 by those up to 24, 16 by the powers of two up to 16.
BATCH_QUANTA = (96, 48, 16, 8, 4, 2, 1)
ROUNDING = 0.1
CUT_DP = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96)  # data-parallel sizes whose cut is printed when they split the batch
SOURCES = (  # the constants the suggestion uses, and where each comes from (printed with it)
    f"tau_opt ~ TPP^{TAU_EXPONENT} and B_opt ~ D^{BATCH_EXPONENT}: Bergsma et al. 2025, \"Power Lines\", "
    "arXiv 2505.13738",
    "lr ~ sqrt(batch) for AdamW: the square-root scaling rule (Malladi et al. 2022, arXiv 2205.10287)",
    "routed law log L = a log N + b log Ehat + c log N log Ehat + d: Clark et al. 2022, arXiv 2202.01169 (its "
    "constants only from --fit)",
    f"ours: the favoured expert count is the smallest of {EXPERT_CANDIDATES[0]}..{EXPERT_CANDIDATES[-1]} with "
    f"{SHARE_OF_GAIN:.0%} of the saturated gain; the batch is rounded to a multiple of one of {BATCH_QUANTA} "
    f"sequences (the largest within {ROUNDING:.0%}) so that data-parallel ranks split it",
)


# ---- the AdamW timescale -------------------------------------------------------------------------------------
def tau(lr: float, weight_decay: float, steps: int) -> float:
    return 1.0 / (lr * weight_decay * steps)


@dataclass
class TauFit:
    c: float
    m: float
    points: list[tuple[float, float]]  # (TPP, tau_opt) per swept setting
    r2: float  # of the loss-vs-log(tau) parabolas (worst), or of the power law when m was fitted
    source: str

    def tau_opt(self, tpp: float) -> float:
        return self.c * tpp ** self.m


def optimum_of_sweep(taus: list[float], losses: list[float]) -> tuple[float, float]:
    """tau at the minimum of a parabola fitted to loss against log(tau), and the fit's R^2."""
    if len(taus) < 3 or len(set(taus)) < 3:
        raise ConfigError(f"a tau sweep needs at least 3 distinct weight decays or learning rates at one model and "
                          f"token budget (it has {len(set(taus))}); add variants to the ablation")
    x, y = np.log(np.asarray(taus, float)), np.asarray(losses, float)
    a, b, c0 = np.polyfit(x, y, 2)
    resid = y - np.polyval([a, b, c0], x)
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss if ss > 0 else 0.0
    if a <= 0:
        raise ConfigError("the swept losses have no minimum in tau (they rise or fall throughout, or curve the wrong "
                          "way): widen the sweep on both sides of the best weight decay")
    best = -b / (2 * a)
    if not x.min() <= best <= x.max():
        raise ConfigError(f"the fitted optimum tau={math.exp(best):.3g} lies outside the swept range "
                          f"[{math.exp(x.min()):.3g}, {math.exp(x.max()):.3g}]: extend the sweep towards it")
    return float(math.exp(best)), r2


def fit_tau(groups: dict[float, list[tuple[float, float]]], m: float | None = None) -> TauFit:
    """``groups``: TPP -> [(tau, final loss)] of runs at that model and budget. One TPP fixes c at the paper's
    exponent (or ``m``); several fit c and m together."""
    points, r2s = [], []
    for tpp, runs in sorted(groups.items()):
        t_opt, r2 = optimum_of_sweep([t for t, _ in runs], [v for _, v in runs])
        points.append((tpp, t_opt))
        r2s.append(r2)
    if len(points) >= 2 and m is None:
        lx, ly = np.log([p[0] for p in points]), np.log([p[1] for p in points])
        if np.ptp(lx) == 0:
            raise ConfigError("the sweeps share one tokens-per-parameter ratio: m cannot be fitted; give --tau-m")
        slope, icpt = np.polyfit(lx, ly, 1)
        pred = icpt + slope * lx
        ss = float(((ly - ly.mean()) ** 2).sum())
        r2 = 1.0 - float(((ly - pred) ** 2).sum()) / ss if ss > 0 else 1.0
        return TauFit(float(math.exp(icpt)), float(slope), points, r2, f"fitted to {len(points)} sweeps (c and m)")
    m = TAU_EXPONENT if m is None else m
    cs = [t / tpp ** m for tpp, t in points]
    c = float(math.exp(np.mean(np.log(cs))))
    return TauFit(c, m, points, min(r2s), f"fitted to {len(points)} sweep(s), m = {m:g}")


# ---- the routed (MoE) law -----------------------------------------------------------------------------------
def e_hat(e, e_start: float, e_max: float):
    e = np.asarray(e, float)
    return 1.0 / (1.0 / (e - 1.0 + 1.0 / (1.0 / e_start - 1.0 / e_max)) + 1.0 / e_max)


@dataclass
class RoutedFit:
    a: float
    b: float
    c: float
    d: float
    e_start: float
    e_max: float
    rmse: float  # of log loss

    def log_loss(self, n, e):
        ln, le = np.log(n), np.log(e_hat(e, self.e_start, self.e_max))
        return self.a * ln + self.b * le + self.c * ln * le + self.d

    def favoured_experts(self, n: float, candidates: tuple[int, ...] = EXPERT_CANDIDATES) -> tuple[int, bool]:
        """The smallest candidate count reaching SHARE_OF_GAIN of the loss drop the saturated count gives, and
        whether none does (the loss is still falling at the largest candidate, which is then returned)."""
        dense = float(self.log_loss(n, 1.0))
        limit = float(self.log_loss(n, 1e9))
        if limit >= dense:
            return 1, False  # at this size experts no longer help
        for e in candidates:
            if dense - float(self.log_loss(n, e)) >= SHARE_OF_GAIN * (dense - limit):
                return e, False
        return candidates[-1], True


def fit_routed(runs: list[tuple[float, int, float]]) -> RoutedFit:
    """``runs``: (active parameters N, experts E, final loss). Linear least squares for a, b, c, d at every
    (E_start, E_max) on a log grid; the best grid point, refined once around it."""
    ns = {n for n, _, _ in runs}
    es = {e for _, e, _ in runs}
    if len(runs) < 6 or len(ns) < 2 or len(es) < 3:
        raise ConfigError(f"the routed law needs at least 6 runs over 2 or more model sizes and 3 or more expert "
                          f"counts (have {len(runs)} runs, {len(ns)} sizes, {len(es)} expert counts)")
    n = np.array([r[0] for r in runs], float)
    e = np.array([r[1] for r in runs], float)
    y = np.log([r[2] for r in runs])

    def solve(e_start, e_max):
        le = np.log(e_hat(e, e_start, e_max))
        X = np.stack([np.log(n), le, np.log(n) * le, np.ones_like(n)], 1)
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        return float(np.sqrt(np.mean((X @ coef - y) ** 2))), coef

    best = None
    starts, maxes = np.geomspace(1.05, 20, 40), np.geomspace(max(e.max(), 4) / 2, 4096, 60)
    for _ in range(2):
        for s in starts:
            for mx in maxes:
                if mx <= s * 1.01:
                    continue
                rmse, coef = solve(s, mx)
                if best is None or rmse < best[0]:
                    best = (rmse, coef, s, mx)
        _, _, s0, m0 = best
        starts, maxes = np.geomspace(max(1.01, s0 / 1.3), s0 * 1.3, 25), np.geomspace(m0 / 1.3, m0 * 1.3, 25)
    rmse, coef, s, mx = best
    if not np.all(np.isfinite(coef)):
        raise ConfigError("the routed-law fit did not converge (non-finite constants); check the sweep's losses")
    return RoutedFit(*map(float, coef), float(s), float(mx), rmse)


# ---- reading the user's sweeps --------------------------------------------------------------------------------
def _last_metrics(run: Path) -> dict:
    last = {}
    with open(run / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if "step" in rec:
                last.update(rec)
    return last


def read_sweeps(dirs: list[Path]) -> list[dict]:
    """One record per finished variant of each ablation directory: lr, weight decay, steps, tokens, active
    parameters, experts, final validation loss (the training language-model loss when the run never evaluated)."""
    import yaml

    out = []
    for d in dirs:
        summary = d / "ablation.json"
        if not summary.is_file():
            raise ConfigError(f"--fit {d}: no ablation.json; give directories `hybridtron ablate` wrote")
        variants = json.loads(summary.read_text())["variants"]
        for name, r in variants.items():
            run = d / name  # with --seeds: the first seed's run (the seeds share every setting but the seed)
            run = run if (run / "config.yaml").is_file() else min(run.glob("seed*"), default=run)
            cfg: JobConfig = from_dict(JobConfig, yaml.safe_load((run / "config.yaml").read_text()))
            loss = r.get("final_val_loss") or r.get("final_lm_loss") or r.get("final_train_loss")
            if loss is None:
                continue
            t = cfg.train
            tokens = _last_metrics(run).get("tokens_seen") or (
                t.max_steps * t.micro_batch_size * t.grad_accum_steps * cfg.data.seq_len)
            out.append({"run": f"{d}/{name}", "lr": t.lr, "weight_decay": t.weight_decay, "steps": r["steps"],
                        "tokens": tokens, "params": r["active_params"], "experts": max(cfg.model.moe.n_experts, 1),
                        "loss": loss})
    if not out:
        raise ConfigError(f"--fit: no finished variant with a loss in {', '.join(map(str, dirs))}")
    return out


def fits_from_sweeps(records: list[dict]) -> tuple[TauFit | None, RoutedFit | None]:
    """tau sweeps: runs that differ in lr x weight decay at one (params, tokens); expert sweeps: runs that differ
    in expert count. Whichever the records hold is fitted."""
    taus: dict[float, list] = {}
    for r in records:
        if r["experts"] == 1 and r["weight_decay"] > 0:
            taus.setdefault(r["tokens"] / r["params"], []).append((tau(r["lr"], r["weight_decay"], r["steps"]), r["loss"]))
    tau_fit = fit_tau({k: v for k, v in taus.items() if len({t for t, _ in v}) >= 3}) if any(
        len({t for t, _ in v}) >= 3 for v in taus.values()) else None
    routed = [(r["params"], r["experts"], r["loss"]) for r in records]
    routed_fit = fit_routed(routed) if len({e for _, e, _ in routed}) >= 3 else None
    if tau_fit is None and routed_fit is None:
        raise ConfigError("--fit: the sweeps hold neither a weight-decay (tau) sweep (3+ values of lr x weight decay "
                          "at one model and budget) nor an expert-count sweep (3+ expert counts, 2+ sizes)")
    return tau_fit, routed_fit


# ---- the suggestion -------------------------------------------------------------------------------------------
def reference_batch(cfg: JobConfig) -> int:
    """The config's tokens per step, whatever cluster it runs on: micro-batch x accumulation x sequence length x
    parallel.dp (1 when the cluster sizes it, dp = -1)."""
    t = cfg.train
    return t.micro_batch_size * t.grad_accum_steps * max(cfg.parallel.dp, 1) * cfg.data.seq_len


def round_batch(seqs: float) -> tuple[int, int]:
    """(global batch in sequences, its quantum): the nearest multiple of the largest BATCH_QUANTA within
    ROUNDING of ``seqs``."""
    for q in BATCH_QUANTA:
        n = max(q, q * round(seqs / q))
        if abs(n - seqs) <= ROUNDING * seqs:
            return n, q
    return max(1, round(seqs)), 1


def cut(batch_seqs: int, dp: int, micro_limit: int) -> dict:
    """The global batch cut into micro-batch x accumulation x ``dp`` ranks: the largest micro-batch up to
    ``micro_limit`` (the config's, what fits in memory) that divides each rank's share."""
    share = batch_seqs // dp
    micro = max(m for m in range(1, min(micro_limit, share) + 1) if share % m == 0)
    return {"dp": dp, "micro_batch_size": micro, "grad_accum_steps": share // micro}


def suggest(cfg: JobConfig, params: int, active: int, tokens: float, dp: int = 1,
            tau_fit: TauFit | None = None, tau_c: float | None = None, routed: RoutedFit | None = None) -> dict:
    """Batch, steps, lr and weight decay for ``tokens`` from the laws, a function of the model, the config as the
    reference point and the budget only; ``dp`` (the cluster's data-parallel ranks) only sets how the batch is cut.
    """
    t = cfg.train
    seq = cfg.data.seq_len
    ref_batch = reference_batch(cfg)  # tokens per step
    ref_tokens = ref_batch * t.max_steps
    if tokens < ref_batch:
        raise ConfigError(f"--tokens {tokens:.3g} is less than one step of the reference batch ({ref_batch:,} tokens); "
                          f"give a budget of at least one step")
    law_seqs = ref_batch * (tokens / ref_tokens) ** BATCH_EXPONENT / seq
    batch_seqs, quantum = round_batch(law_seqs)
    rounding = (f"B ~ D^{BATCH_EXPONENT} gives {law_seqs:.4g} sequences, rounded to {batch_seqs}, a multiple of "
                f"{quantum}")
    if batch_seqs % dp:  # a cluster outside those the quanta cover: the nearest batch its ranks split
        q = math.lcm(quantum, dp)
        batch_seqs = max(q, q * round(law_seqs / q))
        rounding += f"; then to {batch_seqs}, a multiple of {q}, which {dp} data-parallel ranks split"
    batch = batch_seqs * seq
    steps = max(1, math.ceil(tokens / batch))
    lr = t.lr * math.sqrt(batch / ref_batch)  # AdamW's square-root rule for a changed batch
    tpp = tokens / active
    if tau_fit is not None:
        t_opt, source = tau_fit.tau_opt(tpp), f"tau_opt = {tau_fit.c:.4g} * TPP^{tau_fit.m:.3g} ({tau_fit.source})"
    elif tau_c is not None:
        t_opt, source = tau_c * tpp ** TAU_EXPONENT, f"tau_opt = {tau_c:g} * TPP^{TAU_EXPONENT} (--tau-c)"
    else:
        if t.weight_decay <= 0:
            raise ConfigError("the config's train.weight_decay is 0: it cannot serve as the reference tau; give "
                              "--tau-c or --fit a weight-decay sweep")
        ref_tau = tau(t.lr, t.weight_decay, t.max_steps)
        c = ref_tau / (ref_tokens / active) ** TAU_EXPONENT
        t_opt, source = c * tpp ** TAU_EXPONENT, (f"tau_opt = {c:.4g} * TPP^{TAU_EXPONENT}, c from the config as the "
                                                   f"reference (tau {ref_tau:.3g} at TPP {ref_tokens / active:.3g})")
    wd = 1.0 / (lr * t_opt * steps)
    cuts = [cut(batch_seqs, d, t.micro_batch_size) for d in sorted({*CUT_DP, dp}) if batch_seqs % d == 0]
    out = {"params": params, "active_params": active, "tokens": tokens, "tokens_per_param": tpp,
           "batch_tokens": batch, "batch_sequences": batch_seqs, "steps": steps, "lr": lr, "weight_decay": wd,
           "tau": t_opt, "tau_rule": source,
           "batch_rule": f"{rounding}; from the config's {ref_batch:,} tokens/step at {ref_tokens:.3g} tokens",
           "dp": dp, "cuts": cuts, "sources": list(SOURCES)}
    if cfg.model.moe.n_experts > 0 or routed is not None:
        if routed is not None:
            out["experts"], gaining = routed.favoured_experts(active)
            out["experts_rule"] = (f"routed law a={routed.a:.3g} b={routed.b:.3g} c={routed.c:.3g} d={routed.d:.3g} "
                                   f"E_start={routed.e_start:.3g} E_max={routed.e_max:.3g} (rmse of log loss "
                                   f"{routed.rmse:.2g}): " + (
                                       f"still gaining at the largest candidate, {out['experts']}: no candidate "
                                       f"reaches {SHARE_OF_GAIN:.0%} of the saturated gain, more experts would "
                                       f"help further" if gaining else
                                       f"smallest E with {SHARE_OF_GAIN:.0%} of the saturated gain"))
        else:
            out["experts_rule"] = "fit the routed law first: --fit an ablation over model.moe.n_experts at 2+ sizes"
    return out


def format_suggestion(s: dict) -> str:
    lines = [
        f"model: {s['params']:,} parameters ({s['active_params']:,} active); budget {s['tokens']:.4g} tokens "
        f"= {s['tokens_per_param']:.3g} tokens per active parameter",
        "",
        "| setting | suggested | rule |",
        "| --- | ---: | --- |",
        f"| global batch (tokens/step) | {s['batch_tokens']:,} ({s['batch_sequences']} sequences) | "
        f"{s['batch_rule']} |",
        f"| train.max_steps | {s['steps']:,} | budget / batch |",
        f"| train.lr | {s['lr']:.3g} | the config's lr x sqrt(batch / its batch) |",
        f"| train.weight_decay | {s['weight_decay']:.3g} | 1 / (lr tau steps); {s['tau_rule']} |",
    ]
    if "experts_rule" in s:
        lines.append(f"| model.moe.n_experts | {s.get('experts', '-')} | {s['experts_rule']} |")
    lines += ["", f"the batch cut over data-parallel ranks (the same batch, lr and weight decay on any cluster; "
                  f"this cluster: dp={s['dp']}):",
              "| data-parallel ranks | train.micro_batch_size | train.grad_accum_steps | |", "| ---: | ---: | ---: | --- |"]
    lines += [f"| {c['dp']} | {c['micro_batch_size']} | {c['grad_accum_steps']} | {'<- this cluster' if c['dp'] == s['dp'] else ''} |"
              for c in s["cuts"]]
    lines += ["", "constants and their sources:", *(f"- {src}" for src in s["sources"])]
    return "\n".join(lines)


def describe_fit(tau_fit: TauFit | None, routed: RoutedFit | None) -> str:
    out = []
    if tau_fit is not None:
        pts = ", ".join(f"TPP {p:.3g}: tau_opt {t:.3g}" for p, t in tau_fit.points)
        out.append(f"tau fit: c = {tau_fit.c:.4g}, m = {tau_fit.m:.3g} ({tau_fit.source}; R^2 {tau_fit.r2:.3f}; {pts})")
    if routed is not None:
        out.append(f"routed-law fit: a {routed.a:.4g}, b {routed.b:.4g}, c {routed.c:.4g}, d {routed.d:.4g}, "
                   f"E_start {routed.e_start:.3g}, E_max {routed.e_max:.3g}; rmse of log loss {routed.rmse:.2g}")
    return "\n".join(out)
