"""Qwen3-Next and Qwen3.5 (MoE and dense, text): a hybrid of Gated DeltaNet layers (linear attention, state per slot:
layers/deltanet.py) and gated full-attention layers (a sigmoid output gate per head from
q_proj, partial rotary, q/k norms), every norm zero-centred (scales by 1 + weight, but the
DeltaNet's own output norm), and MoE feed-forwards with a gated shared expert. Which mixer
a layer has is the config's `layer_types`. Qwen3.5 MoE stores the DeltaNet's projections
apart, routes every layer through experts and always renormalises the top-k weights.

The MTP layer (`mtp.*`: layers/mtp.py's Qwen3NextMTP) drafts as the other MTP
architectures' do. GGUF: llama.cpp's `qwen3next`, `qwen35moe` and `qwen35` layouts
(`read_gguf`), the MTP layer as their `nextn` block (weights/gguf_checkpoint.py; their
converter writes it only when asked, or to a separate file: --mtp-model)."""

from __future__ import annotations

import torch
from torch import nn

from strata.kvcache.spec import CacheSpec
from strata.layers.attention import Attention
from strata.layers.decoder import DecoderLayer
from strata.layers.deltanet import GatedDeltaNet, state_spec
from strata.layers.mlp import GatedMLP
from strata.layers.moe import GatedSharedMoE
from strata.layers.mtp import Qwen3NextMTP
from strata.layers.norm import ZeroCentredRMSNorm
from strata.layers.rotary import RotaryEmbedding
from strata.models.registry import Architecture, register
from strata.weights.tensor import StoredTensor


@register
class Qwen3Next(Architecture):
    name = "qwen3_next"
    hf_names = ("Qwen3NextForCausalLM",)
    released_with_mtp = True
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


    def make_mtp(self, rotary: RotaryEmbedding, embed, lm_head) -> nn.Module:
        """`mtp.*`: fc over [normed embedding, normed hidden], one full-attention MoE
        decoder layer, a final norm (zero-centred norms)."""
        c = self.config
        return Qwen3NextMTP(c.num_layers, self.make_layer(c.num_layers, rotary),
                            vocab=c.vocab_size, hidden=c.hidden_size, eps=c.rms_norm_eps,
                            embed=embed, lm_head=lm_head, linear=self.linear,
                            norm=ZeroCentredRMSNorm)

    def read_gguf(self, checkpoint, name: str):
        """llama.cpp's `qwen3next` layout (convert_hf_to_gguf.py's Qwen3NextModel): norms
        stored plus 1 (not the DeltaNet's own), A_log as -exp(A_log), conv1d squeezed,
        in_proj_qkvz split into attn_qkv (every head's q, then k, then v) and attn_gate
        (z), the shared expert's gate a vector."""
        c = self.config
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            stored = checkpoint.read(name)
            return StoredTensor.of(stored.dense(torch.float32) - 1.0)
        owner = name.rpartition(".linear_attn.")[0]
        if name.endswith("linear_attn.A_log"):
            a = checkpoint.read(f"{owner}.linear_attn.ssm_a").dense(torch.float32)
            return StoredTensor.of(torch.log(-a))
        if name.endswith("linear_attn.conv1d.weight"):
            stored = checkpoint.read(name)
            return StoredTensor.of(stored.dense(torch.float32).unsqueeze(1))
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            joined = StoredTensor.cat_rows([
                checkpoint.read(f"{owner}.linear_attn.in_proj_qkv.weight"),
                checkpoint.read(f"{owner}.linear_attn.in_proj_z.weight")])
            return joined.take_rows(_grouped_qkvz_rows(c))
        if name.endswith("mlp.shared_expert_gate.weight"):
            stored = checkpoint.read(name)
            if len(stored.shape) == 1:
                return StoredTensor.of(stored.dense(torch.float32).unsqueeze(0))
        return None


