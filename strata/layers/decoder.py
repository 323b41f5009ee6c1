"""The pre-norm decoder layer shared by llama-family architectures:
x + attn(norm(x)), then h + mlp(norm(h)). The attention (or any token mixer that keeps
its state in the layer's cache) and the MLP are supplied by the architecture file. The
first residual add and the norm after it are one fused step (strata/layers/fused.py);
`forward_split` leaves the second add to whoever comes next (the next layer's input norm,
or the final norm), so that it is fused with a norm too. An MLP that can take the
post-attention add and norm into its own first launch (NormingMLP: SparseMoE, with its
router's logits) makes them itself."""

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from strata.kvcache.cache import Cache
from strata.layers.forward_meta import ForwardMeta
from strata.layers.norm import RMSNorm


@runtime_checkable
class NormingMLP(Protocol):
    """An MLP that makes the post-attention add and norm itself, where its first launch
    can take them in (SparseMoE: with the router's logits)."""

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor,
                         norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP of norm(x + residual), x + residual)."""


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm, mixer_name: str = "self_attn"):
        """`mixer_name`: the token mixer's name in the checkpoint (Qwen3-Next's DeltaNet
        layers call it `linear_attn`)."""
        super().__init__()
        self.input_layernorm = norm(hidden, eps)
        setattr(self, mixer_name, self_attn)
        object.__setattr__(self, "_mixer", self_attn)  # NOTE: a plain reference, not a
                                                       # second registration
        self.post_attention_layernorm = norm(hidden, eps)
        self.mlp = mlp
        self._mlp_norms = isinstance(mlp, NormingMLP)

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: Cache) -> torch.Tensor:
        out, h = self.forward_split(x, None, meta, cache)
        return h + out

    def forward_split(self, x: torch.Tensor, residual: torch.Tensor | None, meta: ForwardMeta,
                      cache: Cache) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on input `x + residual` (`residual` None: on `x`), returned as its two
        summands (mlp output, h), whose sum is the layer's output: the add is left to the
        next norm, which makes it with its own kernel's (RMSNorm.add_and_norm)."""
        if residual is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_and_norm(x, residual)
        attn = self._mixer(normed, meta, cache)
        if self._mlp_norms:
            return self.mlp.add_norm_forward(attn, x, self.post_attention_layernorm)
        h, normed = self.post_attention_layernorm.add_and_norm(attn, x)  # h = x + attn
        return self.mlp(normed), h
