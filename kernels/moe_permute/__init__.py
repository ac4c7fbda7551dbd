"""MoE token permute (expert-sorted gather of token rows) and unpermute (weighted combine of each token's
k expert outputs): Triton kernels beside the pure-torch reference."""

from hybridtron.kernels.moe_permute.op import PermuteFunction, UnpermuteFunction, moe_permute, moe_unpermute
from hybridtron.kernels.moe_permute.reference import permute_reference, sort_assignments, unpermute_reference

__all__ = ["PermuteFunction", "UnpermuteFunction", "moe_permute", "moe_unpermute", "permute_reference",
           "sort_assignments", "unpermute_reference"]
