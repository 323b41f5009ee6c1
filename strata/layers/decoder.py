"""The pre-norm decoder layer shared by llama-family architectures:
x + attn(norm(x)), then h + mlp(norm(h)). The attention (or any token mixer that keeps
its state in the layer's cache) and the MLP are supplied by the architecture file. The
first residual add and the norm after it are one fused step (strata/layers/fused.py)."""

import torch
from torch import nn

from strata.kvcache.cache import Cache
from strata.layers.forward_meta import ForwardMeta
from strata.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: Cache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), meta, cache)
        h, normed = self.post_attention_layernorm.add_and_norm(attn, x)  # h = x + attn
        return h + self.mlp(normed)
