"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): DeepSeek-V3's layer layout, MoE and MTP layers
with grouped-query attention instead of MLA: q/k/v biases (`attention_bias`), optional
q/k RMSNorm per head (`use_qk_norm`), and rotary on the first `partial_rotary_factor` of
each head."""

from __future__ import annotations

from torch import nn

from strata.layers.attention import Attention
from strata.layers.rotary import RotaryEmbedding
from strata.models.deepseek_v3 import DeepseekV3
from strata.models.registry import register


@register
class Glm4Moe(DeepseekV3):
    name = "glm4_moe"
    hf_names = ("Glm4MoeForCausalLM",)

    def attention(self, rotary: RotaryEmbedding) -> nn.Module:
        c = self.config
        return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                         rotary.variant(c.rotary_dim or c.head_dim), self.linear,
                         bias=c.attention_bias,
                         qk_norm_eps=c.rms_norm_eps if c.qk_norm else None)
