"""The custom-code half of ``hybridtron export``: the two files copied next to ``config.json`` when a
model has a feature no transformers class has (negative eigenvalues, DeltaProduct, HAX sparse attention;
MoE with the router bias, a sigmoid router or no shared expert).

``configuration_hybridtron.py`` and ``modeling_hybridtron.py`` are written out verbatim and loaded by
``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``. They import
only torch and transformers (never hybridtron: the directory goes to people without our package), so
they live in a package of their own and use a relative import between them, exactly as transformers'
dynamic-module loader sees them in the exported directory.
"""

from pathlib import Path

FILES = ("configuration_hybridtron.py", "modeling_hybridtron.py")
HERE = Path(__file__).parent
