"""Fused linear + cross-entropy (chunked; the logits never exist whole), single-device and vocabulary-parallel."""

from hybridtron.kernels.cross_entropy.chunked import chunked_linear_cross_entropy
from hybridtron.kernels.cross_entropy.op import (
    LinearCrossEntropyFunction,
    linear_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)
from hybridtron.kernels.cross_entropy.reference import linear_cross_entropy_reference

__all__ = [
    "LinearCrossEntropyFunction", "chunked_linear_cross_entropy", "linear_cross_entropy",
    "linear_cross_entropy_reference", "vocab_parallel_linear_cross_entropy",
]
