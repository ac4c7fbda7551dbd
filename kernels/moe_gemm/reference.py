"""Pure-torch forms of the MoE expert kernels in this folder, the formulas the Triton kernels are tested against.

Rows are the N k (token, expert) assignments sorted by expert (``order`` from kernels/moe_permute's
``sort_assignments``): row r is token ``order[r] // k``, and the rows of expert e are ``offsets[e-1]:offsets[e]``
(``offsets`` the running per-expert counts, ``offsets[-1] = N k``).

    gathered_linear  h[r] = x[order[r] // k] @ weight[e].T     the gate_up projection, reading the token
                                                               rows through ``order`` (no permuted copy)
    swiglu_packed    y    = silu(h[:, :I]) * h[:, I:]          the expert activation on the gate_up
                                                               projection's output, [gate | up] halves
"""

from __future__ import annotations

import torch

from hybridtron.kernels.swiglu.reference import swiglu_reference


def swiglu_packed_reference(h: torch.Tensor) -> torch.Tensor:
    """h (..., 2 I) holding [gate | up] -> (..., I): ``silu(gate) * up``, as the dense SwiGLU's reference."""
    gate, up = h.chunk(2, dim=-1)
    return swiglu_reference(gate, up)


def gathered_linear_reference(x: torch.Tensor, order: torch.Tensor, top_k: int, weight: torch.Tensor,
                              offsets: torch.Tensor) -> torch.Tensor:
    """x (N, d), weight (E, out, d), offsets (E,) -> (N k, out): the permuted rows, then one matmul per expert.
    Reads the per-expert counts to the host (a ground truth for tests, not a training path: MoE.forward takes the
    permutation and torch's grouped GEMM where this kernel is not chosen)."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long()).tolist()
    xs = x[order // top_k]
    # unbind, not weight[e]: each indexing would hand the backward a zero gradient of the whole weight to add up
    return torch.cat([xe @ we.T for xe, we in zip(xs.split(counts), weight.unbind(0), strict=True)])
