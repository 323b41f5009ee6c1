"""Qwen3-MoE: Qwen3 attention with a top-k routed mixture of experts (no shared expert).

Checkpoints store experts one by one (`mlp.experts.{e}.gate_proj.weight`) or fused
(`mlp.experts.gate_up_proj`); Strata keeps them stacked per projection
(`mlp.experts.gate_proj` [E, I, hidden]), which is also GGUF's layout.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.layers.decoder import DecoderLayer
from strata.layers.mlp import GatedMLP
from strata.layers.moe import SparseMoE
from strata.layers.rotary import RotaryEmbedding
from strata.models.qwen3 import qwen3_attention
from strata.models.registry import Architecture, register

_STACKED = (".mlp.experts.gate_proj", ".mlp.experts.up_proj", ".mlp.experts.down_proj")


@register
class Qwen3Moe(Architecture):
    name = "qwen3_moe"
    hf_names = ("Qwen3MoeForCausalLM",)

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        c = self.config
        if c.is_moe_layer(layer):
            mlp = SparseMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                            c.num_experts_per_tok, c.norm_topk_prob)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        return DecoderLayer(c.hidden_size, c.rms_norm_eps, qwen3_attention(c, rotary), mlp)

    def load_tensor(self, name, checkpoint) -> torch.Tensor:
        if not name.endswith(_STACKED) or checkpoint.has(name):
            return super().load_tensor(name, checkpoint)
        prefix, proj = name.rsplit(".", 1)  # "model.layers.N.mlp.experts", "gate_proj"
        if checkpoint.has(f"{prefix}.gate_up_proj"):  # fused [E, 2I, hidden]
            if proj == "down_proj":
                return checkpoint.get(f"{prefix}.down_proj")
            gate, up = checkpoint.get(f"{prefix}.gate_up_proj").chunk(2, dim=1)
            return gate if proj == "gate_proj" else up
        return torch.stack([checkpoint.get(f"{prefix}.{e}.{proj}.weight")
                            for e in range(self.config.num_experts)])
