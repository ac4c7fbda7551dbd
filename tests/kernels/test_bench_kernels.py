"""bench/kernels.py on the CPU at tiny sizes: it checks candidates against ours, prints the table with the
targets' verdicts and appends it to a results file. (Its numbers need a GPU; this only exercises the code.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtron.bench import kernels as bench
from hybridtron.model import moe

TINY_MOE = ["--moe-d-model", "16", "--moe-experts", "4", "--moe-top-k", "2", "--moe-hidden", "8"]
TINY_CONV = ["--conv-seq", "12", "--conv-batch", "2", "--conv-dim", "16", "--conv-size", "4"]


def test_bench_runs_tiny_on_cpu_and_appends(tmp_path, capsys):
    out = tmp_path / "RESULTS.md"
    out.write_text("# Measured results\n")
    rows = bench.main(["--device", "cpu", "--dtype", "float32", "--no-compile", "--tokens", "8", "--d-model", "16",
                       "--ffn-hidden", "24", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                       "--rotary-fraction", "0.5", "--vocab", "40", "--ce-tokens", "6", "--dr-seq", "20",
                       "--dr-batch", "1", "2", "--dr-doc-len", "5",
                       "--dr-heads", "2", "--dr-head-dim", "16", "--dr-chunk", "16", "--repeats", "2",
                       "--warmup", "0", "--append", str(out), *TINY_MOE, *TINY_CONV])
    timed = {(r.op, r.impl) for r in rows if r.seconds is not None}
    for op in ("norm", "rotary", "swiglu"):
        assert (op, "torch eager") in timed and (op, "triton (ours)") in timed
    assert ("cross_entropy", "triton (ours, chunked)") in timed
    assert ("delta_rule", "triton (ours)") in timed and ("delta_rule", "torch eager (reference)") in timed
    assert "| delta_rule | B1 T20 H2 D16 C16 float32 | fla chunk_gated_delta_rule | fla unavailable" in out.read_text()
    # the sweep over --dr-seq x --dr-batch x --dr-docs: each is its own case, with its own verdict line (fla is not
    # installed here); packed documents name their mean length and count
    dr_shapes = {r.shape for r in rows if r.op == "delta_rule"}
    assert len(dr_shapes) == 4 and {"B1 T20 H2 D16 C16 float32", "B2 T20 H2 D16 C16 float32"} <= dr_shapes
    assert sum(" docs~5 (" in sh for sh in dr_shapes) == 2
    for sh in dr_shapes:
        assert (f"- delta_rule {sh} (outside the target's head dim 128, sequences 4k-16k and batches 1, 4): "
                f"vs fla not measured (fla chunk_gated_delta_rule: fla unavailable") in out.read_text()
    for op in ("conv", "moe_permute"):
        assert (op, "torch eager") in timed and (op, "triton (ours)") in timed
    # every timed peer agrees with our kernel (fp32): the check runs before timing; rate baselines are not compared
    assert all(r.max_err is not None and r.max_err < 1e-4 for r in rows if r.seconds is not None
               and "rate baseline" not in r.impl), rows
    assert {r.op for r in rows if r.shape.endswith("gated (delta-rule output)") and r.impl == "triton (ours)"} == {
        "norm"}  # the delta-rule mixer's gated norm is its own norm case
    text = out.read_text()
    assert text.startswith("# Measured results\n") and "## Fused kernels, CPU" in text
    assert "| norm | 8x16 float32 +residual | triton (ours) |" in text
    assert "torch.compile skipped (--no-compile)" in text
    assert "- cross_entropy: " in text and "appended to" in capsys.readouterr().out


def test_verdicts_say_met_or_not():
    rows = [
        bench.Row("norm", "s", "triton (ours)", seconds=1.0, extra={"gbs": 3000.0}),
        bench.Row("norm", "s", "torch.compile", seconds=1.5),
        bench.Row("swiglu", "s", "triton (ours)", seconds=2.0, extra={"gbs": 2000.0}),
        bench.Row("swiglu", "s", "torch.compile", seconds=1.0),
        bench.Row("cross_entropy", "s", "triton (ours, chunked)", seconds=1.05, peak_mib=100.0),
        bench.Row("cross_entropy", "s", "plain (logits + F.cross_entropy)", seconds=1.0, peak_mib=1000.0),
    ]
    rows += [bench.Row("delta_rule", "s", "triton (ours)", seconds=1.2),
             bench.Row("delta_rule", "s", "fla chunk_gated_delta_rule", seconds=1.0)]
    rows += [bench.Row("conv", "c", "triton (ours)", seconds=1.0, extra={"gbs": 2000.0}),
             bench.Row("conv", "c", "causal-conv1d", seconds=1.5)]
    rows += [bench.Row("grouped_gemm", "s", bench.GG_OURS, seconds=1.2),
             bench.Row("grouped_gemm", "s", bench.GG_DENSE, seconds=1.0)]
    lines = bench.verdicts(rows, copy_gbs=3300.0)
    assert "- grouped_gemm: ours at 83% of the dense matmul's TFLOP/s (target >= 80%: met)" in lines
    assert "- delta_rule s: 1.20x fla's time (target <= 0.8: NOT met)" in lines
    assert "- conv c: 61% of copy bandwidth (target >= 70%: NOT met); 1.50x causal-conv1d's speed" in lines
    assert lines[0] == ("- norm: 91% of copy bandwidth (target >= 85%: met); 1.50x torch.compile's speed "
                        "(target > 1: met)")
    assert "61% of copy bandwidth (target >= 85%: NOT met)" in lines[1] and "0.50x" in lines[1]
    assert lines[2] == ("- cross_entropy: 1.05x the plain path's time (target <= 1.1: met); 10% of its peak "
                        "memory (target <= 15%: met)")


def _grouped_gemm_rows(tmp_path):
    out = tmp_path / "RESULTS.md"
    rows = bench.main(["--device", "cpu", "--dtype", "float32", "--ops", "grouped_gemm", "--tokens", "48",
                       *TINY_MOE, "--repeats", "2", "--warmup", "0", "--append", str(out)])
    return {r.impl: r for r in rows}, out.read_text()


def test_grouped_gemm_matches_the_loop_and_rates_against_dense(tmp_path):
    rows, text = _grouped_gemm_rows(tmp_path)
    ours, loop, dense = rows[bench.GG_OURS], rows[bench.GG_LOOP], rows[bench.GG_DENSE]
    assert all(r.seconds is not None and r.rate.endswith("TFLOP/s") for r in (ours, loop, dense))
    # uneven routing, and ours went through torch._grouped_mm (not the per-expert fallback the loop equals)
    shape = ours.shape
    assert "N48 E4 top2 d16 I8 float32: 96 rows" in shape and "native = torch._grouped_mm" in shape, shape
    lo, hi = map(int, shape.split("expert load ")[1].split(";")[0].split("-"))
    assert lo < hi
    assert loop.max_err is not None and loop.max_err < 1e-5  # outputs and gradients of x, h and both weights
    assert dense.max_err is None  # a rate baseline: different weights, nothing to compare
    assert rows[bench.GG_MEGABLOCKS].seconds is None and "megablocks" in rows[bench.GG_MEGABLOCKS].note
    assert "- grouped_gemm: ours at " in text and "of the dense matmul's TFLOP/s (target >= 80%: " in text
    assert f"| {bench.GG_DENSE} | " in text


def test_grouped_gemm_catches_a_wrong_grouped_matmul(tmp_path, monkeypatch):
    def experts_reversed(x, weight, offsets, backend, counts=None):  # a plausible bug: block e times weight[E-1-e]
        return moe.grouped_linear(x, weight.flip(0), offsets, backend, counts)

    monkeypatch.setattr(bench, "grouped_linear", experts_reversed)
    rows, _ = _grouped_gemm_rows(tmp_path)
    assert rows[bench.GG_LOOP].max_err > 1e-2


@pytest.mark.parametrize("dense_s, verdict", [(0.7, "70%"), (1.0, "100%")])
def test_grouped_gemm_verdict(dense_s, verdict):
    rows = [bench.Row("grouped_gemm", "s", bench.GG_OURS, seconds=1.0),
            bench.Row("grouped_gemm", "s", bench.GG_DENSE, seconds=dense_s),
            bench.Row("grouped_gemm", "s", bench.GG_MEGABLOCKS, seconds=0.5)]
    (line,) = bench.verdicts(rows, copy_gbs=None)
    met = "met" if dense_s >= 0.8 else "NOT met"
    assert line == (f"- grouped_gemm: ours at {verdict} of the dense matmul's TFLOP/s (target >= 80%: {met}); "
                    f"megablocks' gmm at {round(200 * dense_s)}%")


def test_moe_layer_matches_the_loop_and_rates_against_dense_swiglu(tmp_path):
    out = tmp_path / "RESULTS.md"
    rows = bench.main(["--device", "cpu", "--dtype", "bfloat16", "--ops", "moe_layer", "--tokens", "24", *TINY_MOE,
                       "--moe-shared", "8", "--repeats", "1", "--warmup", "0", "--append", str(out)])
    by = {r.impl: r for r in rows}
    assert all(by[n].seconds is not None and by[n].rate.endswith("TFLOP/s")
               for n in (bench.ML_OURS, bench.ML_LOOP, bench.ML_FP32, bench.ML_DENSE))
    assert by[bench.ML_LOOP].max_err is not None and by[bench.ML_LOOP].max_err < 2e-2  # bf16 output, grads of x
    assert by[bench.ML_DENSE].max_err is None and by[bench.ML_FP32].max_err is None  # rate baselines
    assert "- moe_layer: " in out.read_text() and "x the dense SwiGLU's time" in out.read_text()


def test_moe_layer_verdict():
    rows = [bench.Row("moe_layer", "s", bench.ML_OURS, seconds=1.2), bench.Row("moe_layer", "s", bench.ML_DENSE,
                                                                               seconds=1.0),
            bench.Row("moe_layer", "s", bench.ML_FP32, seconds=6.0)]
    (line,) = bench.verdicts(rows, copy_gbs=None)
    assert line == ("- moe_layer: 1.20x the dense SwiGLU's time at the same active FLOPs (target <= 1.3: met); "
                    "the fp32-expert path 5.00x ours")


def _fake_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
    """causal-conv1d's documented contract (x (B, C, T), weight (C, K); seq_idx (B, T) int32: a tap never reads
    another sequence's input), to check our adapter's layouts and documents on the CPU."""
    assert x.stride(1) == 1 and weight.dim() == 2  # handed our (B, T, C) as its channel-last view, no copy
    B, C, T = x.shape
    assert seq_idx is None or (seq_idx.dtype == torch.int32 and seq_idx.shape == (B, T))
    K = weight.shape[1]
    y = torch.zeros_like(x) if bias is None else bias[:, None].expand_as(x).clone()
    for j in range(K):  # tap j reads x[t - s], s = K - 1 - j
        s = K - 1 - j
        xs = F.pad(x, (s, 0))[..., :T]
        if seq_idx is not None and s:
            same = torch.zeros(B, T, dtype=torch.bool)
            same[:, s:] = seq_idx[:, s:] == seq_idx[:, :-s]
            xs = xs * same[:, None]
        y = y + xs * weight[:, j, None]
    return F.silu(y) if activation == "silu" else y


def test_conv_and_moe_permute_run_tiny_under_the_interpreter(tmp_path, monkeypatch):
    assert "causal-conv1d" in bench._causal_conv1d(torch.device("cpu"))  # a reason, not a function, here
    monkeypatch.setattr(bench, "_causal_conv1d", lambda device: _fake_causal_conv1d_fn)
    out = tmp_path / "RESULTS.md"
    # --no-compile: inductor on the CPU would take most of the time budget; the compile peer is listed as skipped
    rows = bench.main(["--device", "cpu", "--dtype", "float32", "--no-compile", "--ops", "conv", "moe_permute",
                       "--tokens", "6", *TINY_MOE, *TINY_CONV, "--dr-doc-len", "3", "--repeats", "1", "--warmup", "0", "--append", str(out)])
    # conv: --conv-batch 2, without and with documents (causal-conv1d given them as seq_idx)
    assert [r.shape for r in rows if r.op == "conv" and r.impl == "triton (ours)"] == [
        "B2 T12 C16 K4 float32", "B2 T12 C16 K4 docs~3 float32"]
    for r in rows:  # outputs and the gradients of x, w (conv) or x, ys, router weights (moe) agree with ours
        if (r.op, r.impl) in {("conv", "torch eager"), ("conv", "causal-conv1d"), ("conv", "triton (ours)"),
                              ("moe_permute", "torch eager"), ("moe_permute", "triton (ours)")}:
            assert r.seconds is not None and r.max_err is not None and r.max_err < 1e-4, r
            assert r.rate.endswith("GB/s"), r
    assert all(r.max_err > 0 for r in rows if (r.op, r.impl) == ("conv", "torch eager"))  # compared with ours
    text = out.read_text()
    assert "| conv | B2 T12 C16 K4 float32 | causal-conv1d | " in text
    assert "- conv B2 T12 C16 K4 docs~3 float32: " in text and "x causal-conv1d's speed" in text
    assert "| moe_permute | N6 E4 top2 d16 float32 | triton (ours) | " in text
    assert "| moe_permute | N6 E4 top2 d16 float32 | torch.compile | torch.compile skipped" in text


def test_delta_rule_verdicts_per_shape():
    def shape_rows(seq, head_dim, ours_s, fla):
        shape, x = f"T{seq} D{head_dim}", {"seq": seq, "head_dim": head_dim}
        fla_row = (bench.Row("delta_rule", shape, bench.DR_FLA, seconds=fla, extra=x) if isinstance(fla, float)
                   else bench.Row("delta_rule", shape, bench.DR_FLA, note=fla, extra=x))
        return [bench.Row("delta_rule", shape, bench.DR_OURS, seconds=ours_s, extra=x), fla_row]

    rows = (shape_rows(4096, 128, 0.75, 1.0) + shape_rows(16384, 128, 0.9, 1.0) + shape_rows(2048, 64, 1.0, 2.0)
            + shape_rows(8192, 128, 1.0, "fla unavailable (x)"))
    rows[0].peak_mib, rows[1].peak_mib = 120.0, 100.0  # ours 1.2x fla's memory at T4096: the time is met, not it
    assert bench.verdicts(rows, copy_gbs=None) == [  # one line per shape, in run order: none overwrites another
        "- delta_rule T4096 D128: 0.75x fla's time (target <= 0.8: met); 1.20x its peak memory (target <= 1: NOT met)",
        "- delta_rule T16384 D128: 0.90x fla's time (target <= 0.8: NOT met)",
        "- delta_rule T2048 D64 (outside the target's head dim 128, sequences 4k-16k and batches 1, 4): 0.50x fla's "
        "time (target <= 0.8: met)",
        "- delta_rule T8192 D128: vs fla not measured (fla chunk_gated_delta_rule: fla unavailable (x))",
    ]


def test_packed_documents_stay_inside_their_rows_and_match_the_reference():
    cu = bench.packed_cu_seqlens(3, 50, 8, seed=1)
    assert cu[0] == 0 and cu[-1] == 150 and bool((cu[1:] > cu[:-1]).all())
    assert {50, 100} <= set(cu.tolist())  # every row's end is a document end: none crosses into the next row
    lengths = cu[1:] - cu[:-1]
    assert int(lengths.max()) < 16 and len(lengths) > 150 // 16
    # the packed case's reference and ours see the same documents: the row of B x T tokens with resets equals the
    # rows computed one document at a time (ours is checked against the reference inside run_case)
    case = bench.delta_rule_case(12, 2, 8, 16, torch.float64, torch.device("cpu"), False, False, batch=2, doc_len=4)
    q, k, v, g, beta = case.inputs
    assert q.shape[:2] == (1, 24) and case.extra == {"seq": 12, "head_dim": 8, "batch": 2, "docs": True}
    got = case.candidates["torch eager (reference)"](q, k, v, g, beta)
    cu = bench.packed_cu_seqlens(2, 12, 4)
    from hybridtron.kernels.gated_delta_rule import delta_rule_chunked
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = delta_rule_chunked(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], chunk_size=16)[0]
        torch.testing.assert_close(got[:, a:b], want)


class _InPlaceSiLUMul(torch.autograd.Function):
    """silu(g) * u computed right, but as Liger's SwiGLU does it: the backward stores the gradients in the saved
    inputs and hands those back; it also scales the cotangent it was handed in place, so every tensor a
    candidate is given gets written."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        sig = torch.sigmoid(g)
        dg = dy * u * sig * (1 + g * (1 - sig))
        du = dy * F.silu(g)
        g.copy_(dg)  # in place into the saved inputs, as Liger's kernel does
        u.copy_(du)
        dy.mul_(3.0)  # and into the cotangent it was handed
        return g, u


def test_an_in_place_peer_changes_no_other_candidates_data(monkeypatch):
    """The peer runs before ours (candidate order: eager, compile, liger, ours). With shared inputs its
    backward would leave gradients in g and u and a scaled cotangent, and our own row would differ from our
    reference run; with private copies it stays exactly 0, and the peer itself is still checked correctly."""
    monkeypatch.setattr(bench, "_liger", lambda name: _InPlaceSiLUMul)
    case = bench.swiglu_case(8, 24, torch.float32, torch.device("cpu"), compile_peers=False, ours=True)
    shared = [t.clone() for t in case.inputs]
    rows = {r.impl: r for r in bench.run_case(case, torch.device("cpu"), repeats=2, warmup=1, copy_gbs=None)}
    assert rows["triton (ours)"].max_err == 0.0, rows["triton (ours)"]
    assert rows["liger"].seconds is not None and rows["liger"].max_err < 1e-5, rows["liger"]
    assert rows["torch eager"].max_err < 1e-5
    for before, after in zip(shared, case.inputs, strict=True):  # the case's own tensors are never written
        assert torch.equal(before, after.detach())
