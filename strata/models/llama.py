"""Llama (and SmolLM2): grouped-query attention with rotary positions, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from strata.layers.attention import Attention
from strata.layers.decoder import DecoderLayer
from strata.layers.mlp import GatedMLP
from strata.layers.rotary import RotaryEmbedding
from strata.models.registry import Architecture, register


@register
class Llama(Architecture):
    name = "llama"
    hf_names = ("LlamaForCausalLM",)

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        c = self.config
        attn = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary,
                         bias=c.attention_bias)
        return DecoderLayer(c.hidden_size, c.rms_norm_eps, attn,
                            GatedMLP(c.hidden_size, c.intermediate_size))

    def adapt_gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # llama.cpp's converter interleaves the two rotary halves of each q/k head.
        if name.endswith("self_attn.q_proj.weight"):
            return unpermute_rotary_rows(tensor, self.config.num_heads)
        if name.endswith("self_attn.k_proj.weight"):
            return unpermute_rotary_rows(tensor, self.config.num_kv_heads)
        return tensor


def unpermute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: rows [h, d/2, 2] back to [h, 2, d/2]."""
    rows, cols = weight.shape
    return (weight.reshape(heads, rows // heads // 2, 2, cols)
            .transpose(1, 2).reshape(rows, cols))
