"""Ring attention and the Gated DeltaNet state exchange across real gloo processes, against one device.

cp processes (spawned, gloo) each take their zig-zag piece (chunks r and 2 cp - 1 - r) of the same sequences and run
`ContextParallel.attention` through each block backend (``reference``; ``sdpa``: torch's CPU flash kernel, the one
that returns the log-sum-exp; ``triton``: our kernel under the interpreter), forward and backward; rank 0 reassembles
every rank's output and gradients in sequence order and compares them with one device's attention in float64
(explicit scores, causal and document masks: written here, not the code under test). The documents are chosen to
hit every case of the rectangles: boundaries on chunk edges, a document spanning several ranks' chunks (so a later
rank's whole block meets it), many short ones, and a second batch row without any. A Gated DeltaNet layer runs under
cp against itself on one device, at the same lengths, documents included (its state composed across chunks held
by other ranks in zig-zag order, its convolution halo gathered).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

T_SHORT, T_LONG = 96, 512


def _doc_rows(T: int) -> torch.Tensor:
    """(2, T): row 0 with boundaries on chunk edges of cp 2 and 4, a long document, short ones; row 1 one document."""
    c = T // 8  # a cp-4 chunk
    lengths = [c, 5, c - 5, 3 * c + 7, 1, 2, 3, T]
    ids, pos, i = [], 0, 0
    for n in lengths:
        n = min(n, T - pos)
        ids += [i] * n
        pos, i = pos + n, i + 1
        if pos == T:
            break
    return torch.tensor([ids, [7] * T])


def _reference(q, k, v, ids):
    """One device's causal grouped-query attention within documents, float64, explicit scores."""
    B, T, H, D = q.shape
    group = H // k.shape[2]
    kh, vh = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bthd,bshd->bhts", q, kh) * D ** -0.5
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    if ids is not None:
        mask = mask & (ids[:, None, :, None] == ids[:, None, None, :])
    return torch.einsum("bhts,bshd->bthd", s.masked_fill(~mask, float("-inf")).softmax(-1), vh)


