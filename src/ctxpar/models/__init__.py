"""Reference models: readable single-device code; parallelism is applied from outside."""

from ctxpar.models.config import PRESETS, ModelConfig, get_config

__all__ = ["PRESETS", "ModelConfig", "get_config"]
