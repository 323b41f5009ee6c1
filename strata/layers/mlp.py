"""The gated (SwiGLU) feed-forward block of llama-family models."""

import torch
from torch import nn

from strata.layers.fused import silu_mul
from strata.layers.linear import LinearFactory


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, linear: LinearFactory):
        super().__init__()
        self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
