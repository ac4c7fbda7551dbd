"""The vocabulary-parallel fused linear cross-entropy on two gloo processes: each holds an uneven shard of the
head's rows, and together they give one process's loss, the full dh on every rank, and each shard's dW."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from hybridtron.kernels.cross_entropy import linear_cross_entropy_reference, vocab_parallel_linear_cross_entropy

N, D, V, Z = 13, 8, 37, 1e-3
SPLIT = (0, 19, V)  # rank 0: rows 0..18, rank 1: rows 19..36 (uneven)


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = -100
    labels[1], labels[2] = 0, V - 1  # targets at both ends, on different ranks
    return h, w, labels


def _all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        h, w, labels = _inputs()
        lo, hi = SPLIT[rank], SPLIT[rank + 1]
        results = {}
        for backend in ("reference", "triton"):
            hh = h.clone().requires_grad_()
            shard = w[lo:hi].clone().requires_grad_()
            loss = vocab_parallel_linear_cross_entropy(hh, shard, labels, vocab_start=lo, all_reduce=_all_reduce,
                                                       z_loss=Z, chunk_size=5, backend=backend)
            loss.backward()
            results[backend] = (loss.detach(), hh.grad, shard.grad)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one_process(tmp_path):
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/kernels/conftest.py; the workers inherit it
    # Two processes running this file as a script (a pytest module cannot be imported by name in a child).
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(tmp_path / "init"), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    h, w, labels = _inputs()
    h.requires_grad_()
    w.requires_grad_()
    ref = linear_cross_entropy_reference(h, w, labels, z_loss=Z)
    ref.backward()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        lo, hi = SPLIT[rank], SPLIT[rank + 1]
        for backend, (loss, dh, dw) in got.items():
            where = f"rank {rank}, {backend}"
            assert torch.allclose(loss, ref.detach(), rtol=1e-5, atol=1e-6), (where, loss, ref)
            assert torch.allclose(dh, h.grad, rtol=1e-4, atol=1e-6), (where, (dh - h.grad).abs().max())
            assert torch.allclose(dw, w.grad[lo:hi], rtol=1e-4, atol=1e-6), (where, (dw - w.grad[lo:hi]).abs().max())


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
