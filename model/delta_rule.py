"""The gated delta rule in pure torch (the token-by-token recurrence and the chunked WY / UT form).

The code lives beside its Triton kernels, in kernels/gated_delta_rule/reference.py (its module docstring
gives the maths, shapes and conventions); this module re-exports it so that model code and existing imports
keep working.
"""

from __future__ import annotations

from hybridtron.kernels.gated_delta_rule.reference import delta_rule_chunked, delta_rule_recurrent, l2_normalize

__all__ = ["delta_rule_chunked", "delta_rule_recurrent", "l2_normalize"]
