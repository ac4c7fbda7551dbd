"""The gated delta rule (Gated DeltaNet, DeltaProduct): Triton kernels beside the pure-torch references.

reference.py: the token-by-token recurrence and the chunked (WY / UT) form in torch.
chunk.py: the chunked form on Triton kernels for training and prefill, forward and backward.
recurrent.py: the recurrence on one Triton kernel for decoding, forward only (imports triton: not re-exported
here, so importing the model needs no triton).
op.py: `gated_delta_rule`, the backend switch the mixer calls.
"""

from hybridtron.kernels.gated_delta_rule.chunk import ChunkGatedDeltaRuleFunction, chunk_gated_delta_rule
from hybridtron.kernels.gated_delta_rule.op import gated_delta_rule
from hybridtron.kernels.gated_delta_rule.reference import delta_rule_chunked, delta_rule_recurrent, l2_normalize

__all__ = ["ChunkGatedDeltaRuleFunction", "chunk_gated_delta_rule", "delta_rule_chunked", "delta_rule_recurrent",
           "gated_delta_rule", "l2_normalize"]
