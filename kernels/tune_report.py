"""The tuner's decisions as a table a user reads: per shape class every candidate's time, the chosen one's rate
(TFLOP/s for attention and the delta rule, GB/s for the memory-bound convolution) and its floor -- the class's
FLOPs at the GPU's measured bf16 matmul rate, or its bytes at the measured copy bandwidth, whichever is longer --
so a user sees on their GPU what runs, why, and how far from the hardware it is (``hybridtron kernels``, the quick
GPU check)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridtron.kernels.tune import Decision


@dataclass
class Peaks:
    """What this device sustains, measured: bf16 matmul FLOP/s and device-to-device copy bytes/s (read + write)."""

    flops: float
    bytes_per_s: float

    def line(self) -> str:
        return (f"measured peaks: bf16 matmul {self.flops / 1e12:.0f} TFLOP/s, copy {self.bytes_per_s / 1e9:,.0f} GB/s "
                f"(read + written)")


def measure_peaks(device: torch.device, n: int = 8192, copy_bytes: int = 1 << 30, reps: int = 5) -> Peaks:
    """An n^3 bf16 matmul and a ``copy_bytes`` copy, each the best of ``reps`` after one warm-up (CUDA events)."""
    from hybridtron.kernels.tune import _time_once

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    x = torch.empty(copy_bytes // 2, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def matmul():
        a @ b

    def copy():
        y.copy_(x)

    matmul()
    copy()
    mm = min(_time_once(matmul, device) for _ in range(reps))
    cp = min(_time_once(copy, device) for _ in range(reps))
    return Peaks(2.0 * n ** 3 / (mm / 1e3), 2.0 * copy_bytes / (cp / 1e3))


def rows(found: dict[str, Decision], shapes: dict[str, tuple], peaks: Peaks | None) -> list[dict]:
    """One dict per class: op, shape, chosen, every time, the dropped ones, work, rate and floor of the choice."""
    from hybridtron.kernels.tune_cases import CASES

    out = []
    for key, d in sorted(found.items()):
        op, params = shapes[key][0], dict(shapes[key][1])
        flops, nbytes = CASES[op].work(params)
        t = d.times_ms.get(d.chosen)
        r = {"op": op, "shape": key, "chosen": d.chosen, "times_ms": dict(d.times_ms), "dropped": dict(d.dropped),
             "note": d.note, "flops": flops, "bytes": nbytes, "ms": t}
        memory_bound = op == "conv"
        if t:
            r["rate"] = nbytes / (t / 1e3) / 1e9 if memory_bound else flops / (t / 1e3) / 1e12
            r["rate_unit"] = "GB/s" if memory_bound else "TFLOP/s"
        if peaks is not None:
            r["floor_ms"] = 1e3 * max(flops / peaks.flops, nbytes / peaks.bytes_per_s)
            if t:
                r["x_floor"] = t / r["floor_ms"]
        out.append(r)
    return out


def markdown(table_rows: list[dict], peaks: Peaks | None = None) -> str:
    """The rows as a Markdown table (what ``hybridtron kernels`` prints)."""
    lines = [peaks.line()] if peaks is not None else []
    lines += ["| op | shape class | chosen | ms | rate | floor ms | x floor | every candidate (ms) / dropped |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in table_rows:
        cands = [f"{n} {t:.3f}" for n, t in sorted(r["times_ms"].items(), key=lambda kv: kv[1])]
        cands += [f"{n}: {why[:90]}" for n, why in r["dropped"].items()]
        rate = f"{r['rate']:,.0f} {r['rate_unit']}" if "rate" in r else "-"
        lines.append(f"| {r['op']} | {r['shape'].split('[', 1)[1].rstrip(']')} | {r['chosen']}"
                     f"{' (' + r['note'] + ')' if r['note'] else ''} | {_num(r['ms'])} | {rate} | "
                     f"{_num(r.get('floor_ms'))} | {_num(r.get('x_floor'), 1)} | {'; '.join(cands) or '-'} |")
    return "\n".join(lines)


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
