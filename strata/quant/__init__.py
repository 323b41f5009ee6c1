"""Quantized projection weights: GGUF blocks kept as the file stores them (formats.py) and
multiplied without a dense copy of the weight.

`matmul` picks the kernel: on CUDA, Triton kernels that dequantize inside the kernel (a
GEMV-style kernel for windows of up to GEMV_MAX_TOKENS tokens, which reads the weight once
for all of them; for larger windows, prompt chunks, a dequantize kernel then one GEMM); on
other devices the PyTorch reference (reference.py), which dequantizes per call: correct,
slow, and the tests' ground truth beside `gguf`'s own dequantize. `dequantize` makes one
weight dense the same way (Triton on CUDA, the reference elsewhere): the grouped MoE path
uses it for each routed expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.quant.formats import FORMATS, BlockFormat

GEMV_MAX_TOKENS = 32

__all__ = ["FORMATS", "BlockFormat", "GEMV_MAX_TOKENS", "dequantize", "matmul",
           "triton_available"]


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [..., in] times the quantized weight [out, in] (its blocks [out, row bytes])
    transposed: [..., out] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if blocks.is_cuda:
        from strata.quant import triton_quant
        if 1 <= x2.shape[0] <= GEMV_MAX_TOKENS:
            y = triton_quant.gemv(x2, blocks, qtype)
        else:
            y = F.linear(x2, dequantize(blocks, qtype, x2.dtype))
    else:
        from strata.quant import reference
        y = reference.matmul(x2, blocks, qtype)
    return y.reshape(*lead, y.shape[-1])


def dequantize(blocks: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in `dtype` from its blocks [out, row bytes]: a Triton kernel on
    CUDA, the PyTorch reference elsewhere."""
    if blocks.is_cuda:
        from strata.quant import triton_quant
        return triton_quant.dequantize(blocks, qtype, dtype)
    from strata.quant import reference
    return reference.dequantize(blocks, qtype, dtype)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
