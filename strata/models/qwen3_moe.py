"""Qwen3-MoE: Qwen3 attention with a top-k routed mixture of experts (no shared
expert). Stacked expert tensors are mapped by moe_weights.py."""

from __future__ import annotations

from torch import nn

from strata.layers.decoder import DecoderLayer
from strata.layers.mlp import GatedMLP
from strata.layers.moe import SparseMoE
from strata.layers.rotary import RotaryEmbedding
from strata.models.qwen3 import qwen3_attention
from strata.models.registry import Architecture, register


@register
class Qwen3Moe(Architecture):
    name = "qwen3_moe"
    hf_names = ("Qwen3MoeForCausalLM",)

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        c = self.config
        if c.is_moe_layer(layer):
            mlp = SparseMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                            c.num_experts_per_tok, c.norm_topk_prob, self.linear)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.linear)
        return DecoderLayer(c.hidden_size, c.rms_norm_eps,
                            qwen3_attention(c, rotary, self.linear), mlp)
