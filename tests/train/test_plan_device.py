"""`plan --measure`'s real step on an accelerator, checked on the CPU: the measured path runs on fake tensors of a
device that is not the CPU (FakeTensorMode refuses any op whose tensors are on two devices), so token ids left on
the CPU while the model is on the GPU fail here as they did on an H100 ("index is on cpu").

CPU builds of torch cannot hold even fake CUDA tensors (their Python bindings take a CUDA device guard, which such
a build lacks), so the fake device is a Python-registered accelerator ("privateuseone", renamed "gpu"), set up in a
child process because the registration lasts for the process."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = r"""
import sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from hybridtron.configs import load_config
from hybridtron.train import plan
from hybridtron.train.parallel.mesh import Mesh

_setup_privateuseone_for_python_backend("gpu")
gpu = torch.device("gpu")
for pattern in sys.argv[1:]:
    cfg = load_config("tiny", [("model.layer_pattern", pattern), ("model.n_layers", str(len(pattern))),
                               ("train.grad_accum_steps", "2"), ("train.dtype", "fp32")])
    with FakeTensorMode() as mode, plan._KnownValues(mode):
        result = plan.step_peak(cfg, Mesh(), fake=False, device=gpu)
    assert result["memory"]["total"] > result["memory"]["weights"] > 0, result
    print(pattern, "ok", result["memory"]["total"])
"""


@pytest.mark.slow
def test_measured_step_keeps_every_tensor_on_the_device():
    # A: gated attention (dense), LA: a Gated DeltaNet layer and an attention layer
    run = subprocess.run([sys.executable, "-c", SCRIPT, "A", "LA"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" ok ") == 2
