"""The tuning case of each op ``auto`` measures on CUDA (backend.TUNED_OPS), for kernels/tune.py: the inputs of a
shape class (kernels/shape_classes.py) at full size (timed) or small (checked against the reference), the call of one
backend, the accuracy rule, and the work a class does (FLOPs and bytes, for the floors `hybridtron kernels` prints).
The ops are imported when a case runs: they import the shape classes, not this module. The synthetic inputs draw
documents of mean length ``DOC_LEN`` (packed pretraining text is
mostly shorter documents than the sequence) from their own generator, never the caller's random state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridtron.kernels.shape_classes import (  # noqa: F401  (bucket, attention_shape: tests and callers read them here too)
    _dt,
    _dtype,
    attention_shape,
    bucket,
    compute_dtype,
    conv_shape,
    delta_rule_shape,
    gate_kind,
    grad_wanted,
)
from hybridtron.kernels.testing import Bf16MatmulOperands

DOC_LEN = 512  # mean document length of the synthetic documents at full size (64 tokens at least per row of 4)
SMALL_T = 128  # the check's sequence length: several chunks and key tiles, seconds of float64 on any device


@dataclass
class Inputs:
    """A case's tensors, in the order its ``run`` takes them, and the dtype each float tensor takes in the check's
    low-precision run (the tensors are float64 for the check, already in their dtypes for timing)."""

    tensors: list[torch.Tensor]
    dtypes: list[torch.dtype | None]


def _generator(device: torch.device, seed: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def doc_ids_for(B: int, T: int, mean: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """(B, T) int64 document ids: each row cut into documents of lengths uniform in [1, 2 mean)."""
    lengths = torch.randint(1, 2 * mean, (B, T), generator=g, device=device)  # more than enough per row
    starts = torch.zeros(B, T, dtype=torch.bool, device=device)
    ends = lengths.cumsum(1)
    for b in range(B):
        cut = ends[b][ends[b] < T]
        starts[b, cut] = True
    return starts.long().cumsum(1)


def _randn(shape, dtype, g, device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)


class AttentionCase:
    """Gated causal attention (kernels/gated_attention): flash-attention's accuracy rule; the reference's
    low-precision run on torch's math SDPA (the naive softmax flash-attention's tests compare with)."""

    op = "attention"
    factor, atol = 2.0, 1e-5

    @staticmethod
    def ref_mode(params):
        if params["dtype"] in ("bfloat16", "float16"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            return lambda: sdpa_kernel([SDPBackend.MATH])
        return None

    @staticmethod
    def inputs(params: dict, device: torch.device, small: bool) -> Inputs:
        B, T, H, KV, D = (params[k] for k in ("B", "T", "H", "KV", "D"))
        if small:
            r = H // KV
            KV = min(KV, 2)
            B, T, H = (2 if params["docs"] else 1), min(T, SMALL_T), KV * r
        dtype = torch.float64 if small else _dtype(params["dtype"])
        g = _generator(device)
        ts = [_randn((B, T, H, D), dtype, g, device), _randn((B, T, KV, D), dtype, g, device),
              _randn((B, T, KV, D), dtype, g, device)]
        if params["gate"] != "none":
            ts.append(_randn((B, T, H, D) if params["gate"] == "elementwise" else (B, T, H), dtype, g, device))
        if params["docs"]:
            ts.append(doc_ids_for(B, T, 16 if small else min(DOC_LEN, max(T // 4, 1)), g, device))
        low = _dtype(params["dtype"])
        return Inputs(ts, [low if t.is_floating_point() else None for t in ts])

    @staticmethod
    def run(name: str, params: dict, q, k, v, *rest):
        from hybridtron.kernels.gated_attention import gated_attention, gated_attention_reference

        gate = rest[0] if params["gate"] != "none" else None
        doc_ids = rest[-1] if params["docs"] else None
        if name == "reference":
            return gated_attention_reference(q, k, v, gate, doc_ids=doc_ids)
        return gated_attention(q, k, v, gate, doc_ids=doc_ids, backend=name)

    @staticmethod
    def work(params: dict, full: Inputs | None = None) -> tuple[float, float]:
        """FLOPs over the causal pairs within documents (forward 4 H D per pair, backward 2.5x that) and the bytes
        of q, k, v, the gate and the output (read or written once each way)."""
        B, T, H, KV, D = (params[k] for k in ("B", "T", "H", "KV", "D"))
        pairs = B * T * (T + 1) / 2
        if params["docs"] and full is not None:
            ids = full.tensors[-1]
            lengths = torch.unique_consecutive(ids.flatten().cpu() + T * torch.arange(B).repeat_interleave(T),
                                               return_counts=True)[1].double()
            pairs = float((lengths * (lengths + 1) / 2).sum())
        flops = 4.0 * H * D * pairs * (3.5 if params["grad"] else 1.0)
        el = _dtype(params["dtype"]).itemsize
        io = B * T * D * (2 * H + 2 * KV + (H if params["gate"] == "elementwise" else 0)) * el
        return flops, io * (3.0 if params["grad"] else 1.0)


class DeltaRuleCase:
    """The chunked gated delta rule (kernels/gated_delta_rule): our kernel tests' rule, the reference's bf16 run
    multiplying bf16 operands as the kernels' tensor-core dots do. The check's write strengths lie in (0, 2)
    (negative eigenvalues), its decays are those of trained Gated DeltaNet heads in size."""

    op = "delta_rule"
    factor, atol = 3.0, None

    @staticmethod
    def ref_mode(params):
        return Bf16MatmulOperands if params["dtype"] == "bfloat16" else None

    @staticmethod
    def inputs(params: dict, device: torch.device, small: bool) -> Inputs:
        B, T, Hk, Hv, Dk, Dv, n_h = (params[k] for k in ("B", "T", "Hk", "Hv", "Dk", "Dv", "n_h"))
        if small:
            r = Hv // Hk
            B, T, Hk = min(B, 2), min(T, SMALL_T), 1
            Hv = r
        low = _dtype(params["dtype"])
        dtype, f32 = (torch.float64, torch.float64) if small else (low, torch.float32)
        g = _generator(device)
        ts = [_randn((B, T, Hk, Dk), dtype, g, device), _randn((B, T, n_h, Hk, Dk), dtype, g, device),
              _randn((B, T, n_h, Hv, Dv), dtype, g, device),
              -0.1 * torch.nn.functional.softplus(_randn((B, T, Hv), f32, g, device)),
              (2.0 if small else 1.0) * torch.sigmoid(_randn((B, T, n_h, Hv), f32, g, device))]
        dtypes = [low, low, low, torch.float32, torch.float32]
        if params["docs"]:
            ids = doc_ids_for(B, T, 16 if small else min(DOC_LEN, max(T // 4, 1)), g, device)
            resets = torch.zeros_like(ids, dtype=torch.bool)
            resets[:, 1:] = ids[:, 1:] != ids[:, :-1]
            ts.append(resets)
            dtypes.append(None)
        if params["state"]:
            ts.append(_randn((B, Hv, Dk, Dv), f32, g, device, 0.1))
            dtypes.append(torch.float32)
        return Inputs(ts, dtypes)

    @staticmethod
    def run(name: str, params: dict, q, k, v, g, beta, *rest):
        from hybridtron.kernels.gated_delta_rule import gated_delta_rule

        resets = rest[0] if params["docs"] else None
        h0 = rest[-1] if params["state"] else None
        o, final = gated_delta_rule(q, k, v, g, beta, resets=resets, initial_state=h0,
                                    output_final_state=params["state"], chunk_size=params["chunk"], backend=name)
        return (o, final) if params["state"] else (o,)

    @staticmethod
    def work(params: dict, full: Inputs | None = None) -> tuple[float, float]:
        """Approximate FLOPs of the chunked form per token, value head and sub-step (the state's read and update,
        4 Dk Dv; the chunk's products, 2 C (Dk + Dv)), backward 2x the forward; bytes of q, k, v and the output."""
        B, T, Hk, Hv, Dk, Dv, n_h, C = (params[k] for k in ("B", "T", "Hk", "Hv", "Dk", "Dv", "n_h", "chunk"))
        grad = params["grad"]
        flops = B * T * n_h * Hv * (4.0 * Dk * Dv + 2.0 * C * (Dk + Dv)) * (3.0 if grad else 1.0)
        el = _dtype(params["dtype"]).itemsize
        io = B * T * (Hk * Dk * (1 + n_h) + n_h * Hv * Dv + Hv * Dv) * el
        return flops, io * (3.0 if grad else 1.0)


class ConvCase:
    """The short causal depthwise convolution + SiLU (kernels/short_conv), run as the mixer runs it: a 16-bit
    activation with the fp32 filter under autocast. Our kernel tests' rule."""

    op = "conv"
    factor, atol = 3.0, None

    @staticmethod
    def ref_mode(params):
        return None

    @staticmethod
    def inputs(params: dict, device: torch.device, small: bool) -> Inputs:
        B, T, C, K = (params[k] for k in ("B", "T", "C", "K"))
        if small:
            B, T, C = min(B, 2), min(T, SMALL_T), min(C, 64)
        low = _dtype(params["dtype"])
        g = _generator(device)
        ts = [_randn((B, T, C), torch.float64 if small else low, g, device),
              _randn((C, 1, K), torch.float64 if small else torch.float32, g, device, K ** -0.5)]
        dtypes = [low, torch.float32]
        if params["docs"]:
            ts.append(doc_ids_for(B, T, 16 if small else min(DOC_LEN, max(T // 4, 1)), g, device))
            dtypes.append(None)
        return Inputs(ts, dtypes)

    @staticmethod
    def run(name: str, params: dict, x, w, *rest):
        import contextlib

        from hybridtron.kernels.short_conv import short_conv, short_conv_reference

        doc_ids = rest[0] if params["docs"] else None
        if name == "reference":  # in x's dtype throughout: the rule's low-precision reference
            return short_conv_reference(x, w.to(x.dtype), doc_ids)
        mixed = x.dtype in (torch.bfloat16, torch.float16) and w.dtype != x.dtype
        with torch.autocast(x.device.type, dtype=x.dtype) if mixed else contextlib.nullcontext():
            return short_conv(x, w, doc_ids, backend=name)

    @staticmethod
    def work(params: dict, full: Inputs | None = None) -> tuple[float, float]:
        """Bytes: forward reads x and writes y; backward reads dy and x and writes dx (the filter is negligible)."""
        n = params["B"] * params["T"] * params["C"] * _dtype(params["dtype"]).itemsize
        return 2.0 * params["B"] * params["T"] * params["C"] * params["K"], n * (5.0 if params["grad"] else 2.0)


CASES = {c.op: c for c in (AttentionCase, DeltaRuleCase, ConvCase)}
