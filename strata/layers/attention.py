"""Paged grouped-query attention over the block cache.

A layer writes its window's keys and values to the rows named by the slot mapping,
then gathers each entry's whole context through its block table and attends with an
explicit position mask. Nothing here knows about requests, groups or stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.layers.forward_meta import ForwardMeta
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, *, bias: bool = False, qk_norm_eps: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        if qk_norm_eps is not None:  # qwen3: RMSNorm over each head before rotary
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.rotary = rotary  # one table shared by all layers of a stage (non-persistent)

    def forward(self, x: torch.Tensor, meta: ForwardMeta,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, meta.positions)
        k_cache, v_cache = kv                                   # [rows, Hkv, D] each
        k_cache[meta.slot_mapping] = k.to(k_cache.dtype)
        v_cache[meta.slot_mapping] = v.to(v_cache.dtype)
        out = paged_attention(q, k_cache, v_cache, meta)        # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: ForwardMeta, scale: float | None = None) -> torch.Tensor:
    """q: [T, H, D]; caches: [rows, Hkv, D] -> [T, H, D], each token attending to the
    keys of its own entry at positions <= its own. `scale` multiplies q·k (default
    1/sqrt(D))."""
    heads, dim = q.shape[1], q.shape[2]
    q_pad = q.new_zeros(meta.num_entries, meta.max_query, heads, dim)
    q_pad[meta.q_batch, meta.q_offset] = q
    keys = k_cache[meta.kv_gather].to(q.dtype)              # [B, Lk, Hkv, D]
    values = v_cache[meta.kv_gather].to(q.dtype)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=meta.attn_mask, scale=scale, enable_gqa=True)  # [B, H, Lq, D]
    return out.transpose(1, 2)[meta.q_batch, meta.q_offset]
