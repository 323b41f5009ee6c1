"""A model's multi-token-prediction layer, in two checkpoint layouts:

- MTPHead (DeepSeek-V3 / GLM-4.5, `model.layers.{L}.*` with L = num_hidden_layers): one
  step pairs a token with the previous hidden state, `eh_proj(cat(enorm(embed(t)),
  hnorm(h)))`, then the MTP decoder layer, then `shared_head.norm`;
- Qwen3NextMTP (Qwen3-Next, Qwen3.5: `mtp.*`): `fc(cat(pre_fc_norm_embedding(embed(t)),
  pre_fc_norm_hidden(h)))`, the decoder layer `mtp.layers.0`, then `mtp.norm`.

Both share the stage's embedding (when the stage has one) and lm_head, and offer the same
`step` and `lm_head`. Who runs them and when is the drafter's business
(stage/mtp_drafter.py); these modules only compute.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.kvcache.cache import PagedKVCache
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import LinearFactory
from strata.layers.norm import RMSNorm


class MTPHead(nn.Module):
    """Parameters named as in the checkpoint under `mtp.` (the stage strips it on load)."""

    def __init__(self, index: int, layer: nn.Module, *, vocab: int, hidden: int, eps: float,
                 embed: nn.Embedding | None, lm_head: nn.Module, linear: LinearFactory):
        """`layer`: the architecture's decoder layer number `index` (= the main model's
        layer count); `embed`: the stage's embedding, if it has one."""
        super().__init__()
        self.index = index
        self.model = nn.Module()
        self.model.embed_tokens = embed if embed is not None else nn.Embedding(vocab, hidden)
        layer.enorm = RMSNorm(hidden, eps)
        layer.hnorm = RMSNorm(hidden, eps)
        layer.eh_proj = linear(2 * hidden, hidden)
        layer.shared_head = nn.Module()
        layer.shared_head.norm = RMSNorm(hidden, eps)
        self.model.layers = nn.ModuleDict({str(self.index): layer})
        self.lm_head = lm_head

    @property
    def layer(self) -> nn.Module:
        return self.model.layers[str(self.index)]

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, meta: ForwardMeta,
             cache: PagedKVCache) -> torch.Tensor:
        """tokens [N], previous hidden [N, h] -> MTP hidden [N, h] (after shared_head.norm)."""
        layer = self.layer
        x = layer.eh_proj(torch.cat((layer.enorm(self.model.embed_tokens(tokens)),
                                     layer.hnorm(hidden)), dim=-1))
        return layer.shared_head.norm(layer(x, meta, cache))


class Qwen3NextMTP(nn.Module):
    """Parameters named as in the checkpoint once the stage strips its own `mtp.` prefix
    (`mtp.fc.weight`, `mtp.layers.0...`; the embedding and lm_head are the model's)."""

    def __init__(self, index: int, layer: nn.Module, *, vocab: int, hidden: int, eps: float,
                 embed: nn.Embedding | None, lm_head: nn.Module, linear: LinearFactory,
                 norm: type[RMSNorm]):
        """`layer`: the architecture's decoder layer for cache index `index` (= the main
        model's layer count); `norm`: the model's RMSNorm (Qwen3-Next: zero-centred)."""
        super().__init__()
        self.index = index
        self.model = nn.Module()
        self.model.embed_tokens = embed if embed is not None else nn.Embedding(vocab, hidden)
        self.mtp = nn.Module()
        self.mtp.fc = linear(2 * hidden, hidden)
        self.mtp.pre_fc_norm_embedding = norm(hidden, eps)
        self.mtp.pre_fc_norm_hidden = norm(hidden, eps)
        self.mtp.layers = nn.ModuleDict({"0": layer})
        self.mtp.norm = norm(hidden, eps)
        self.lm_head = lm_head

    @property
    def layer(self) -> nn.Module:
        return self.mtp.layers["0"]

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, meta: ForwardMeta,
             cache: PagedKVCache) -> torch.Tensor:
        """tokens [N], previous hidden [N, h] -> MTP hidden [N, h] (after mtp.norm)."""
        m = self.mtp
        x = m.fc(torch.cat((m.pre_fc_norm_embedding(self.model.embed_tokens(tokens)),
                            m.pre_fc_norm_hidden(hidden)), dim=-1))
        return m.norm(self.layer(x, meta, cache))
