"""Configuration of a hybridtron export that needs custom code (written by ``hybridtron export``).

Everything of transformers' ``Qwen3_5TextConfig`` plus what it has no field for:

Gated DeltaNet
- ``linear_allow_neg_eigval``: beta = 2 sigmoid(b) instead of sigmoid(b), so the state transition
  I - beta k k^T has eigenvalues in (-1, 1) (negative eigenvalues, Grazzi et al.);
- ``linear_num_householder``: DeltaProduct's n_h (Siems et al.), the delta-rule steps per token
  (1 = Gated DeltaNet);
- ``linear_sparse_attention``: HAX's sparse attention branch in every Gated DeltaNet mixer (Zhan et al.,
  2025): "none", "hax" (LSH buckets and learned key selection), "lsh", "key_selection" or "window";
  ``linear_sparse_keys`` keys per query at most (split evenly between the sources),
  ``linear_sparse_dim`` the branch's q/k width (0: ``linear_key_head_dim``), ``linear_lsh_bits`` the sign
  bits of its fixed random projection (2^bits buckets).

Mixture of experts (``num_experts`` > 0; the layers in ``mlp_only_layers`` keep a dense MLP of
``intermediate_size``)
- ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``: E SwiGLU experts, top-k of them
  per token;
- ``shared_expert_intermediate_size``: a sigmoid-gated shared expert (0: none);
- ``moe_router``: "softmax" or "sigmoid" router scores; ``norm_topk_prob``: the k chosen scores
  renormalised to sum 1;
- ``moe_router_bias_update_rate``: > 0 when the model was trained with auxiliary-loss-free balancing:
  each MoE layer's ``expert_bias`` is added to the scores to choose the experts (the weights stay the
  unbiased scores). The rate itself is a training setting, kept so that a re-import trains on the same way.

This file imports only transformers: it is loaded with ``trust_remote_code=True`` from the model
directory, where the hybridtron package need not be installed.
"""

from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

# linear_sparse_attention -> the sources of each query's keys (the modeling file's HAX branch)
SPARSE_SOURCES = {"none": (), "hax": ("lsh", "key_selection"), "lsh": ("lsh",), "key_selection": ("key_selection",),
                  "window": ("window",)}


class HybridtronConfig(Qwen3_5TextConfig):
    model_type = "hybridtron"

    linear_allow_neg_eigval: bool = False
    linear_num_householder: int = 1
    linear_sparse_attention: str = "none"
    linear_sparse_keys: int = 64
    linear_sparse_dim: int = 0
    linear_lsh_bits: int = 8
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_router: str = "softmax"
    norm_topk_prob: bool = True
    moe_router_bias_update_rate: float = 0.0
    router_aux_loss_coef: float = 0.0
    mlp_only_layers: list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.linear_num_householder < 1:
            raise ValueError(f"linear_num_householder={self.linear_num_householder} must be >= 1 (1 = Gated DeltaNet)")
        if self.linear_sparse_attention not in SPARSE_SOURCES:
            raise ValueError(f"linear_sparse_attention={self.linear_sparse_attention!r} must be one of "
                             f"{', '.join(SPARSE_SOURCES)}")
        if self.linear_sparse_attention != "none":
            n = len(SPARSE_SOURCES[self.linear_sparse_attention])
            if self.linear_sparse_keys < n or not 1 <= self.linear_lsh_bits <= 30 or self.linear_sparse_dim < 0:
                raise ValueError(f"linear_sparse_keys={self.linear_sparse_keys} must be >= {n}, linear_lsh_bits="
                                 f"{self.linear_lsh_bits} in [1, 30] and linear_sparse_dim={self.linear_sparse_dim} "
                                 f">= 0 (0: linear_key_head_dim) for linear_sparse_attention="
                                 f"{self.linear_sparse_attention}")
        if self.moe_router not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router={self.moe_router!r} must be 'softmax' or 'sigmoid'")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.num_experts}")
        self.mlp_only_layers = [] if self.mlp_only_layers is None else list(self.mlp_only_layers)
        super().__post_init__(**kwargs)

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers


__all__ = ["HybridtronConfig"]
