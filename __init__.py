"""hybridtron: distributed LLM pretraining."""
__version__ = "0.1.0"
