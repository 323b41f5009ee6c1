"""Elementwise pieces of the layers that run as one kernel each on CUDA: RMSNorm, the
residual add with the RMSNorm after it, rotary embedding of q and k, SiLU-gate product.

Each is a plain PyTorch function (the ground truth, and what runs on the CPU). When a
CUDA stage turns compilation on (`--compile`), CUDA tensors go through a torch.compile'd
copy of the same function, compiled once for all layers and window sizes (its inputs are
tensors only, its sizes dynamic): one fused kernel instead of 5-10 small ones, which is
most of a CUDA-graph replay's time on small models.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

_compiled: dict[Callable, Callable] = {}
_enabled = False
# NOTE: inductor keeps bf16 intermediates in float32 unless told to round them as eager
# PyTorch does. Rounded, add_rms_norm normalises the very sum it returns, and compiled and
# plain RMSNorm differ only by a reduction's order (bf16 on an H200: 38 of 1.8e7 elements
# differ; 4.5e6 unrounded).
_OPTIONS = {"emulate_precision_casts": True}


def enable_compile() -> None:
    """Send CUDA tensors through the compiled functions from now on (this process)."""
    global _enabled
    _enabled = True


def _fast(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(x: torch.Tensor, *args):
        if _enabled and x.is_cuda:
            if fn not in _compiled:
                _compiled[fn] = torch.compile(fn, dynamic=True, options=_OPTIONS)
            return _compiled[fn](x, *args)
        return fn(x, *args)
    return call


@_fast
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like the reference implementation."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@_fast
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)): the add in the input dtype, as the reference
    does it, then the norm."""
    h = x + residual
    return h, rms_norm.__wrapped__(h, weight, eps)  # the plain function, in this kernel


@_fast
def rotate(q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] rotated by the tables' rows [positions] (non-interleaved,
    every dim rotating)."""
    cos = cos_table[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
    sin = sin_table[positions].unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@_fast
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dim times the second half: [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
