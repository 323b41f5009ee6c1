"""RMSNorm, computed in float32 like the reference implementation; ZeroCentredRMSNorm
(Qwen3-Next, Qwen3.5) stores its weight less one and scales by (1 + weight). On CUDA with
triton both run as norm_triton.py's kernel (the residual add before the norm in it too)."""

import torch
from torch import nn

from strata.layers.fused import add_rms_norm, rms_norm
from strata.quant import triton_available


class RMSNorm(nn.Module):
    # "torch" (fused.py's functions, compiled where the stage compiles), "triton"
    # (norm_triton.py) or "auto": triton for CUDA tensors where norm_triton takes them.
    path = "auto"
    one_plus = False  # scales by 1 + weight (ZeroCentredRMSNorm)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_kernel(x):
            from strata.layers import norm_triton
            return norm_triton.rms_norm(x, self.weight, self.eps, None, self.one_plus)
        return rms_norm(x, self._scale(), self.eps)

    def add_and_norm(self, x: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it): one kernel where compiled or on triton's path."""
        if self.runs_kernel(x):
            from strata.layers import norm_triton
            return norm_triton.rms_norm(x, self.weight, self.eps, residual, self.one_plus)
        return add_rms_norm(x, residual, self._scale(), self.eps)

    def _scale(self) -> torch.Tensor:
        return 1.0 + self.weight if self.one_plus else self.weight

    def runs_kernel(self, x: torch.Tensor) -> bool:
        """Does norm_triton's kernel norm `x` (the path, the device, the shapes)? A fused
        kernel that norms in its own launch (route_triton's `norm_logits`) asks it too."""
        if self.path == "torch" or (self.path == "auto"
                                    and not (x.is_cuda and triton_available())):
            return False
        from strata.layers import norm_triton
        return norm_triton.takes(x, self.weight)


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w scales by (1 + w) (initialised to 0)."""
    one_plus = True
