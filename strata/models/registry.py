"""The architecture registry and the base class every architecture file fills in.

An Architecture knows how to build one decoder layer (its projections from the stage's
LinearFactory), what state each layer keeps between windows (its cache spec), and what
its checkpoints do differently from Hugging Face's names and layouts. It knows nothing
about stages (the runner picks which layers to build, and where) nor about files
(strata/weights/ reads them).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.errors import StrataError
from strata.kvcache.spec import CacheSpec, PagedKVSpec
from strata.layers.linear import LinearFactory
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding
from strata.models.config import ModelConfig

_REGISTRY: dict[str, type[Architecture]] = {}
_HF_NAMES: dict[str, str] = {}


class Architecture:
    name: str = ""
    hf_names: tuple[str, ...] = ()  # config.json "architectures" values
    released_with_mtp = False  # its makers' checkpoints carry an MTP layer (a file without
                               # one lost it in conversion: the engine says so)

    def __init__(self, config: ModelConfig, linear: LinearFactory | None = None):
        """`linear`: the stage's factory for projections (default: the stage's dtype)."""
        self.config = config
        self.linear = linear or LinearFactory()

    norm: type[RMSNorm] = RMSNorm  # the model's RMSNorm (the final norm's too)

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        raise NotImplementedError

    def cache_spec(self, layer: int) -> CacheSpec:
        """What `layer` keeps between windows (the MTP layers' numbers included)."""
        c = self.config
        return PagedKVSpec(c.num_kv_heads, c.head_dim)

    def make_mtp(self, rotary: RotaryEmbedding, embed: nn.Embedding | None,
                 lm_head: nn.Module) -> nn.Module:
        """The model's MTP layer (cache index num_layers), sharing `embed` (None: the stage
        has none: its own copy is loaded) and `lm_head`: DeepSeek-V3's layout."""
        from strata.layers.mtp import MTPHead
        c = self.config
        return MTPHead(c.num_layers, self.make_layer(c.num_layers, rotary),
                       vocab=c.vocab_size, hidden=c.hidden_size, eps=c.rms_norm_eps,
                       embed=embed, lm_head=lm_head, linear=self.linear)

    def read_gguf(self, checkpoint, name: str):
        """Parameter `name` (Hugging Face naming) as this architecture reads it from a GGUF
        file where llama.cpp's converter changed more than its name and row order (values
        transformed, tensors split or joined): a StoredTensor, or None for the plain read."""
        return None

    def gguf_row_order(self, name: str) -> torch.Tensor | None:
        """Where llama.cpp's converter reordered the rows of a tensor: the order that
        undoes it (None: as stored)."""
        return None


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


def get_architecture(config: ModelConfig, linear: LinearFactory | None = None) -> Architecture:
    if config.architecture not in _REGISTRY:
        raise StrataError(f"architecture '{config.architecture}' is not supported; "
                          f"supported: {', '.join(supported_architectures())}")
    return _REGISTRY[config.architecture](config, linear)
