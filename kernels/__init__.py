"""kernels: one folder per fused op (Triton kernel, launcher, autograd.Function, pure-torch reference), the backend
switch (backend.py, its torch-free rules in rules.py, the size limits in limits.py) and auto's measurement on CUDA
(tune.py).

Nothing is imported here: the layout check reads rules.py and limits.py without torch (the command line answers a
config mistake before torch is imported). tune.py registers itself with the switch when imported; hybridtron.model
imports it, so every model's ops are measured, and a program that calls an op of the tuned ones directly imports
it itself (``from hybridtron.kernels import tune``) or gets AUTO_ORDER's first runnable backend.
"""
