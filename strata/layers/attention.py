"""Grouped-query attention with rotary positions over the paged KV cache.

The layer projects q, k and v with one GEMM (`qkv_proj`, the checkpoint's q_proj, k_proj
and v_proj stacked by rows when loaded), normalises and rotates them, then hands them to the
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
        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        self.sizes = (q_rows, kv_rows, kv_rows)
        self.qkv_proj = linear.stacked(
            hidden, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}, bias=bias)
        self.o_proj = linear(num_heads * head_dim, hidden)
        if qk_norm_eps is not None:  # qwen3: RMSNorm over each head before rotary
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.rotary = rotary  # one table shared by all layers of a stage (non-persistent)

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: PagedKVCache) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # views of [T, q + 2 kv]
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, meta.positions)
        out = meta.attend(q, k, v, cache)                       # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
