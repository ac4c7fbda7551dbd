"""kernels: one folder per fused op (Triton kernel, launcher, autograd.Function, pure-torch reference), the backend
switch (backend.py, its torch-free rules in rules.py, the size limits in limits.py) and auto's measurement on CUDA
(tune.py).

Nothing is imported here: the layout check reads rules.py and limits.py without torch (the command line answers a
config mistake before torch is imported). Nothing registers itself on import either: the switch imports tune.py
the first time ``auto`` of a tuned op is asked for (``backend.tuner``).
"""
