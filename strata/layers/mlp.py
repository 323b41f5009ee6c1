"""The gated (SwiGLU) feed-forward block of llama-family models: one GEMM for gate and
up (`gate_up_proj`, the checkpoint's gate_proj and up_proj stacked by rows when loaded);
the down projection takes their silu(gate) * up (Linear.gated: in its own kernel where it
can)."""

import torch
from torch import nn

from strata.layers.linear import LinearFactory


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, linear: LinearFactory):
        super().__init__()
        self.gate_up_proj = linear.stacked(hidden, {"gate_proj": intermediate,
                                                    "up_proj": intermediate})
        self.down_proj = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj.gated(self.gate_up_proj(x))  # [T, 2I] -> (silu * up) -> [T, h]
