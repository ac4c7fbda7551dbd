"""Configuration of a hybridtron export that needs custom code (written by ``hybridtron export``).

Everything of transformers' ``Qwen3_5TextConfig`` plus two Gated DeltaNet options it has no field for:

- ``linear_allow_neg_eigval``: beta = 2 sigmoid(b) instead of sigmoid(b), so the state transition
  I - beta k k^T has eigenvalues in (-1, 1) (negative eigenvalues, Grazzi et al.);
- ``linear_num_householder``: DeltaProduct's n_h (Siems et al.), the delta-rule steps per token
  (1 = Gated DeltaNet).

This file imports only transformers: it is loaded with ``trust_remote_code=True`` from the model
directory, where the hybridtron package need not be installed.
"""

from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig


class HybridtronConfig(Qwen3_5TextConfig):
    model_type = "hybridtron"

    linear_allow_neg_eigval: bool = False
    linear_num_householder: int = 1

    def __post_init__(self, **kwargs):
        if self.linear_num_householder < 1:
            raise ValueError(f"linear_num_householder={self.linear_num_householder} must be >= 1 (1 = Gated DeltaNet)")
        super().__post_init__(**kwargs)


__all__ = ["HybridtronConfig"]
