"""Dense projections of windows of 1-4 tokens as one Triton GEMV (y = x W^T + b).

A decoding window multiplies one token (a few with drafts) by each weight: the product is
a read of the weight, and on a GPU the fixed cost of a small kernel. cuBLAS's GEMV of a
30B MoE's o_proj (2048 x 4096, bf16) takes ~9 us for 4 us of bytes, the default model's
down_proj (576 x 1536) ~5 us for 0.4, and cuBLAS launches plainly, so the kernel before it
and the one after cannot overlap its start and end (strata/layers/pdl.py). This kernel is
a programmatic dependent launch like Strata's other kernels: program i owns BLOCK_N rows
of W and walks them BLOCK_K columns a step, each token's products summed in float32 and
rounded once to the output dtype, the bias (if any) added before that rounding as cuBLAS's
epilogue does. A gated MLP's down projection takes its input's silu(gate) * up as it
loads it, where PyTorch takes a launch of its own. Measured on the H200 (benchmarks/README.md): 5.1 us for that o_proj, 1.5
for that down_proj.

`takes` says where it runs by default (`Linear.path` "auto"): CUDA, bf16 or fp16, and the
shapes where it measured faster than cuBLAS: 1-2 tokens but for short rows of a wide
weight (the default model's lm_head, 49152 x 576), 3-4 tokens for small weights only.

NOTE: importing this module imports triton; strata/layers/linear.py imports it only on the
path that runs it. Nothing here syncs with the host or allocates by data (CUDA graphs).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernel's
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

from strata.layers import pdl

MAX_TOKENS = 4
DTYPES = (torch.bfloat16, torch.float16)  # "auto"'s; the kernel also takes float32


# NOTE: the weight's shape is not specialised on beyond triton's divisibility by 16.
@triton.jit
def _gemv(x_ptr, w_ptr, b_ptr, out_ptr,            # [T, K], [N, K], [N], [T, N]
          num_rows, num_cols, stride_xt, stride_w, stride_ot,
          TOKENS: tl.constexpr, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
          PDL: tl.constexpr):
    if PDL:
        pdl.wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    row_start = tl.where(row_ok, rows, 0).to(tl.int64) * stride_w
    t = tl.arange(0, T_PAD)
    acc = tl.zeros([T_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, num_cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < num_cols
        w = tl.load(w_ptr + row_start[:, None] + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        for token in tl.static_range(TOKENS):
            x = tl.load(x_ptr + token * stride_xt + k, mask=k_ok, other=0.0)
            if GATED:  # x is silu(gate) * up, gate and up the halves of x's row, each
                # rounded as fused.silu_mul rounds
                up = tl.load(x_ptr + token * stride_xt + num_cols + k, mask=k_ok, other=0.0)
                gate = x.to(tl.float32)
                x = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
                x = (x.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
            x = x.to(tl.float32)
            y = tl.sum(w * x[None, :], axis=1)                                 # [BLOCK_N]
            acc = tl.where(t[:, None] == token, acc + y[None, :], acc)
    if PDL:
        pdl.release()
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + t[:, None] * stride_ot + rows[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(t < TOKENS)[:, None] & row_ok[None, :])


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can this kernel compute `x @ weight.T`: 1 to MAX_TOKENS tokens, one float dtype?"""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS and x.dtype == weight.dtype
            and x.dtype.is_floating_point)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does it by default: where it measured faster than cuBLAS?"""
    if not fits(x, weight) or x.dtype not in DTYPES:
        return False
    tokens, (rows, cols) = x.shape[0], weight.shape
    if tokens <= 2:
        return cols >= 1024 or rows <= 16384
    return rows * cols <= 1 << 20


def constants(cols: int) -> dict:
    """Rows a program and columns a step, by the weight's row length (an H200 sweep of 2-8
    rows, 512-2048 columns and 4-8 warps: benchmarks/README.md)."""
    return dict(BLOCK_N=2 if cols >= 2048 else 4,
                BLOCK_K=min(2048, triton.next_power_of_2(cols)))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         gated: bool = False) -> torch.Tensor:
    """x [T, K] (1 <= T <= MAX_TOKENS) @ weight [N, K].T (+ bias [N]) -> [T, N] in x's
    dtype; x, weight and bias of one float dtype. `gated`: x is [T, 2K], gate and up, and
    the product is of silu(gate) * up (a gated MLP's down projection)."""
    tokens, cols = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    rows = weight.shape[0]
    if not fits(x, weight) or weight.shape[1] != cols:
        raise ValueError(f"gemv takes 1 to {MAX_TOKENS} tokens of the weight's dtype and row "
                         f"length: x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
    sizes = constants(cols)
    _gemv[(triton.cdiv(rows, sizes["BLOCK_N"]),)](
        x, weight, bias if bias is not None else out, out, rows, cols, x.stride(0),
        weight.stride(0), out.stride(0), TOKENS=tokens,
        T_PAD=triton.next_power_of_2(tokens), HAS_BIAS=bias is not None, GATED=gated, **sizes,
        **pdl.constants(x.device), num_warps=4)
    return out
