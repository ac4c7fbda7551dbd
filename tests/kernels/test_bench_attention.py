"""bench/kernels_attention.py on the CPU at tiny sizes under Triton's interpreter: every candidate is checked
against the float32 reference (outputs and gradients) before it is timed, the table has its columns with
causal, document-aware FLOP counts, and the 1.1x-over-SDPA-flash target gets a verdict line per shape.
(Its numbers need a GPU; this only exercises the code.)"""

from __future__ import annotations

import math

import pytest
import torch

from hybridtron.bench import kernels as bench
from hybridtron.bench import kernels_attention as ka
from hybridtron.kernels import backend
from hybridtron.kernels.gated_attention import gated_attention_reference

needs_interpreter = pytest.mark.skipif(
    not (backend.triton_installed() and backend.interpreter_requested()),
    reason="needs triton and TRITON_INTERPRET=1 (tests/kernels/conftest.py sets it)",
)
TINY = ["--device", "cpu", "--seq", "48", "--head-dim", "16", "--heads", "2", "--kv-heads", "1", "--doc-len", "8",
        "--repeats", "1"]


def test_flops_count_only_unmasked_causal_pairs():
    assert ka.causal_pairs(5) == 15
    assert ka.causal_pairs(5, torch.tensor([[0, 0, 1, 1, 1]])) == 3 + 6
    assert ka.causal_pairs(3, torch.tensor([[0, 1, 0]])) == 3  # ids are runs: the second 0 is a new document
    # forward 4 D H pairs, backward 2.5x forward
    assert ka.attention_flops(5, 2, 8, torch.tensor([[0, 0, 1, 1, 1]])) == 3.5 * 4 * 8 * 2 * 9


@needs_interpreter
def test_bench_runs_tiny_on_cpu(capsys):
    rows = ka.main(TINY)
    text = capsys.readouterr().out
    by = {(r.extra["docs"], r.impl): r for r in rows}
    assert len(rows) == 12 and {r.op for r in rows} == {"attention"}
    assert {r.impl for r in rows} == {"triton", "sdpa-flash+gate", "sdpa-cudnn+gate", "sdpa-efficient+gate",
                                      "sdpa-mask+gate", "flash-attn+gate"}
    for docs in ("none", "many"):
        ours, mask = by[(docs, "triton")], by[(docs, "sdpa-mask+gate")]
        for r in (ours, mask):
            assert r.seconds > 0 and r.peak_mib is None  # peak memory is CUDA-only
            assert r.extra["flops"] == ka.attention_flops(48, 2, 16, ka.make_doc_ids(48, 8, "cpu") if docs == "many"
                                                          else None)
            assert math.isclose(r.extra["tflops"], r.extra["flops"] / r.seconds / 1e12)
            # output and the four gradients, each within bf16 tolerance of the reference (and not trivially 0)
            assert r.extra["errors"].keys() == set(ka.TENSORS)
            assert 0 < r.max_err <= ka.TOLERANCE[torch.bfloat16], r.extra["errors"]
        assert "flash-attn runs on CUDA GPUs only" in by[(docs, "flash-attn+gate")].note
        for forced in ("sdpa-cudnn+gate", "sdpa-efficient+gate"):  # CUDA-only backends: named, not timed
            assert by[(docs, forced)].seconds is None and by[(docs, forced)].note.startswith("unavailable: ")
    assert by[("many", "triton")].extra["flops"] < by[("none", "triton")].extra["flops"]  # documents mask pairs
    assert by[("none", "sdpa-flash+gate")].seconds is not None  # SDPA's CPU flash kernel; nested causal has none
    assert by[("many", "sdpa-flash+gate")].seconds is None and by[("many", "sdpa-flash+gate")].note

    assert ("| seq | head dim | docs | candidate | fwd+bwd ms | TFLOP/s (fwd 4·D·H·pairs + bwd 2.5x fwd) | peak MiB "
            "| triton speed-up | max rel. err (out, dq, dk, dv, dgate) |") in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| 48 | 16 | none | triton |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert len(cells) == 9 and float(cells[4]) > 0 and float(cells[5]) > 0 and cells[6] == "-" and cells[7] == "1.00x"
    assert "- attention seq 48, head dim 16, no documents (outside the target's" in text
    fastest = min((r for r in rows if r.extra["docs"] == "none" and r.impl in ka.SDPA_PEERS and r.seconds),
                  key=lambda r: r.seconds)
    assert f"- attention T48 D16 no documents: {fastest.seconds / by[('none', 'triton')].seconds:.2f}x the fastest " \
           f"SDPA backend + gate ({fastest.impl}, " in text
    assert "- attention T48 D16: ours with documents " in text
    assert "- attention seq 48, head dim 16, documents (outside the target's head dims 128/256 and sequences 4k-8k): " \
           "vs SDPA-flash + gate not measured (sdpa-flash+gate: unavailable" in text


