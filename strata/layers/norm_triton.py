"""RMSNorm, and the residual add with the RMSNorm after it, as one Triton kernel.

Twice a layer a decoding window runs a norm between two projections. torch.compile makes
each one kernel (strata/layers/fused.py), but a plain launch: the projection after it
cannot start while it ends, nor it while the projection before it ends. This kernel is a
programmatic dependent launch like the projections' (strata/layers/pdl.py), so both of
its boundaries overlap.

Program t takes row t. It rounds where the PyTorch functions of fused.py (the ground
truth) round in the activation dtype: the sum x + residual (which it stores, and
normalises), the normalised row before the weight, the weight's product; a zero-centred
norm's weight (1 + w) is rounded too. The mean of squares is float32, so bf16 results
equal PyTorch's but for that reduction's order.

NOTE: importing this module imports triton; strata/layers/norm.py imports it only on the
path that runs it. Nothing here syncs with the host or allocates by data (CUDA graphs).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernel's
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

from strata.layers import pdl

MAX_HIDDEN = 16384  # a row is one program's block


@triton.jit
def _normed(x, w, hidden, eps, ONE_PLUS: tl.constexpr):
    """Rows x [R, BLOCK] (zeros past `hidden`) normalised and scaled by w [BLOCK], in x's
    dtype, rounded where fused.py's PyTorch rounds: the normalised rows before the weight,
    the weight's product, a zero-centred norm's weight (1 + w). route_triton's norm and
    router kernel calls it too."""
    dtype = x.dtype
    x = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
    if ONE_PLUS:
        w = (1.0 + w.to(tl.float32)).to(dtype)
    return (w.to(tl.float32)[None, :] * (x * scale[:, None]).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, sum_ptr, out_ptr,   # [T, H] x4 (sum: x + res), [H]
              hidden, stride_x, stride_r, eps,
              BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, ONE_PLUS: tl.constexpr,
              PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < hidden
    w = tl.load(w_ptr + i, mask=ok, other=0.0)  # a weight: before the wait (pdl.py)
    if PDL:  # the next kernel may launch now: it reads nothing of ours before its wait
        pdl.release()
        pdl.wait()
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_x + i, mask=ok, other=0.0)
    if RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + t * stride_r + i, mask=ok,
                                        other=0.0).to(tl.float32)).to(dtype)
    if RESIDUAL:
        tl.store(sum_ptr + t * hidden + i, x, mask=ok)
    y = _normed(x.to(dtype)[None, :], w, hidden, eps, ONE_PLUS)
    tl.store(out_ptr + t * hidden + i[None, :], y, mask=ok[None, :])


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can this kernel norm `x` [T, H] (rows of one float dtype, the weight's) by `weight`?"""
    return (x.dim() == 2 and x.shape[1] == weight.shape[0] <= MAX_HIDDEN
            and x.dtype == weight.dtype and x.dtype.is_floating_point and x.shape[0] > 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, one_plus: bool = False):
    """RMSNorm of x (`residual` given: of x + residual, returned with it as (sum, normed)),
    scaled by `weight` (`one_plus`: by 1 + weight)."""
    tokens, hidden = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    _rms_norm[(tokens,)](
        x, residual if residual is not None else x, weight, total, out, hidden, x.stride(0),
        residual.stride(0) if residual is not None else 0, eps, BLOCK=block,
        RESIDUAL=residual is not None, ONE_PLUS=one_plus, **pdl.constants(x.device),
        num_warps=min(16, max(1, block // 256)))
    return (total, out) if residual is not None else out
