"""Hugging Face interop: ``export`` writes a checkpoint as a transformers model directory (native Qwen3.5 classes
where they are exact, our own modeling code in ``export_custom`` where they are not); ``load`` starts a run from
a local transformers checkpoint (``hybridtron train --init-from hf:DIR``)."""
