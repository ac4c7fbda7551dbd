"""RMSNorm in the two parameterisations the configs offer.

``plain``:          y = x / rms(x) * w          (w init 1; Llama, Qwen3)
``zero_centered``:  y = x / rms(x) * (1 + w)    (w init 0; Qwen3-Next, Qwen3.5)

The zero-centred form has the same function at init but lets weight decay pull the gain towards 1
instead of towards 0. Both compute in fp32 and multiply by the gain before casting back, as Qwen3.5
does, so a bf16 input loses precision only once. Under ``model.scale`` a norm may have no gain, or a
gain parameterised as magnitude * direction (``weight_m``, ``weight_d``); `folded_state` writes either
back as the plain ``weight`` (model/scale.py).

The arithmetic runs through the backend switch (``model.kernels.norm``, set on every norm by
`GatedLM`): the pure-torch reference or the fused Triton kernel (kernels/norm), which also folds in the
residual add before the norm (`forward(x, residual)`) and the silu gate after it (`gated`). Whatever the
form, the kernel gets one effective gain vector (magnitude * direction is built by autograd from its two
parameters, a (dim,) tensor), so a reparameterised gain costs no activation memory.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtron.kernels.norm import rms_norm
from hybridtron.model.scale import add_scale, md_vector, reset_scale, scale_param_names


class RMSNorm(nn.Module):
    kernel_op = "norm"  # model.kernels.norm picks the implementation (set_kernel_backends in model/lm.py)
    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        zero_centered: bool = False,
        *,
        gain: bool = True,
        magnitude_direction: bool = False,
        decay: bool | None = None,
    ):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.zero_centered = zero_centered
        self.kernel_backend = "auto"
        # Set (model/lm.py) where every consumer of this norm's output is a plain projection: under autocast the
        # output is then written in the autocast dtype, the rounding each projection's cast would do, in one pass
        # (no fp32 output written and read back by every cast).
        self.autocast_output = False
        # Scale-vector forms (model/scale.py): no gain (its consumers carry one each), or the gain as
        # magnitude * direction (weight_m, weight_d), which is the gain itself, not 1 + w.
        self.has_gain = gain
        self.magnitude_direction = gain and magnitude_direction
        if self.magnitude_direction:
            add_scale(self, "weight", dim, magnitude_direction=True)
        elif gain:
            self.weight = nn.Parameter(torch.empty(dim))
        if decay is not None and gain:
            self.param_decay = {p: decay for p in scale_param_names("weight", self.magnitude_direction)}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Every form is the identity gain at init.
        if self.magnitude_direction:
            reset_scale(self, "weight")
        elif self.has_gain:
            with torch.no_grad():
                self.weight.fill_(0.0 if self.zero_centered else 1.0)

    def gain(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The multiplier applied after normalising (1 + w when zero-centred); None for a gainless norm."""
        if self.magnitude_direction:
            return md_vector(self.weight_m, self.weight_d).to(dtype)
        if not self.has_gain:
            return None
        g = self.weight.to(dtype)
        return 1.0 + g if self.zero_centered else g

    def kernel_gain(self) -> tuple[torch.Tensor | None, float]:
        """(w, offset) with gain = w + offset, as the kernels take it: the stored weight and 1.0 when
        zero-centred (added in fp32 inside), the magnitude-direction vector, or (None, 0) without a gain."""
        if self.magnitude_direction:
            return md_vector(self.weight_m, self.weight_d), 0.0
        if not self.has_gain:
            return None, 0.0
        return self.weight, 1.0 if self.zero_centered else 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) in x's dtype (computed in fp32 at least; fp64 stays fp64), or the autocast dtype under
        autocast where ``autocast_output`` is set. With ``residual``: h = x + residual, then (norm(h), h) --
        the add fused into the norm's kernel."""
        w, offset = self.kernel_gain()
        dev = x.device.type
        out = torch.get_autocast_dtype(dev) if self.autocast_output and torch.is_autocast_enabled(dev) else None
        return rms_norm(x, w, self.eps, offset=offset, residual=residual, out_dtype=out, backend=self.kernel_backend)

    def gated(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """norm(x) * silu(z) in x's dtype, the delta-rule mixer's gated output norm, in one kernel."""
        w, offset = self.kernel_gain()
        return rms_norm(x, w, self.eps, offset=offset, z=z, backend=self.kernel_backend)

    @torch.no_grad()
    def folded_state(self, ref: torch.Tensor) -> dict[str, torch.Tensor]:
        """{"weight": the stored w of a plain-form norm with this norm's gain} (see fold_scale_vectors)."""
        if not self.has_gain:
            w = ref.new_ones(self.dim)
            return {"weight": w - 1.0 if self.zero_centered else w}
        if not self.magnitude_direction:
            return {"weight": self.weight.detach().clone()}
        g = self.gain(torch.promote_types(self.weight_d.dtype, torch.float32))
        return {"weight": (g - 1.0 if self.zero_centered else g).to(self.weight_d.dtype)}

    def extra_repr(self) -> str:
        extra = "" if self.has_gain else ", gain=False"
        if self.magnitude_direction:
            extra += ", magnitude_direction=True"
        return f"{self.dim}, eps={self.eps}, zero_centered={self.zero_centered}{extra}"


def build_norm(norm_type: str, dim: int, eps: float, **scale_kw) -> RMSNorm:
    """scale_kw: RMSNorm's scale-vector keywords, from model.scale.norm_kwargs (none: the plain norm)."""
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps, zero_centered=False, **scale_kw)
    if norm_type == "rmsnorm_zero_centered":
        return RMSNorm(dim, eps, zero_centered=True, **scale_kw)
    raise ValueError(f"model.norm_type={norm_type!r} is not one of 'rmsnorm', 'rmsnorm_zero_centered'")
