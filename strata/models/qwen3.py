"""Qwen3: llama's layout plus an RMSNorm on every query and key head."""

from __future__ import annotations

from torch import nn

from strata.layers.attention import Attention
from strata.layers.decoder import DecoderLayer
from strata.layers.linear import LinearFactory
from strata.layers.mlp import GatedMLP
from strata.layers.rotary import RotaryEmbedding
from strata.models.registry import Architecture, register


def qwen3_attention(config, rotary: RotaryEmbedding, linear: LinearFactory) -> Attention:
    return Attention(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                     rotary, linear, bias=config.attention_bias,
                     qk_norm_eps=config.rms_norm_eps)


@register
class Qwen3(Architecture):
    name = "qwen3"
    hf_names = ("Qwen3ForCausalLM",)

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        c = self.config
        return DecoderLayer(c.hidden_size, c.rms_norm_eps,
                            qwen3_attention(c, rotary, self.linear),
                            GatedMLP(c.hidden_size, c.intermediate_size, self.linear))
