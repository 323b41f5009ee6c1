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
                         self.linear, bias=c.attention_bias)
        return DecoderLayer(c.hidden_size, c.rms_norm_eps, attn,
                            GatedMLP(c.hidden_size, c.intermediate_size, self.linear))

    def gguf_row_order(self, name: str) -> torch.Tensor | None:
        # llama.cpp's converter interleaves the two rotary halves of each q/k head.
        c = self.config
        if name.endswith("self_attn.q_proj.weight"):
            return unpermuted_rotary_rows(c.num_heads, c.head_dim)
        if name.endswith("self_attn.k_proj.weight"):
            return unpermuted_rotary_rows(c.num_kv_heads, c.head_dim)
        return None


def unpermuted_rotary_rows(heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute` as a row order: stored rows [h, d/2, 2] taken
    back as [h, 2, d/2]."""
    return (torch.arange(heads * head_dim).reshape(heads, head_dim // 2, 2)
            .transpose(1, 2).reshape(-1))
