"""MoE token permute (expert-sorted gather of token rows) and unpermute (weighted combine of each token's
k expert outputs): Triton kernels beside the pure-torch reference."""

from .op import PermuteFunction, UnpermuteFunction, moe_permute, moe_unpermute
from .reference import permute_reference, sort_assignments, unpermute_reference

__all__ = ["PermuteFunction", "UnpermuteFunction", "moe_permute", "moe_unpermute", "permute_reference",
           "sort_assignments", "unpermute_reference"]
