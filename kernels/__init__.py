"""kernels: one folder per fused op (Triton kernel, launcher, autograd.Function, pure-torch reference), the backend
switch (backend.py) and auto's measurement on CUDA (tune.py), imported here so that it is registered with the
switch whichever op a program imports first."""

from . import tune  # noqa: F401