def _gather(x, cp, n):
    """Every rank's zig-zag piece of x, reassembled in sequence order (B, T, ...)."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=cp.group)
    c = x.shape[1] // 2
    chunks = [None] * (2 * n)
    for j, p in enumerate(parts):
        chunks[j], chunks[2 * n - 1 - j] = p[:, :c], p[:, c:]
    return torch.cat(chunks, dim=1)


def _attention_cases(rank, n, cp, cases, errors):
    from hybridtron.train.parallel.context_parallel import zigzag

    for backend, T, H, KV, D, dtype_name, docs in cases:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(T + H + D)
        q, k, v = (torch.randn(2, T, h, D, generator=g, dtype=torch.float64) for h in (H, KV, KV))
        dout = torch.randn(2, T, H, D, generator=g, dtype=torch.float64)
        ids = _doc_rows(T) if docs else None
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        ref = _reference(qr, kr, vr, ids)
        (ref * dout).sum().backward()
        ql, kl, vl = (zigzag(x, n, rank).to(dtype).requires_grad_() for x in (q, k, v))
        local_ids = None if ids is None else zigzag(ids, n, rank)
        cp.begin(local_ids)
        out = cp.attention(ql, kl, vl, local_ids, backend)
        (out * zigzag(dout, n, rank).to(dtype)).sum().backward()
        got = [_gather(t.detach().double(), cp, n) for t in (out, ql.grad, kl.grad, vl.grad)]
        want = [ref.detach(), qr.grad, kr.grad, vr.grad]
        scale = [w.abs().max().item() for w in want]
        errors.append({"case": [backend, T, H, KV, D, dtype_name, docs],
                       "rel": [(a - b).abs().max().item() / s for a, b, s in zip(got, want, scale, strict=True)]})


def _deltanet_case(rank, n, cp, T, docs, errors):
    from hybridtron.configs import load_config
    from hybridtron.model.gated_deltanet import GatedDeltaNet
    from hybridtron.train.parallel.context_parallel import zigzag

    cfg = load_config("tiny", [("model.d_model", "32"), ("model.layer_pattern", "L"), ("model.n_layers", "1")]).model
    torch.manual_seed(3)
    layer = GatedDeltaNet(cfg)
    layer.init_weights(0.3, 0.3)  # larger than training's, so the state carries far across chunks
    layer.double()
    x = torch.randn(2, T, cfg.d_model, dtype=torch.float64)
    dout = torch.randn_like(x)
    ids = _doc_rows(T) if docs else None
    xr = x.clone().requires_grad_()
    ref = layer(xr, ids)
    (ref * dout).sum().backward()
    want = [ref.detach(), xr.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer.context_parallel = cp
    xl = zigzag(x, n, rank).requires_grad_()
    local_ids = None if ids is None else zigzag(ids, n, rank)
    cp.begin(local_ids)
    out = layer(xl, local_ids)
    (out * zigzag(dout, n, rank)).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    for gp in grads:  # each rank holds its piece's share of the parameter gradients
        torch.distributed.all_reduce(gp, group=cp.group)
    got = [_gather(out.detach(), cp, n), _gather(xl.grad, cp, n)] + grads
    layer.context_parallel = None
    errors.append({"case": ["deltanet", T, docs],
                   "rel": [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(got, want, strict=True)]})


def _worker(rank, n, init, out, cases, deltanet):
    import torch.distributed as dist

    from hybridtron.train.parallel.context_parallel import ContextParallel

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n)
    cp = ContextParallel(dist.group.WORLD)
    errors: list = []
    _attention_cases(rank, n, cp, cases, errors)
    for T, docs in deltanet:
        _deltanet_case(rank, n, cp, T, docs, errors)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(errors, f)
    # Free the cases' tensors and pending p2p work while the group lives: freed at interpreter exit, after the
    # group, gloo work aborted a process now and then ("terminate called without an active exception"; the same
    # as train/recipe.py avoids).
    del cp
    gc.collect()
    dist.destroy_process_group()


def _run(tmp_path, n, cases, deltanet=()):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(n, str(tmp_path / "init"), str(tmp_path / "errors.json"), cases, list(deltanet)),
             nprocs=n)
    return json.loads((tmp_path / "errors.json").read_text())


# float64 agrees to rounding (a few ulps of the sums); float32 to its own rounding
TOL = {"float64": 1e-12, "float32": 2e-5}


CASES = {  # cp: (attention cases, Gated DeltaNet cases)
    2: ([(b, T_SHORT, 4, KV, 8, "float64", docs) for b in ("reference", "sdpa") for KV in (1, 4)
         for docs in (False, True)], [(T_SHORT, True)]),
    # three boundaries between ranks' chunks, the long rows' documents across several chunks
    4: ([("reference", T_SHORT, 4, 1, 8, "float64", True), ("sdpa", T_SHORT, 4, 2, 8, "float64", False),
         ("sdpa", T_LONG, 4, 2, 16, "float64", True)], [(T_SHORT, False), (T_LONG, True)]),
}


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_attention_equals_one_device(n, tmp_path):
    cases, deltanet = CASES[n]
    results = _run(tmp_path, n, cases, deltanet)
    assert len(results) == len(cases) + len(deltanet)
    for result in results:
        tol = 1e-10 if result["case"][0] == "deltanet" else TOL[result["case"][5]]
        assert max(result["rel"]) < tol, result


@pytest.mark.slow
def test_ring_attention_through_the_triton_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import the kernels under the interpreter
    cases = [("triton", 48, 4, KV, 16, "float32", docs) for KV in (1, 2) for docs in (False, True)]
    for result in _run(tmp_path, 2, cases):
        assert max(result["rel"]) < TOL["float32"], result
