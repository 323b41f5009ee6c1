"""Grouped-query attention with rotary positions over the paged KV cache.

The layer projects q, k and v, normalises and rotates them, then hands them to the
stage's attention backend (strata/attention/), which writes the window's keys and values
to their cache rows and attends. Nothing here knows about requests, groups or stages.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.kvcache.cache import PagedKVCache
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import LinearFactory
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, linear: LinearFactory, *, bias: bool = False,
                 qk_norm_eps: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = linear(num_heads * head_dim, hidden)
        if qk_norm_eps is not None:  # qwen3: RMSNorm over each head before rotary
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.rotary = rotary  # one table shared by all layers of a stage (non-persistent)

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: PagedKVCache) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, meta.positions)
        out = meta.attend(q, k, v, cache)                       # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