def _grouped_qkvz_rows(c) -> torch.Tensor:
    """Rows of [attn_qkv; attn_gate] (q of every key head, k, v, then z) in the order of
    Hugging Face's in_proj_qkvz: per key head its q, its k, then its value heads' v and z."""
    hk, dk = c.linear_num_key_heads, c.linear_key_head_dim
    per_head_v = c.linear_num_value_heads // hk * c.linear_value_head_dim
    keys = hk * dk
    z0 = 2 * keys + hk * per_head_v
    rows = []
    for h in range(hk):
        rows += range(h * dk, (h + 1) * dk)                                   # q
        rows += range(keys + h * dk, keys + (h + 1) * dk)                     # k
        rows += range(2 * keys + h * per_head_v, 2 * keys + (h + 1) * per_head_v)  # v
        rows += range(z0 + h * per_head_v, z0 + (h + 1) * per_head_v)        # z
    return torch.tensor(rows, dtype=torch.long)


@register
class Qwen35Moe(Qwen3Next):
    name = "qwen3_5_moe"
    hf_names = ("Qwen3_5MoeForCausalLM",)
    split_projections = True  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    norm_topk_prob = True

    def read_gguf(self, checkpoint, name: str):
        """llama.cpp's `qwen35moe` layout: qwen3next's value changes (norms plus 1, A_log
        as -exp(A_log), conv1d squeezed), the projections apart as in Hugging Face's
        files, and every tensor indexed by value head reordered from grouped by key head
        (h = g * r + j) to tiled (j * key heads + g) — undone here by taking rows (kept in
        their blocks) or, for out_proj's columns, by dequantizing."""
        c = self.config
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return super().read_gguf(checkpoint, name)
        if ".linear_attn." not in name:
            return None
        hk, hv, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim
        keys = 2 * hk * c.linear_key_head_dim
        owner, _, local = name.partition(".linear_attn.")
        if local == "A_log":
            a = checkpoint.read(f"{owner}.linear_attn.ssm_a").dense(torch.float32)
            return StoredTensor.of(torch.log(-a[_grouped(hk, hv, 1)]))
        if local == "dt_bias":
            return StoredTensor.of(checkpoint.read(name).dense(torch.float32)[_grouped(hk, hv, 1)])
        if local in ("in_proj_b.weight", "in_proj_a.weight"):
            return checkpoint.read(name).take_rows(_grouped(hk, hv, 1))
        if local == "in_proj_z.weight":
            return checkpoint.read(name).take_rows(_grouped(hk, hv, dv))
        if local == "in_proj_qkv.weight":
            rows = torch.cat([torch.arange(keys), keys + _grouped(hk, hv, dv)])
            return checkpoint.read(name).take_rows(rows)
        if local == "conv1d.weight":
            rows = torch.cat([torch.arange(keys), keys + _grouped(hk, hv, dv)])
            dense = checkpoint.read(name).dense(torch.float32)[rows]
            return StoredTensor.of(dense.unsqueeze(1))
        if local == "out_proj.weight":
            dense = checkpoint.read(name).dense(torch.float32)
            return StoredTensor.of(dense[:, _grouped(hk, hv, dv)])
        return None


def _grouped(key_heads: int, value_heads: int, dim: int) -> torch.Tensor:
    """Indices into a tensor whose value heads (of `dim` entries each) are tiled (head
    j * key_heads + g) that read them grouped by key head (head g * r + j, r = value
    heads per key head), as Hugging Face's files order them."""
    r = value_heads // key_heads
    heads = [j * key_heads + g for g in range(key_heads) for j in range(r)]
    return torch.tensor([h * dim + d for h in heads for d in range(dim)], dtype=torch.long)


@register
class Qwen35(Qwen35Moe):
    """Qwen3.5 dense (text): Qwen3.5 MoE's layers with a gated MLP instead of experts
    (the config has no experts, so every layer's feed-forward is dense)."""
    name = "qwen3_5"
    hf_names = ("Qwen3_5ForCausalLM",)
