"""DeepSeek-V3: multi-head latent attention, and after `first_k_dense_replace` dense
layers a mixture of experts with sigmoid, group-limited routing and shared experts.

The checkpoint's decoder layers num_layers … num_layers + num_mtp_layers - 1 belong to
the MTP module; `make_layer` builds them like any main MoE layer (the module's own
enorm/hnorm/eh_proj/shared_head are not built here).
"""

from __future__ import annotations

from torch import nn

from strata.errors import StrataError
from strata.layers.decoder import DecoderLayer
from strata.layers.linear import LinearFactory
from strata.layers.mla import MLAttention
from strata.layers.mlp import GatedMLP
from strata.layers.moe import GroupedTopKRouter, SharedExpertMoE
from strata.layers.rotary import RotaryEmbedding, rope_kind, yarn_mscale
from strata.models.config import ModelConfig
from strata.models.registry import Architecture, register


@register
class DeepseekV3(Architecture):
    name = "deepseek_v3"
    hf_names = ("DeepseekV3ForCausalLM",)
    released_with_mtp = True

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        c = self.config
        if not 0 <= layer < c.num_layers + c.num_mtp_layers:
            raise StrataError(f"layer {layer} does not exist: the model has {c.num_layers} "
                              f"layers and {c.num_mtp_layers} MTP layers")
        return DecoderLayer(c.hidden_size, c.rms_norm_eps, self.attention(rotary),
                            routed_mlp(c, layer, self.linear))

    def attention(self, rotary: RotaryEmbedding) -> nn.Module:
        c = self.config
        return MLAttention(
            c.hidden_size, c.num_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim, cache_head_dim=c.head_dim,
            rotary=rotary.variant(c.qk_rope_head_dim, interleaved=c.rope_interleave),
            scale=mla_softmax_scale(c), linear=self.linear, bias=c.attention_bias)


def mla_softmax_scale(c: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared when the context is stretched
    (transformers' `yarn_apply_mscale`)."""
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    mscale_all_dim = (c.rope_scaling or {}).get("mscale_all_dim", 0)
    if rope_kind(c.rope_scaling) != "default" and mscale_all_dim:
        scale *= yarn_mscale(float(c.rope_scaling["factor"]), mscale_all_dim) ** 2
    return scale


def routed_mlp(c: ModelConfig, layer: int, linear: LinearFactory) -> nn.Module:
    """The feed-forward of `layer` in the DeepSeek-V3 family (GLM-4.5 too): dense for the
    first layers, then routed experts plus shared experts."""
    if not c.is_moe_layer(layer):
        return GatedMLP(c.hidden_size, c.intermediate_size, linear)
    gate = GroupedTopKRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok,
                             num_groups=c.num_expert_groups, topk_groups=c.topk_expert_groups,
                             norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)
    return SharedExpertMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, gate,
                           c.moe_intermediate_size * c.num_shared_experts, linear)
