"""Model architectures: one file each, registered by name (see registry.py)."""

from strata.models import deepseek_v3, glm4_moe, llama, qwen3, qwen3_moe, qwen3_next  # noqa: F401
from strata.models.config import ModelConfig
from strata.models.registry import get_architecture, supported_architectures

__all__ = ["ModelConfig", "get_architecture", "supported_architectures"]
