"""The custom-code half of ``hybridtron export``: the two files copied next to ``config.json`` when a
model has a feature no transformers class has (negative eigenvalues, DeltaProduct, HAX sparse attention;
MoE with the router bias, a sigmoid router or no shared expert).

``configuration_hybridtron.py`` and ``modeling_hybridtron.py`` are written out verbatim and loaded by
``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``. They import
only torch and transformers (never hybridtron: the directory goes to people without our package), so
they live in a package of their own and use a relative import between them, exactly as transformers'
dynamic-module loader sees them in the exported directory.

**Why the maths is written twice.** ``modeling_hybridtron.py`` keeps its own delta rule (negative eigenvalues,
DeltaProduct's Householder steps), HAX branch and MoE routing beside the model's (``model/gated_deltanet.py``,
``model/hax_attention.py``, ``model/moe.py``): the exported directory must run for people without hybridtron, so
it cannot import those, and it is written in transformers' own style (a Qwen3.5 subclass, its cache, its
generation), plain torch and no fused kernels. What ties the copy to the model is tests/train/test_export_custom.py:
each such model exported and loaded with ``trust_remote_code`` gives our model's logits, greedy generation and
cached decoding (``test_custom_export_matches_in_logits_generation_and_cached_decoding``); a wrong mixer rule, a
missing router bias or a wrong or missing HAX branch is caught by that comparison (the ``test_the_comparison_
catches_*`` tests); with Qwen3.5's settings the custom model is transformers' Qwen3.5 on the same weights; and the
directory loads in an interpreter where ``import hybridtron`` fails. A change to the model's maths that the copy
does not follow fails those tests; and every export runs the comparison itself (``parity``; off only with
``--no-check``) and writes nothing when it fails.
"""

from pathlib import Path

FILES = ("configuration_hybridtron.py", "modeling_hybridtron.py")
HERE = Path(__file__).parent
