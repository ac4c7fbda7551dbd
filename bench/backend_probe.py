"""Which backend of an op faults on this GPU: each backend in a process of its own, forward and backward once at
a preset's shape class, against the reference.

    python -m hybridtron.bench.backend_probe                       # delta_rule at hybrid_1b's classes
    python -m hybridtron.bench.backend_probe --op delta_rule --backends triton fla --docs 0 1

Why (2026-11-28, one H200, torch 2.11, triton 3.6): ``bench_hf`` died in ``auto``'s measurement of the delta
rule with "CUDA error: an illegal memory access", reported at a later, unrelated call; a CUDA fault poisons its
process, so the candidates measured after it fail too and the traceback names none of them. Here each backend
runs alone under ``CUDA_LAUNCH_BLOCKING=1``, so a fault is reported at the launch that made it, by backend: one
line per (backend, docs, size) with the error or the time and the relative error of the output and of every
gradient against the reference (float64 at the tuner's small size; the backend's dtype at full size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# hybrid_1b's delta-rule class (configs/hybrid_1b.yaml: 16 key and value heads of 128, chunk 64, seq 4096 x 4)
PRESET = {"dtype": "bfloat16", "B": 4, "T": 4096, "Hk": 16, "Hv": 16, "Dk": 128, "Dv": 128, "n_h": 1, "chunk": 64,
          "state": False, "grad": True}


def rel_errors(got: list, want: list) -> list[float]:
    return [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, want, strict=True)]


def probe_one(op: str, backend: str, params: dict) -> list[dict]:
    """In this process: the tuner's small float64 inputs, then the full ones; stops at the first failure."""
    import torch

    from hybridtron.kernels.tune import _cases

    case = _cases()[op]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def fwd_bwd(name, ins):
        ts = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in ins.tensors]
        out = case.run(name, params, *ts)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        o = out[0] if isinstance(out, tuple) else out
        return [o.detach().double(), *[t.grad.double() for t in ts if t.grad is not None]]

    rows = []
    for small in (True, False):
        row = {"op": op, "backend": backend, "docs": params.get("docs"), "size": "small" if small else "full"}
        rows.append(row)
        t0 = time.perf_counter()
        try:
            ins = case.inputs(params, device, small=small)
            got = fwd_bwd(backend, ins)
            row["first_s"] = time.perf_counter() - t0
            row["rel_err"] = rel_errors(got, fwd_bwd("reference", ins))
            t1 = time.perf_counter()
            fwd_bwd(backend, ins)
            row["ms"] = (time.perf_counter() - t1) * 1e3
        except Exception as e:  # noqa: BLE001  (the point is to name what failed)
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            row["after_s"] = time.perf_counter() - t0
            break
    return rows


def line(row: dict) -> str:
    head = f"{row['op']} {row['backend']} docs={row['docs']} {row['size']}"
    if "error" in row:
        return f"{head}: FAILED after {row['after_s']:.1f} s: {row['error']}"
    errs = ", ".join(f"{e:.1e}" for e in row["rel_err"])
    return f"{head}: ok (first call {row['first_s']:.1f} s, then {row['ms']:.1f} ms fwd+bwd); rel. err. out, grads: {errs}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="delta_rule", choices=["delta_rule"])
    ap.add_argument("--backends", nargs="+", default=["triton", "fla"])
    ap.add_argument("--docs", nargs="+", type=int, default=[0, 1], help="without (0) and with (1) document resets")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=INT", help="change the class (e.g. B=1 T=128)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per backend and docs setting")
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: the child's JSON parameters
    args = ap.parse_args(argv)
    if args.one:
        p = json.loads(args.one)
        print("ROWS " + json.dumps(probe_one(p.pop("_op"), p.pop("_backend"), p)), flush=True)
        return 0
    base = {**PRESET, **{k: int(v) for k, v in (kv.split("=", 1) for kv in args.set)}}
    rows: list[dict] = []
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONUNBUFFERED": "1"}
    for docs in args.docs:
        for backend in args.backends:
            params = {**base, "docs": bool(docs), "_op": args.op, "_backend": backend}
            cmd = [sys.executable, "-m", "hybridtron.bench.backend_probe", "--one", json.dumps(params)]
            try:
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                found = [ln for ln in r.stdout.splitlines() if ln.startswith("ROWS ")]
                got = json.loads(found[-1][5:]) if found else [{
                    "op": args.op, "backend": backend, "docs": bool(docs), "size": "-", "after_s": 0.0,
                    "error": f"the process ended with {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:300]}"}]
            except subprocess.TimeoutExpired:
                got = [{"op": args.op, "backend": backend, "docs": bool(docs), "size": "-", "after_s": args.timeout,
                        "error": f"no answer in {args.timeout:.0f} s"}]
            for row in got:
                print(line(row), flush=True)
            rows += got
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"class": base, "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
