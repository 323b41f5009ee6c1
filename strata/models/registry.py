"""The architecture registry and the base class every architecture file fills in.

An Architecture knows how to build one decoder layer, and how a checkpoint's tensors
map onto its parameters. It knows nothing about stages: the runner picks which layers
to build (a contiguous range) and where.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from strata.errors import StrataError
from strata.layers.rotary import RotaryEmbedding
from strata.models.config import ModelConfig
from strata.models.moe_weights import is_stacked_expert, stacked_experts

if TYPE_CHECKING:
    from strata.weights.checkpoint import Checkpoint

_REGISTRY: dict[str, type[Architecture]] = {}
_HF_NAMES: dict[str, str] = {}


class Architecture:
    name: str = ""
    hf_names: tuple[str, ...] = ()  # config.json "architectures" values

    def __init__(self, config: ModelConfig):
        self.config = config

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        raise NotImplementedError

    def adapt_gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Undo what llama.cpp's converter did to a tensor of this architecture."""
        return tensor

    def load_tensor(self, name: str, checkpoint: Checkpoint) -> torch.Tensor:
        """The checkpoint tensor for parameter `name` (Hugging Face naming)."""
        if name == "lm_head.weight" and not checkpoint.has(name):
            name = "model.embed_tokens.weight"  # tied embeddings
        if is_stacked_expert(name, checkpoint):
            return stacked_experts(name, checkpoint, self.config.num_experts)
        tensor = checkpoint.get(name)
        if checkpoint.format == "gguf":
            tensor = self.adapt_gguf_tensor(name, tensor)
        return tensor


def register(cls: type[Architecture]) -> type[Architecture]:
    _REGISTRY[cls.name] = cls
    for hf_name in cls.hf_names:
        _HF_NAMES[hf_name] = cls.name
    return cls


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_hf_architecture(raw_config: dict) -> str:
    """Registry key for a config.json (its `architectures` list, else `model_type`)."""
    for hf_name in raw_config.get("architectures") or []:
        if hf_name in _HF_NAMES:
            return _HF_NAMES[hf_name]
    model_type = raw_config.get("model_type")
    if model_type in _REGISTRY:
        return model_type
    shown = (raw_config.get("architectures") or [model_type or "unknown"])[0]
    raise StrataError(f"architecture '{shown}' is not supported; "
                      f"supported: {', '.join(supported_architectures())}")


def get_architecture(config: ModelConfig) -> Architecture:
    if config.architecture not in _REGISTRY:
        raise StrataError(f"architecture '{config.architecture}' is not supported; "
                          f"supported: {', '.join(supported_architectures())}")
    return _REGISTRY[config.architecture](config)
