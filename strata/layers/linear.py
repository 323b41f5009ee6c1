"""Projections and how their weights are kept: ParamSpec, Linear and the LinearFactory.

Layers never build `nn.Linear` themselves: they ask the stage's LinearFactory, which knows
the stage's weight format. Every parameter may carry a ParamSpec saying how the loader
(strata/weights/loader.py) keeps it; modules are built on the meta device and each
parameter is materialised where and how its spec says, one at a time — no module is built
dense and cast as a whole. Today a spec names a dtype (the stage's, or float32 for a
router that must stay exact) and, for a stacked projection (q, k and v as one `qkv_proj`),
the checkpoint's projections whose rows it stacks; and whether a projection's weight may
stay in its file's quantized blocks (strata/quant: the matmul then dequantizes inside its
kernel). Host-RAM placement is the next kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from strata import quant
from strata.layers.fused import silu_mul


@dataclass(frozen=True)
class ParamSpec:
    dtype: torch.dtype | None = None  # None: the stage's weight dtype (--dtype)
    # (sibling projection, rows) whose checkpoint tensors this parameter stacks, in order.
    parts: tuple[tuple[str, int], ...] = ()
    # A projection's weight stored in a block format of strata/quant stays in its blocks.
    quantized: bool = False


STAGE_DTYPE = ParamSpec()


def spec_of(param: nn.Parameter) -> ParamSpec:
    return getattr(param, "spec", STAGE_DTYPE)


def with_spec(param: nn.Parameter, spec: ParamSpec) -> nn.Parameter:
    param.spec = spec  # NOTE: read by the loader, copied onto the loaded parameter
    return param


@dataclass(frozen=True)
class WeightFormat:
    """How a stage keeps its projection weights."""
    dtype: torch.dtype | None = None  # dense weights of this dtype; None: the stage's
    quantized: bool = False           # weights in a supported block format stay in it


PREFETCH_TOKENS = 64  # windows whose projections may ask L2 for their weights ahead


class Linear(nn.Module):
    """y = x W^T (+ b), with W [out, in] kept as its spec says: dense, or (the loader
    decides, from the file) a uint8 tensor of its GGUF blocks whose `qtype` names the
    format, multiplied by strata/quant's kernels. A dense weight multiplies windows of a
    few tokens on CUDA with gemv_triton.py's kernel where it is faster than cuBLAS."""

    # "torch" (F.linear), "triton" (gemv_triton.py, for windows of up to its MAX_TOKENS
    # tokens) or "auto": triton for CUDA tensors where gemv_triton.takes them.
    path = "auto"

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: ParamSpec):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = with_spec(nn.Parameter(torch.empty(out_features, in_features)), spec)
        self.bias = (with_spec(nn.Parameter(torch.empty(out_features)), spec) if bias
                     else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        w = self.weight
        if w.dtype == torch.uint8:
            y = quant.matmul(x, w, w.qtype)
            return y if self.bias is None else y + self.bias
        if self._gemv(x, w):
            from strata.layers import gemv_triton
            return gemv_triton.gemv(x, w, self.bias)
        return F.linear(x, w, self.bias)

    def prefetch(self, x: torch.Tensor) -> None:
        """Ask the GPU's L2 for this projection's weight ahead of its product of a window
        like `x` (decode and verify windows, while latency-bound kernels run before it:
        strata/layers/l2_prefetch.py); nothing elsewhere."""
        if x.is_cuda and x.shape[0] <= PREFETCH_TOKENS and quant.triton_available():
            from strata.layers import l2_prefetch
            l2_prefetch.prefetch(self.weight)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """This projection of silu(gate) * up, gate_up [T, 2 in] holding the two halves: one
        kernel where gemv_triton's takes the window, else silu_mul's and then the product."""
        w = self.weight
        if w.dtype != torch.uint8 and self._gemv(gate_up, w, gated=True):
            from strata.layers import gemv_triton
            return gemv_triton.gemv(gate_up, w, self.bias, gated=True)
        return self(silu_mul(gate_up))

    def _gemv(self, x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> bool:
        """Does gemv_triton's kernel multiply this window (see `path`)?"""
        if self.path == "torch" or (self.path == "auto"
                                    and not (x.is_cuda and quant.triton_available())):
            return False
        from strata.layers import gemv_triton
        return (gemv_triton.fits(x, w) if self.path == "triton"
                else gemv_triton.takes(x, w, gated))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class LinearFactory:
    """Makes every projection of a stage in the stage's weight format."""

    def __init__(self, format: WeightFormat = WeightFormat()):
        self.format = format

    def __call__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype: torch.dtype | None = None) -> Linear:
        """`dtype` pins this projection's weights (a router kept in float32, never
        quantized)."""
        spec = ParamSpec(dtype or self.format.dtype,
                         quantized=self.format.quantized and dtype is None)
        return Linear(in_features, out_features, bias, spec)

    def stacked(self, in_features: int, parts: dict[str, int], *, bias: bool = False) -> Linear:
        """One projection whose output rows are those of the checkpoint's projections
        `parts` (name -> rows, in order; siblings of this one): one GEMM instead of several."""
        spec = ParamSpec(self.format.dtype, tuple(parts.items()), self.format.quantized)
        return Linear(in_features, sum(parts.values()), bias, spec)
