"""FP8 training of the blocks' linear layers through torchao (``train.fp8``: tensorwise | rowwise).

``apply_fp8`` swaps the blocks' plain ``nn.Linear`` projections for torchao's ``Float8Linear``: the matmuls of
forward and backward run in FP8 (e4m3 for inputs and weights, e5m2 for output gradients) with dynamic scales, one
per tensor (tensorwise) or per row (rowwise). The weight stays the same fp32 (or bf16) parameter under the same
name, so optimizer state, checkpoints and exports do not change, and a run resumes with FP8 switched on or off.

What stays in bf16, and why (the log lists it):
- outside the blocks: the embedding (not a matmul) and the output layer (its logits feed the loss; an FP8 error
  there moves every token's loss);
- routers and per-head gate projections (MoE ``gate``/``shared_expert_gate``, attention's headwise
  ``gate_proj``, Gated DeltaNet's ``in_proj_a``/``in_proj_b``): one number per expert or head that passes a
  softmax, sigmoid or exp, too narrow for an FP8 GEMM to gain and sensitive to its rounding;
- scale-vector projections (``ScaledLinear``, model.scale.*): Float8Linear would drop their scales;
- a linear whose local dims (after tensor-parallel sharding) are not multiples of 16, which FP8 GEMMs require;
- MoE experts: grouped weights, not nn.Linear; torchao 0.18's grouped FP8 training
  (``torchao.prototype.moe_training``) is a prototype for sm_90+ with no CPU path, so it is not wired here.

Placement in ``parallelize``: before tensor parallel, since TP plans hook the modules they shard and a swap after
them would lose the hooks (torchtitan converts first, too). With tensorwise scaling, TP uses torchao's
Float8Colwise/RowwiseParallel styles and FSDP2 all-gathers the weights in FP8 (half of bf16's bytes), with the
scales of all weights computed in one all-reduce after each optimizer step (``after_optimizer_step``).

On the CPU, FP8 runs only in torchao's emulation (the same casts, the matmul in high precision), for tests: the
process must have ``HYBRIDTRON_FP8_EMULATE=1`` in its environment; the layout refuses it otherwise.
"""

from __future__ import annotations

import logging
import re
from collections import Counter

from torch import nn

from hybridtron.kernels.backend import fp8_emulated as emulated

# The last part(s) of a block's linear names that stay in bf16: routers and per-head gates (module docstring).
KEPT_BY_NAME = {"mlp.gate": "router", "shared_expert_gate": "router", "self_attn.gate_proj": "per-head gate",
                "linear_attn.in_proj_a": "per-head gate", "linear_attn.in_proj_b": "per-head gate"}


def _torchao_float8():
    # torchao logs a warning for each compiled extension it cannot load on this torch; float8 training needs none.
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        quiet.setLevel(level)
    return float8


def float8_config(recipe: str, *, fsdp_all_gather: bool):
    """torchao's Float8LinearConfig for ``recipe``, emulated on the CPU."""
    import dataclasses

    f8 = _torchao_float8()
    config = f8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulated(), enable_fsdp_float8_all_gather=fsdp_all_gather)


def keep_reason(module: nn.Module, fqn: str, tp: int = 1) -> str | None:
    """Why the ``nn.Linear`` ``module`` at ``fqn`` stays in bf16, or None when it converts."""
    if not fqn.startswith("layers."):
        return "outside the blocks"
    if type(module) is not nn.Linear:
        return f"{type(module).__name__} (its own forward)"
    for suffix, why in KEPT_BY_NAME.items():
        if fqn.endswith("." + suffix):
            return why
    out_f, in_f = module.weight.shape
    if out_f % (16 * tp) or in_f % (16 * tp):
        return f"dims {out_f}x{in_f} not multiples of 16{f' x tp={tp}' if tp > 1 else ''}"
    return None


def _pattern(fqn: str) -> str:
    return re.sub(r"^layers\.\d+\.", "layers.*.", fqn)


def apply_fp8(model: nn.Module, cfg, mesh, log=None) -> list[str]:
    """Convert the blocks' linears of ``model`` to torchao's Float8Linear for ``cfg.train.fp8``, in place; log what
    converted and what stayed in bf16. Returns the converted names (empty with train.fp8=none)."""
    recipe = cfg.train.fp8
    if recipe == "none":
        return []
    log = log or (lambda _msg: None)
    tp = mesh.tp if mesh is not None else 1
    sharded = mesh is not None and mesh.data_ranks > 1 and mesh.zero_stage in (2, 3)  # FSDP2 (layout.check_fp8)
    all_gather = recipe == "tensorwise" and sharded
    converted: list[str] = []
    kept: Counter = Counter()

    def convert(module: nn.Module, fqn: str) -> bool:
        why = keep_reason(module, fqn, tp)
        if why is None:
            converted.append(fqn)
        else:
            kept[f"{_pattern(fqn)} ({why})"] += 1
        return why is None

    f8 = _torchao_float8()
    f8.convert_to_float8_training(model, module_filter_fn=convert, config=float8_config(recipe,
                                                                                          fsdp_all_gather=all_gather))
    if all_gather:
        model.after_optimizer_step_fp8 = f8.precompute_float8_dynamic_scale_for_fsdp
    names = Counter(_pattern(n) for n in converted)
    experts = sum(1 for m in model.modules() if hasattr(m, "experts"))
    log(f"fp8 ({recipe}, torchao{', emulated' if emulated() else ''}"
        f"{', FP8 all-gather in FSDP2' if all_gather else ''}): {len(converted)} linears converted: "
        + ", ".join(f"{n} x{c}" for n, c in names.items())
        + (("; kept in bf16: " + ", ".join(f"{n} x{c}" for n, c in kept.items())) if kept else "")
        + (f"; MoE experts of {experts} layers kept in bf16 (grouped weights: torchao's grouped FP8 training is "
           f"not wired here)" if experts else ""))
    return converted


def tensor_parallel_plan(block: nn.Module, plan: dict) -> dict:
    """``plan`` with torchao's Float8Colwise/RowwiseParallel for the converted linears of ``block`` when their
    scaling is tensorwise (those styles assume it; rowwise Float8Linears take the plain styles)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = None
    for name, style in plan.items():
        module = block.get_submodule(name)
        if type(style) not in (ColwiseParallel, RowwiseParallel) or not _tensorwise_float8(module):
            continue
        if styles is None:
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

            styles = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
        new = styles[type(style)]()
        new.__dict__.update(style.__dict__)  # the same layouts and use_local_output
        plan[name] = new
    return plan


def _tensorwise_float8(module: nn.Module) -> bool:
    if type(module).__name__ != "Float8Linear":
        return False
    from torchao.float8.config import ScalingGranularity

    return module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
