"""Typed configuration schemas, composition and validation."""

from framework.config.load import CONF_DIR, ConfigError, compose, describe_hydra_error, to_config, validate
from framework.config.schema import (
    ArchConfig,
    AttentionConfig,
    CompileConfig,
    Config,
    KVConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    SamplingConfig,
    SchedulerConfig,
    SpeculativeConfig,
    register_schemas,
)

__all__ = [
    "ArchConfig", "AttentionConfig", "CompileConfig", "Config", "ConfigError", "CONF_DIR", "KVConfig",
    "ModelConfig", "ParallelConfig", "RunConfig", "SamplingConfig", "SchedulerConfig", "SpeculativeConfig", "compose",
    "describe_hydra_error", "register_schemas", "to_config", "validate",
]
