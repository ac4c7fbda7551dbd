"""Typed job configs, YAML presets and dotted CLI overrides."""

from hybridtron.configs.base import ConfigError, apply_override, parse_overrides
from hybridtron.configs.job import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    SourceConfig,
    TokenizerConfig,
    TrainConfig,
    check_overrides,
    config_from_dict,
    load_config,
    resolve_preset,
)
from hybridtron.configs.model import DeltaNetConfig, MoEConfig, ScaleVectorConfig, StructuredFFNConfig

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "DeltaNetConfig", "JobConfig", "MoEConfig", "ModelConfig",
    "ParallelConfig", "ScaleVectorConfig", "SourceConfig", "StructuredFFNConfig",
    "TokenizerConfig", "TrainConfig", "apply_override", "check_overrides", "config_from_dict", "load_config",
    "parse_overrides", "resolve_preset",
]
