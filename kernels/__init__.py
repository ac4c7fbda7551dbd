"""kernels: one folder per fused op (Triton kernel, launcher, autograd.Function, pure-torch reference), the backend
switch (backend.py, its torch-free rules in rules.py, the size limits in limits.py) and auto's measurement on CUDA
(tune.py).

Nothing is imported here: the layout check reads rules.py and limits.py without torch (the command line answers a
config mistake before torch is imported). The tuner is registered with the switch explicitly, in one place:
hybridtron.model calls ``backend.use_tuner(tune)``, so every model's ops are measured; a program that calls an op
of the tuned ones directly, without the model, registers it itself the same way or gets AUTO_ORDER's first
runnable backend.
"""
