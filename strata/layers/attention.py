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
                 qk_norm_eps: float | None = None, qk_norm: type[RMSNorm] = RMSNorm,
                 output_gate: bool = False):
        """`output_gate` (Qwen3-Next): q_proj also yields a gate per head (its rows
        [query, gate] per head), and the attention output is scaled by sigmoid(gate)
        before o_proj."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        q_rows, kv_rows = num_heads * head_dim * (2 if output_gate else 1), num_kv_heads * head_dim
        self.sizes = (q_rows, kv_rows, kv_rows)
        self.qkv_proj = linear.stacked(
            hidden, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}, bias=bias)
        self.o_proj = linear(num_heads * head_dim, hidden)
        if qk_norm_eps is not None:  # qwen3: RMSNorm over each head before rotary
            self.q_norm = qk_norm(head_dim, qk_norm_eps)
            self.k_norm = qk_norm(head_dim, qk_norm_eps)
        self.rotary = rotary  # one table shared by all layers of a stage (non-persistent)

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: PagedKVCache) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # views of [T, q + 2 kv]
        self.o_proj.prefetch(x)  # its weight into L2 while the attention waits on latency
        gate = None
        if self.output_gate:
            q, gate = q.reshape(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(tokens, self.num_heads * self.head_dim)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k, written = self.rotary.norm_rotate(q, k, meta.positions,
                                                getattr(self, "q_norm", None),
                                                getattr(self, "k_norm", None),
                                                meta.kv_write(v, cache))
        out = meta.attend(q, k, v, cache, written=written)      # [T, H, D]
        out = out.reshape(tokens, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
