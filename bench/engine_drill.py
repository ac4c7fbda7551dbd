"""Before/after drill for changes to the engine or the layouts: every engine and layout the suite covers trains a
few steps with this checkout and with another, and resumes; losses, gradient norms and validation losses are
compared bitwise.

    python -m hybridtron.bench.engine_drill --before DIR                # every layout, this checkout against DIR's
    python -m hybridtron.bench.engine_drill --before DIR ddp pp2_1f1b   # some of them

``--before DIR``: a directory holding the other version of the package as ``DIR/hybridtron`` (e.g. ``mkdir -p
/tmp/old/hybridtron && git archive 8e32594 | tar -x -C /tmp/old/hybridtron``), run with ``PYTHONPATH=DIR``. Each
layout runs 4 steps (2 micro-batches each, a checkpoint and an evaluation every 2), then the step-4 checkpoint is
removed and the same command resumes from step 2 to 4: the resumed step 4 must equal the uninterrupted one. One
line per layout: whether before == after bitwise, whether each version's resume matched, and the last step's
(step, loss, grad norm, val loss). One OMP thread per process, so the numbers do not depend on the machine's load.
On a 2-core machine all of them take about 10 minutes (2026-11-29: 10 min 20 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SMALL = ["--data.sources", "[{path: stdlib, max_files: 40}]", "--data.tokenizer.vocab_size", "512",
         "--data.seq_len", "64", "--model.max_seq_len", "128", "--model.d_model", "64", "--model.n_layers", "2",
         "--model.n_heads", "4", "--model.n_kv_heads", "2", "--train.eval_batches", "4", "--data.val_fraction", "0.1",
         "--train.progress_bar", "false", "--train.max_steps", "4", "--checkpoint.every", "2",
         "--train.eval_every", "2", "--train.micro_batch_size", "4", "--train.warmup_steps", "1",
         "--train.grad_accum_steps", "2", "--train.log_every", "1"]
MOE = ["--model.moe.n_experts", "4", "--model.moe.top_k", "2", "--model.moe.expert_hidden", "32"]
LAYOUTS = {  # name: (processes, settings)
    "single": (1, []),
    "ddp": (2, ["--parallel.zero_stage", "0"]),
    "zero2": (2, ["--parallel.zero_stage", "2"]),
    "zero3": (2, ["--parallel.zero_stage", "3"]),
    "hsdp": (4, ["--parallel.zero_stage", "3", "--parallel.dp_shard", "2"]),
    "tp2": (2, ["--parallel.tp", "2"]),
    "pp2_1f1b": (2, ["--parallel.pp", "2", "--parallel.zero_stage", "0"]),
    "pp2_interleaved": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved_1f1b", "--model.n_layers",
                            "4", "--parallel.pp_stages_per_rank", "2", "--parallel.zero_stage", "0"]),
    "pp2_zero3": (2, ["--parallel.pp", "2", "--parallel.zero_stage", "3", "--parallel.dp", "1"]),
    "pp2_dp2_zero3": (4, ["--parallel.pp", "2", "--parallel.zero_stage", "3", "--train.micro_batch_size", "2"]),
    "cp2": (2, ["--parallel.cp", "2"]),
    "ep2": (2, ["--parallel.ep", "2", *MOE]),
    **{f"ds_zero{z}": (2, ["--parallel.engine", "deepspeed", "--parallel.zero_stage", str(z)]) for z in range(4)},
}


def _run(layout: str, run_dir: Path, data: Path, before: Path | None) -> tuple[list | None, str]:
    """Train ``layout`` into ``run_dir`` (resuming what is there); (the metrics' (step, loss, grad_norm, val_loss)
    rows, or None, and the output's tail when it failed)."""
    n, settings = LAYOUTS[layout]
    argv = ["train", "--config", "tiny", "--run-dir", str(run_dir), "--data.out_dir", str(data), *SMALL, *settings]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if before is not None:
        env["PYTHONPATH"] = str(before)
    cmd = [sys.executable, "-m", "hybridtron.cli", *argv] if n == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "hybridtron.cli",
        *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=run_dir.parent)
    if done.returncode != 0:
        return None, (done.stdout + done.stderr)[-1500:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"], r.get("grad_norm"), r.get("val_loss")) for r in rows], ""


def _train_and_resume(layout: str, run_dir: Path, data: Path, before: Path | None) -> dict:
    full, err = _run(layout, run_dir, data, before)
    if full is None:
        return {"error": err}
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints / "step_00000004")
    (checkpoints / "latest").write_text("step_00000002")
    resumed, err = _run(layout, run_dir, data, before)
    return {"rows": full, "resumed": resumed is not None and resumed[-1] == full[-1], "resume_error": err}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a directory holding the other version as "
                        "DIR/hybridtron")
    parser.add_argument("layouts", nargs="*", metavar="LAYOUT", help=f"some of: {', '.join(LAYOUTS)} (default: all)")
    args = parser.parse_args(argv)
    if not (args.before / "hybridtron" / "__init__.py").is_file():
        parser.error(f"--before {args.before} holds no hybridtron package (DIR/hybridtron/__init__.py)")
    if unknown := [name for name in args.layouts if name not in LAYOUTS]:
        parser.error(f"unknown layout {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="engine-drill-") as tmp:
        data = Path(tmp) / "data"
        for layout in args.layouts or LAYOUTS:
            got = {which: _train_and_resume(layout, Path(tmp) / f"{layout}-{which}", data, before)
                   for which, before in (("before", args.before), ("after", None))}
            errors = [f"{which}: {g['error']}" for which, g in got.items() if "error" in g]
            if errors:
                print(f"{layout}: FAILED\n" + "\n".join(errors), flush=True)
                failed += 1
                continue
            same = got["before"]["rows"] == got["after"]["rows"]
            resumed = {which: g["resumed"] for which, g in got.items()}
            failed += not (same and resumed["after"])
            print(f"{layout}: before == after bitwise: {same}; resumed to the same step 4 (before, after): "
                  f"{resumed['before']}, {resumed['after']}; last {got['after']['rows'][-1]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
