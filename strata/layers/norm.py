"""RMSNorm, computed in float32 like the reference implementation; ZeroCentredRMSNorm
(Qwen3-Next, Qwen3.5) stores its weight less one and scales by (1 + weight)."""

import torch
from torch import nn

from strata.layers.fused import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it): one kernel where compiled."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w scales by (1 + w) (initialised to 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, 1.0 + self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, 1.0 + self.weight, self.eps)
