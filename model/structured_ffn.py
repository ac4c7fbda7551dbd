"""Structured feed-forward layers (Wei et al., "Building on Efficient Foundations: Effectively Training
LLMs with Structured Feedforward Layers").

Each of the SwiGLU's three matrices W (out x in) is replaced by a structured product:

- ``lowrank``:      W = U V                   U (out, r), V (r, in)
- ``blockdense``:   W = U B                   B block-diagonal, n blocks of (r/n, in/n): ``blocks``
                                              (n, r/n, in/n); then U (out, r) dense
- ``blockshuffle``: W = B2 P B1               B1 block-diagonal (n blocks of (m/n, in/n)): ``blocks1``;
                                              P the stride shuffle of the m middle channels; B2
                                              block-diagonal (n blocks of (out/n, m/n)): ``blocks2``

with m = min(in, out). The shuffle reads the middle channels (block i, index j) in the order (j, i), so
each second-stage block sees channels from every first-stage block (as in Monarch matrices); without
it the product would stay block-diagonal. Forwards are batched matmuls over the blocks.

Initialisation: LowRank by SVD: draw the dense N(0, std^2) matrix W the dense layer would get and keep
its best rank-r approximation, U = U_r sqrt(S_r), V = sqrt(S_r) V_r^T. The block variants use
orthogonal blocks, scaled so the product's output has the dense layer's scale: a dense N(0, std^2)
(out x in) map sends a unit-variance input to outputs of variance in * std^2. An orthogonal (p x q)
block has unit rows when p <= q (each output keeps the input's variance) and rows of squared norm q/p
when p > q; the first stage is scaled to unit variance per middle channel and the last factor carries
the sqrt(in) * std gain.

Self-guided training: a dense ``dense`` (out, in) weight, initialised to the structured product, trains
beside the factors and the output is ``alpha * x W_dense^T + (1 - alpha) * structured(x)``. alpha
follows a cosine from 1 to 0 over model.ffn.self_guided_fraction of training (`self_guided_alpha`, a
function of the step alone); at 0 `drop_self_guided` deletes the dense weights (the train loop removes
them from the optimizer too), leaving the structured layer alone.

`dense_equivalent` gives a layer's effective (out, in) matrix and `dense_state_dict` the whole model's
state dict in the plain SwiGLU layout (``gate_proj.weight`` ...), which a dense-config GatedLM loads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.configs import ModelConfig

FACTOR_NAMES = ("U", "V", "blocks", "blocks1", "blocks2", "dense")


def default_rank(kind: str, in_features: int, out_features: int, rank: int, n_blocks: int) -> int:
    if rank:
        return rank
    r = min(in_features, out_features) // 2
    if kind == "blockdense":
        r = max(n_blocks, r // n_blocks * n_blocks)
    return max(r, 1)


def block_diag_apply(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x (..., n q) through a block-diagonal matrix of blocks (n, p, q) -> (..., n p)."""
    n, p, q = blocks.shape
    xb = x.reshape(-1, n, q).transpose(0, 1)  # (n, N, q)
    y = torch.bmm(xb, blocks.transpose(1, 2))  # (n, N, p)
    return y.transpose(0, 1).reshape(*x.shape[:-1], n * p)


def shuffle(x: torch.Tensor, n: int) -> torch.Tensor:
    """Channel (i, j) of n blocks of size s moves to position (j, i): the stride permutation."""
    s = x.shape[-1] // n
    return x.reshape(*x.shape[:-1], n, s).transpose(-1, -2).reshape(x.shape)


class StructuredLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, kind: str, rank: int = 0, n_blocks: int = 4,
                 self_guided: bool = False, residual_out: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.n_blocks, self.residual_out = n_blocks, residual_out
        n = n_blocks
        if kind == "lowrank":
            self.rank = default_rank(kind, in_features, out_features, rank, n)
            self.U = nn.Parameter(torch.empty(out_features, self.rank))
            self.V = nn.Parameter(torch.empty(self.rank, in_features))
        elif kind == "blockdense":
            self.rank = default_rank(kind, in_features, out_features, rank, n)
            if in_features % n or self.rank % n:
                raise ValueError(
                    f"blockdense needs n_blocks={n} to divide in={in_features} and rank={self.rank}; each block "
                    f"maps in / n_blocks inputs to rank / n_blocks channels"
                )
            self.blocks = nn.Parameter(torch.empty(n, self.rank // n, in_features // n))
            self.U = nn.Parameter(torch.empty(out_features, self.rank))
        elif kind == "blockshuffle":
            self.mid = min(in_features, out_features)  # middle width m; n | in and n | out give n | m
            if in_features % n or out_features % n:
                raise ValueError(
                    f"blockshuffle needs n_blocks={n} to divide in={in_features}, out={out_features} and the "
                    f"middle width m=min(in, out)={self.mid}; choose a common divisor"
                )
            self.blocks1 = nn.Parameter(torch.empty(n, self.mid // n, in_features // n))
            self.blocks2 = nn.Parameter(torch.empty(n, out_features // n, self.mid // n))
        else:
            raise ValueError(f"unknown structured kind {kind!r}; allowed: lowrank, blockdense, blockshuffle")
        self.alpha = 1.0 if self_guided else 0.0  # a plain float: set by the schedule, never trained or saved
        if self_guided:
            self.dense = nn.Parameter(torch.empty(out_features, in_features))

    def structured(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "lowrank":
            return F.linear(F.linear(x, self.V), self.U)
        if self.kind == "blockdense":
            return F.linear(block_diag_apply(x, self.blocks), self.U)
        return block_diag_apply(shuffle(block_diag_apply(x, self.blocks1), self.n_blocks), self.blocks2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = getattr(self, "dense", None)
        if dense is None or self.alpha == 0.0:  # guide dropped or faded out: no dense matmul at all
            return self.structured(x)
        return self.alpha * F.linear(x, dense) + (1.0 - self.alpha) * self.structured(x)

    def dense_weight(self) -> torch.Tensor:
        """The (out, in) matrix of the structured product (the identity pushed through `structured`)."""
        eye = torch.eye(self.in_features, dtype=self._factor().dtype, device=self._factor().device)
        return self.structured(eye).T

    def _factor(self) -> torch.Tensor:
        return self.U if self.kind != "blockshuffle" else self.blocks1

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        std = out_std if self.residual_out else std
        dev = self._factor().device
        if self.kind == "lowrank":
            w = torch.randn(self.out_features, self.in_features, device=dev, dtype=torch.float64) * std
            u, s, vh = torch.linalg.svd(w, full_matrices=False)
            root = s[: self.rank].sqrt()
            self.U.copy_(u[:, : self.rank] * root)
            self.V.copy_(root[:, None] * vh[: self.rank])
        elif self.kind == "blockdense":
            # B: orthogonal blocks (r/n, in/n), unit variance per middle channel; U (out, r) maps r
            # uncorrelated unit-variance channels to variance r s^2: s = std sqrt(in / r) gives in std^2.
            n, p, q = self.blocks.shape
            for b in self.blocks:
                nn.init.orthogonal_(b)
            self.blocks.mul_(math.sqrt(p / q) if p > q else 1.0)
            nn.init.normal_(self.U, std=std * math.sqrt(self.in_features / self.rank))
        else:
            n, p1, q1 = self.blocks1.shape
            _, p2, q2 = self.blocks2.shape
            for b in self.blocks1:
                nn.init.orthogonal_(b)
            for b in self.blocks2:
                nn.init.orthogonal_(b)
            self.blocks1.mul_(math.sqrt(p1 / q1) if p1 > q1 else 1.0)  # middle channels: unit variance
            # blocks2 (p2 x q2): output variance 1 when p2 <= q2, q2/p2 when p2 > q2; bring it to in std^2.
            keep = 1.0 if p2 <= q2 else q2 / p2
            self.blocks2.mul_(std * math.sqrt(self.in_features / keep))
        if hasattr(self, "dense"):
            self.dense.copy_(self.dense_weight())


class StructuredSwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with all three matrices structured (names as SwiGLU's)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        f, d, h = cfg.ffn, cfg.d_model, cfg.resolved_ffn_hidden()
        kw = dict(kind=f.kind, rank=f.rank, n_blocks=f.n_blocks, self_guided=f.self_guided)
        self.gate_proj = StructuredLinear(d, h, **kw)
        self.up_proj = StructuredLinear(d, h, **kw)
        self.down_proj = StructuredLinear(h, d, residual_out=True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def self_guided_alpha(step: int, max_steps: int, fraction: float) -> float:
    """Cosine from 1 at step 0 to 0 at round(fraction * max_steps), 0 after."""
    end = round(fraction * max_steps)
    if step >= end:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * step / end))


def _guided(model: nn.Module) -> list[StructuredLinear]:
    return [m for m in model.modules() if isinstance(m, StructuredLinear) and hasattr(m, "dense")]


def set_self_guided_alpha(model: nn.Module, alpha: float) -> None:
    for m in _guided(model):
        m.alpha = float(alpha)


def drop_self_guided(model: nn.Module) -> list[nn.Parameter]:
    """Remove every dense guide weight from the model (alpha 0); returns them (empty when none are left)."""
    dropped = []
    for m in _guided(model):
        dropped.append(m.dense)
        del m.dense
        m.alpha = 0.0
    return dropped


@torch.no_grad()
def dense_equivalent(linear: StructuredLinear) -> torch.Tensor:
    """The (out, in) matrix the layer applies now, dense guide mixed in (exact: both maps are linear)."""
    w = linear.dense_weight()
    dense = getattr(linear, "dense", None)
    if dense is not None and linear.alpha != 0.0:
        w = linear.alpha * dense + (1.0 - linear.alpha) * w
    return w


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every structured layer written as one plain ``<name>.weight``."""
    sd = model.state_dict()
    for name, m in model.named_modules():
        if isinstance(m, StructuredLinear):
            for p in FACTOR_NAMES:
                sd.pop(f"{name}.{p}", None)
            sd[f"{name}.weight"] = dense_equivalent(m)
    return sd
