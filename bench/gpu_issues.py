"""Every GPU measurement of the three speed targets (the hybrid step and the delta rule, the MoE step, the dense step
and gated attention), one after another on one CUDA GPU, each command's output kept in its own log:

    python -m hybridtron.bench.gpu_issues                    # all of them, in order
    python -m hybridtron.bench.gpu_issues --only delta_rule_conv moe_kernels
    python -m hybridtron.bench.gpu_issues --dry-run          # the commands, not run

What each command measures and the target it is judged against are in bench/RESULTS.md (its verdict lines say
met / NOT met). The kernel benches do not append to bench/RESULTS.md from here (``--no-append``): their tables are
in the logs; the training benches print their rows and the preset's MFU verdict. A command that fails or runs past
``--timeout`` is reported and the next one runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# (name, module under hybridtron.bench, arguments). Kernel shapes are each bench's defaults: the presets' widths.
COMMANDS: list[tuple[str, str, list[str]]] = [
    # the chunked gated delta rule against fla (T 4k/8k/16k x batch 1/4 x packed documents), the short convolution
    ("delta_rule_conv", "kernels", ["--ops", "delta_rule", "conv", "--no-append"]),
    # gated attention against every SDPA backend, and the memory-bound kernels of the dense step
    ("dense_kernels", "kernels", ["--ops", "attention", "norm", "rotary", "swiglu", "--no-append"]),
    ("attention_grid", "kernels_attention", ["--seq", "4096", "8192", "16384", "--head-dim", "128", "256",
                                             "--docs", "none", "many"]),
    # the grouped GEMM, the permutation and the MoE layer (both gather paths) against a dense SwiGLU
    ("moe_kernels", "kernels", ["--ops", "grouped_gemm", "moe_permute", "moe_layer", "--no-append"]),
    # hybrid_1b against transformers' Qwen3.5 with fla's kernels
    ("hf_hybrid", "bench_hf", ["--preset", "hybrid_1b"]),
    # the presets end to end: as configured (no recompute; dense_1b compiled), and the other mode beside it
    ("train_dense", "bench_train", ["--preset", "dense_1b", "--variants", "ddp", "ddp_eager:train.compile=false"]),
    ("train_hybrid", "bench_train", ["--preset", "hybrid_1b", "--variants", "ddp"]),
    ("train_moe", "bench_train", ["--preset", "hybrid_moe", "--variants", "ddp",
                                  "ddp_full:train.activation_checkpointing=full"]),
    # the tests that need CUDA: the MoE layer under CUDA's sync check, megablocks' and the sm90 grouped GEMM
    ("gpu_tests", "pytest", ["-q", "tests/model/test_moe.py", "-k", "gpu or megablocks"]),
]
NAMES = [name for name, _, _ in COMMANDS]


def command(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module if module == "pytest" else f"hybridtron.bench.{module}", *args]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=NAMES, help="run these commands only (default: all, in order)")
    ap.add_argument("--out", type=Path, default=Path("gpu-results"), help="directory for one log per command")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds each command may run")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    args = ap.parse_args(argv)
    chosen = [c for c in COMMANDS if not args.only or c[0] in args.only]
    if args.dry_run:
        for name, module, extra in chosen:
            print(f"{name}: {' '.join(command(module, extra))}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_issues: no CUDA device here; these are GPU measurements (--dry-run lists them)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, module, extra in chosen:
        log = args.out / f"{name}.log"
        cmd = command(module, extra)
        print(f"== {name}: {' '.join(cmd)} (log {log})", flush=True)
        t0 = time.monotonic()
        # the test suite turns the Triton interpreter on unless the environment says otherwise: here it must not
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        with log.open("w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, env=env).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"   {name}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    print(f"{len(chosen) - len(failed)} of {len(chosen)} commands ended cleanly"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
