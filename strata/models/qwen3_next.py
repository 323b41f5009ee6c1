"""Qwen3-Next and Qwen3.5 MoE (text): a hybrid of Gated DeltaNet layers (linear attention, state per slot:
layers/deltanet.py) and gated full-attention layers (a sigmoid output gate per head from
q_proj, partial rotary, q/k norms), every norm zero-centred (scales by 1 + weight, but the
DeltaNet's own output norm), and MoE feed-forwards with a gated shared expert. Which mixer
a layer has is the config's `layer_types`. Qwen3.5 MoE stores the DeltaNet's projections
apart, routes every layer through experts and always renormalises the top-k weights.

Not yet: the MTP layer of these checkpoints (drafts come from the suffix and lookup
proposers), GGUF files, and CUDA graphs or GPU kernels for the DeltaNet layers (they run
eagerly, token by token)."""

from __future__ import annotations

from torch import nn

from strata.kvcache.spec import CacheSpec
from strata.layers.attention import Attention
from strata.layers.decoder import DecoderLayer
from strata.layers.deltanet import GatedDeltaNet, state_spec
from strata.layers.mlp import GatedMLP
from strata.layers.moe import GatedSharedMoE
from strata.layers.norm import ZeroCentredRMSNorm
from strata.layers.rotary import RotaryEmbedding
from strata.models.registry import Architecture, register


@register
class Qwen3Next(Architecture):
    name = "qwen3_next"
    hf_names = ("Qwen3NextForCausalLM",)
    norm = ZeroCentredRMSNorm
    split_projections = False  # the DeltaNet's in_proj_qkvz / in_proj_ba
    norm_topk_prob: bool | None = None  # None: the config's

    def mixer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        c = self.config
        if c.is_linear_attention(layer):
            return GatedDeltaNet(c.hidden_size, c.linear_num_key_heads,
                                 c.linear_num_value_heads, c.linear_key_head_dim,
                                 c.linear_value_head_dim, c.linear_conv_kernel,
                                 c.rms_norm_eps, self.linear,
                                 split_projections=self.split_projections)
        return Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                         rotary.variant(c.rotary_dim or c.head_dim), self.linear,
                         bias=c.attention_bias, qk_norm_eps=c.rms_norm_eps,
                         qk_norm=ZeroCentredRMSNorm, output_gate=True)

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        c = self.config
        if c.is_moe_layer(layer):
            renormalise = (c.norm_topk_prob if self.norm_topk_prob is None
                           else self.norm_topk_prob)
            mlp = GatedSharedMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                                 c.num_experts_per_tok, renormalise,
                                 c.shared_expert_intermediate_size, self.linear)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, self.linear)
        return DecoderLayer(c.hidden_size, c.rms_norm_eps, self.mixer(layer, rotary), mlp,
                            norm=ZeroCentredRMSNorm,
                            mixer_name="linear_attn" if c.is_linear_attention(layer)
                            else "self_attn")  # the checkpoint's names

    def cache_spec(self, layer: int) -> CacheSpec:
        c = self.config
        if c.is_linear_attention(layer):
            return state_spec(c.linear_num_key_heads, c.linear_num_value_heads,
                              c.linear_key_head_dim, c.linear_value_head_dim,
                              c.linear_conv_kernel)
        return super().cache_spec(layer)


@register
class Qwen35Moe(Qwen3Next):
    name = "qwen3_5_moe"
    hf_names = ("Qwen3_5MoeForCausalLM",)
    split_projections = True  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    norm_topk_prob = True
