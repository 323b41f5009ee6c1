"""The gated (SwiGLU) feed-forward block of llama-family models."""

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
