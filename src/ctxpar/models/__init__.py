"""Reference models: readable single-device code; parallelism is applied from outside."""

from ctxpar.models.config import PRESETS, ModelConfig, get_config
from ctxpar.models.llama import Transformer

__all__ = ["PRESETS", "ModelConfig", "Transformer", "get_config"]
