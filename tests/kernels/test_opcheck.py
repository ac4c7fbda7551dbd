"""Every fused op's torch.library registration checked by torch's own `opcheck` (schema, autograd registration,
fake implementation, AOT dispatch) on the arguments a tiny model's training step and decoding actually pass it:
what torch.compile relies on to trace the model without graph breaks."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtron.configs import load_config
from hybridtron.kernels.backend import OPS
from hybridtron.model import GatedLM

pytest.importorskip("triton")

# Every custom op the kernels register (kernels/*/op.py, chunk.py, recurrent.py).
CUSTOM_OPS = ["rms_norm_fwd", "rms_norm_bwd", "rotary_qk_fwd", "rotary_qk_bwd", "swiglu_fwd", "swiglu_bwd",
              "gated_attention_fwd", "gated_attention_bwd", "linear_cross_entropy", "short_conv_fwd", "short_conv_bwd",
              "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd", "recurrent_gated_delta_rule_fwd",
              "moe_gather", "moe_combine", "moe_combine_bwd"]


class _Record(TorchDispatchMode):
    """The first call of each hybridtron op: (op overload, args, kwargs)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "hybridtron":
            name = func.name().split("::")[1].split(".")[0]
            # detached: the ops run inside autograd.Functions, which own their gradients (no register_autograd)
            plain = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs or {}))
            self.calls.setdefault(name, (func, *plain))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def calls():
    rec = _Record()
    for preset in ("tiny", "tiny_hybrid", "tiny_moe"):
        cfg = load_config(preset, [("model.max_seq_len", "32"), ("data.seq_len", "16"),
                                   *((f"model.kernels.{op}", "triton") for op in OPS)])
        torch.manual_seed(0)
        model = GatedLM(cfg.model, 64)
        model.init_weights()  # (construction leaves the weights uninitialised)
        ids = torch.randint(0, 64, (2, 16))
        docs = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
        with rec:
            loss = model(ids, doc_ids=docs, labels=ids)
            loss.backward()
        assert torch.isfinite(loss), preset  # the recorded arguments are those of a sane step
        with rec:
            with torch.no_grad():  # cached decoding: the recurrent delta-rule kernel
                cache = model.new_cache()
                model(ids[:1, :4], cache=cache)
                model(ids[:1, 4:5], cache=cache)
    return rec.calls


@pytest.mark.parametrize("name", CUSTOM_OPS)
def test_custom_op_registration(name, calls):
    assert name in calls, f"no tiny model reached hybridtron::{name}; the check below would not run"
    op, args, kwargs = calls[name]
    torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_autograd_registration",
                                                        "test_faketensor", "test_aot_dispatch_dynamic"))