@needs_interpreter
def test_a_peer_with_wrong_gradients_is_caught_and_not_timed(monkeypatch):
    def wrong_dk(q, k, v, g, d):  # the forward is exact (k + 0 * ...), dk comes out 1.5x: a bad GQA reduction
        return gated_attention_reference(q, k + 0.5 * (k - k.detach()), v, g, doc_ids=d)

    def no_dgate(q, k, v, g, d):  # the gate's gradient never reaches it
        return gated_attention_reference(q, k, v, g.detach(), doc_ids=d)

    real = ka.candidates
    monkeypatch.setattr(ka, "candidates", lambda device: {**real(device), "wrong dk": wrong_dk, "no dgate": no_dgate})
    rows = {r.impl: r for r in ka.bench_attention([32], [16], 2, 1, ["many"], 8, torch.bfloat16, 1, torch.device("cpu"),
                                                  warmup=0)}
    tol = ka.TOLERANCE[torch.bfloat16]
    for name, tensor, err in (("wrong dk", "dk", 0.5), ("no dgate", "dgate", 1.0)):
        r = rows[name]
        assert r.seconds is None and r.note.startswith("not timed: disagrees with the reference")
        assert f"({tensor} " in r.note and "> 0.05)" in r.note, r.note  # only the bad tensor is named
        assert r.extra["errors"]["out"] <= tol  # the outputs agree: only the gradient comparison catches it
        assert r.extra["errors"][tensor] == pytest.approx(err, rel=0.05)
    assert rows["triton"].seconds is not None and rows["sdpa-mask+gate"].seconds is not None
    assert "| 32 | 16 | many | wrong dk | not timed: disagrees" in ka.report(list(rows.values()))


def _att(impl, seq, d, docs, seconds=None, note=""):
    return bench.Row("attention", f"T{seq} D{d} docs {docs}", impl, seconds=seconds, note=note,
                     extra=dict(seq=seq, head_dim=d, docs=docs))


def test_attention_verdict_per_shape():
    rows = [_att("triton", 4096, 128, "none", 1.0), _att("sdpa-flash+gate", 4096, 128, "none", 1.2),
            _att("triton", 8192, 256, "many", 1.0), _att("sdpa-flash+gate", 8192, 256, "many", 1.05),
            _att("triton", 4096, 256, "many", 1.0), _att("sdpa-flash+gate", 4096, 256, "many", note="unavailable: x"),
            _att("triton", 2048, 128, "none", 1.0), _att("sdpa-flash+gate", 2048, 128, "none", 2.0)]
    assert bench.verdicts(rows, None) == [
        "- attention seq 4096, head dim 128, no documents: 1.20x SDPA-flash + gate's speed (target >= 1.1: met)",
        "- attention seq 8192, head dim 256, documents: 1.05x SDPA-flash + gate's speed (target >= 1.1: NOT met)",
        "- attention seq 4096, head dim 256, documents: vs SDPA-flash + gate not measured (sdpa-flash+gate: "
        "unavailable: x)",
        "- attention seq 2048, head dim 128, no documents (outside the target's head dims 128/256 and sequences "
        "4k-8k): 2.00x SDPA-flash + gate's speed (target >= 1.1: met)",
    ]


def test_fastest_sdpa_verdicts():
    """The target compares ours with the fastest timed SDPA backend, whichever it is; a shape where no SDPA
    backend has a time says so; the documents ratio compares ours with itself."""
    rows = [_att("triton", 4096, 128, "none", 1.0), _att("sdpa-flash+gate", 4096, 128, "none", 1.5),
            _att("sdpa-cudnn+gate", 4096, 128, "none", 1.05), _att("sdpa-efficient+gate", 4096, 128, "none", 1.3),
            _att("flash-attn+gate", 4096, 128, "none", 0.5),  # not an SDPA backend: not the target's peer
            _att("triton", 4096, 128, "many", 0.25), _att("sdpa-flash+gate", 4096, 128, "many", note="unavailable: x"),
            _att("triton", 8192, 256, "many", 2.0), _att("sdpa-mask+gate", 8192, 256, "many", 2.4)]
    assert ka.fastest_verdicts(rows) == [
        "- attention T4096 D128 no documents: 1.05x the fastest SDPA backend + gate (sdpa-cudnn+gate, 1050.000 ms; "
        "target >= 1.1: NOT met)",
        "- attention T4096 D128 documents: vs the fastest SDPA backend + gate not measured (ours or every SDPA "
        "backend has no time)",
        "- attention T8192 D256 documents: 1.20x the fastest SDPA backend + gate (sdpa-mask+gate, 2400.000 ms; "
        "target >= 1.1: met)",
        "- attention T4096 D128: ours with documents 0.25x ours without (target <= 0.3 at 512-token documents: met)",
    ]


def test_forced_sdpa_backend_repeats_kv_where_gqa_is_refused(monkeypatch):
    """A backend that raises on enable_gqa is retried with K/V repeated per query head (then for every call),
    and computes the same gated attention."""
    calls = []
    real = ka.F.scaled_dot_product_attention

    def no_gqa(*a, enable_gqa=False, **kw):
        calls.append(enable_gqa)
        if enable_gqa:
            raise RuntimeError("No available kernel")
        return real(*a, **kw)

    (q, k, v, g), _ = ka.make_inputs(12, 4, 2, 8, torch.float32, "cpu")
    want = gated_attention_reference(q, k, v, g)
    monkeypatch.setattr(ka.F, "scaled_dot_product_attention", no_gqa)  # (torch.nn.functional's, for the test)
    fn = ka._SdpaForced("MATH")
    for _ in range(2):
        torch.testing.assert_close(fn(q, k, v, g, None), want)
    assert fn.repeated and calls == [True, False, False]
