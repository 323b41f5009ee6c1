"""Multi-head latent attention (DeepSeek-V2/V3), over the same paged cache as Attention.

Queries come from the hidden state directly (`q_proj`) or through a low-rank bottleneck
(`q_a_proj` -> RMSNorm -> `q_b_proj`). Keys and values come from one compressed latent
per token (`kv_a_proj_with_mqa` -> RMSNorm -> `kv_b_proj`) plus one rotary key part shared
by all heads. Each head's query and key are [nope dims | rope dims]; only the rope dims
are rotated.

NOTE: the cache holds the decompressed per-head keys and values ([rows, H, D] with
D = max(qk_head_dim, v_head_dim), the narrower of them zero-padded), so MLA runs through
the same attention backend as every other layer; zero dims change neither q·k nor the
values' real dims. Caching the latent instead would be ~H*D*2 / (kv_lora_rank + rope)
times smaller, and is the next step for long contexts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kvcache.cache import PagedKVCache
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import LinearFactory
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding

# NOTE: transformers builds the two latent norms with RMSNorm's default epsilon, not the
# config's rms_norm_eps; we follow it.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, *, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 cache_head_dim: int, rotary: RotaryEmbedding, scale: float,
                 linear: LinearFactory, bias: bool = False):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.cache_dim, self.scale = cache_head_dim, scale
        assert cache_head_dim >= max(self.qk_dim, v_head_dim)
        if q_lora_rank:
            self.q_a_proj = linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = linear(q_lora_rank, num_heads * self.qk_dim)
        else:
            self.q_proj = linear(hidden, num_heads * self.qk_dim)
        self.kv_a_proj_with_mqa = linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.o_proj = linear(num_heads * v_head_dim, hidden, bias=bias)
        self.rotary = rotary  # rotates exactly the rope dims (a variant of the stage's table)

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: PagedKVCache) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(tokens, heads, self.qk_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)                  # [T, H, nope], [T, H, rope]
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1)              # [T, rank], [T, rope]
        q_rope, k_rope = self.rotary(q_rope, k_rope.view(tokens, 1, self.rope_dim),
                                     meta.positions)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(latent)).view(
            tokens, heads, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        q = torch.cat((q_nope, q_rope), dim=-1)                          # [T, H, qk_dim]
        k = torch.cat((k_nope, k_rope.expand(tokens, heads, self.rope_dim)), dim=-1)
        out = meta.attend(self._pad(q), self._pad(k), self._pad(v), cache,
                          scale=self.scale)                              # [T, H, cache_dim]
        return self.o_proj(out[..., :self.v_dim].reshape(tokens, heads * self.v_dim))

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, d] -> [T, H, cache_dim] with zeros after the first d dims."""
        return F.pad(x, (0, self.cache_dim - x.shape[-1]))
