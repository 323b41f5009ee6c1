"""Dense projections of windows of 1-64 tokens as one Triton kernel (y = x W^T + b).

A decoding window multiplies one token (a few with drafts) by each weight: the product is
a read of the weight, and on a GPU the fixed cost of a small kernel. cuBLAS's GEMV of a
30B MoE's o_proj (2048 x 4096, bf16) takes ~9 us for 4 us of bytes, the default model's
down_proj (576 x 1536) ~5 us for 0.4, and cuBLAS launches plainly, so the kernel before it
and the one after cannot overlap its start and end (strata/layers/pdl.py). This kernel is
a programmatic dependent launch like Strata's other kernels, whose programs load their
first step's weights before they wait for the kernel before (pdl.py): program i owns
BLOCK_N rows of W and walks them BLOCK_K columns a step, each token's products summed in
float32 and rounded once to the output dtype, the bias (if any) added before that
rounding as cuBLAS's epilogue does. A gated MLP's down projection takes its input's
silu(gate) * up as it loads it, where PyTorch takes a launch of its own. Measured on the
H200 (benchmarks/README.md): 5.1 us for that o_proj, 1.5 for that down_proj.

Windows of 5-64 tokens (decoding slots with their drafts) take `_gemm` instead: the same
walk, every token at once on the tensor cores; it beats cuBLAS on small weights only
(the default model's: 2.7-4.0 us against 4.0-5.5 at 8-36 tokens). A gated input's walk
is split over several programs per row tile (`gemm_splits`), whose partial sums the
tile's last program adds up (split_sums.py): silu(gate) * up on load lengthens every
step, and the default model's down projection (36 row tiles of 1536 columns) took 18 us
walked whole, 7.1 in 6 splits, where silu_mul then cuBLAS took 8.9 (an H100, 5-16
tokens). A plain walk splits by nothing: the sums' store and count cost more than the
shorter walk saves (qkv 960 x 576: 2.3 us whole, 3.5 in 2 splits).

`takes` says where they run by default (`Linear.path` "auto"): CUDA, bf16 or fp16, and the
shapes where they measured faster than cuBLAS: 1-2 tokens but for short rows of a wide
weight (the default model's lm_head, 49152 x 576), 3-4 tokens of weights up to 2^20
values, 5-64 tokens of weights up to 2^21 values with rows of up to 1024 (the row length
swept), or 5-16 tokens of a gated input with rows of any length (where PyTorch takes
silu_mul's kernel first; at 36 tokens cuBLAS was faster: 9.1 us against 9.7).

NOTE: importing this module imports triton; strata/layers/linear.py imports it only on the
path that runs it. Nothing here syncs with the host or allocates by data (CUDA graphs).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernel's
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

from strata.layers import pdl
from strata.layers.split_sums import finish, split_sums

ROW_TOKENS = 4   # windows of up to this many tokens: _gemv; larger ones: _gemm
GATED_TOKENS = 16  # ... by default up to this many with a gated input
MAX_TOKENS = 64
DTYPES = (torch.bfloat16, torch.float16)  # "auto"'s; the kernel also takes float32


# NOTE: the weight's shape is not specialised on beyond triton's divisibility by 16.
@triton.jit
def _gemv(x_ptr, w_ptr, b_ptr, out_ptr,            # [T, K], [N, K], [N], [T, N]
          num_rows, num_cols, stride_xt, stride_w, stride_ot,
          TOKENS: tl.constexpr, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
          PDL: tl.constexpr, EARLY: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    row_start = tl.where(row_ok, rows, 0).to(tl.int64) * stride_w
    t = tl.arange(0, T_PAD)
    acc = tl.zeros([T_PAD, BLOCK_N], dtype=tl.float32)
    # Each step's weights are loaded a step ahead, the first before the wait: no kernel
    # writes a weight, so they stream in while the kernel before this one finishes.
    k = tl.arange(0, BLOCK_K)
    w_next = tl.load(w_ptr + row_start[:, None] + k[None, :],
                     mask=row_ok[:, None] & (k < num_cols)[None, :], other=0.0)
    if PDL:
        if EARLY:  # all programs run at once (pdl.one_wave): the next may launch now
            pdl.release()
        pdl.wait()
    for k0 in range(0, num_cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < num_cols
        w = w_next.to(tl.float32)
        w_next = tl.load(w_ptr + row_start[:, None] + (k + BLOCK_K)[None, :],
                         mask=row_ok[:, None] & (k + BLOCK_K < num_cols)[None, :], other=0.0)
        for token in tl.static_range(TOKENS):
            x = tl.load(x_ptr + token * stride_xt + k, mask=k_ok, other=0.0)
            if GATED:  # x is silu(gate) * up, gate and up the halves of x's row
                x = _silu_mul(x, tl.load(x_ptr + token * stride_xt + num_cols + k, mask=k_ok,
                                         other=0.0))
            x = x.to(tl.float32)
            y = tl.sum(w * x[None, :], axis=1)                                 # [BLOCK_N]
            acc = tl.where(t[:, None] == token, acc + y[None, :], acc)
    if PDL and not EARLY:
        pdl.release()
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + t[:, None] * stride_ot + rows[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(t < TOKENS)[:, None] & row_ok[None, :])


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up, each rounded to up's dtype as fused.silu_mul rounds."""
    g = gate.to(tl.float32)
    x = (g / (1.0 + tl.exp(-g))).to(up.dtype)
    return (x.to(tl.float32) * up.to(tl.float32)).to(up.dtype)


@triton.jit
def _gemm_step(x_ptr, w, acc, t, t_ok, k, hi, num_cols, stride_xt, GATED: tl.constexpr,
               DOT_FP32: tl.constexpr):
    """acc + the tokens' columns `k` (those below `hi`) times w [BLOCK_K, BLOCK_N]."""
    x_at = x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :]
    x_ok = t_ok[:, None] & (k < hi)[None, :]
    x = tl.load(x_at, mask=x_ok, other=0.0)                                 # [M, BLOCK_K]
    if GATED:
        x = _silu_mul(x, tl.load(x_at + num_cols, mask=x_ok, other=0.0))
    if DOT_FP32:  # NOTE: triton's interpreter multiplies bf16 dot operands wrongly
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, w, acc)


# NOTE: the window's size changes with every call: not specialised on (BLOCK_M is).
@triton.jit(do_not_specialize=["num_tokens"])
def _gemm(x_ptr, w_ptr, b_ptr, out_ptr,            # [T, K], [N, K], [N], [T, N]
          partial_ptr, count_ptr,                  # [splits, T, N] fp32, counters
          num_tokens, num_rows, num_cols, stride_xt, stride_w, stride_ot,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          HAS_BIAS: tl.constexpr, GATED: tl.constexpr, DOT_FP32: tl.constexpr,
          SPLIT: tl.constexpr, PDL: tl.constexpr):
    """Windows of ROW_TOKENS + 1 to MAX_TOKENS tokens: program (i, j) multiplies every token
    by BLOCK_N rows of W over split j of the columns (all of them with one split), BLOCK_K
    columns a step, on the tensor cores (float32 sums); the splits of a row tile are added
    up by its last program to finish (split_sums.finish)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    row_start = tl.where(row_ok, rows, 0).to(tl.int64) * stride_w
    t = tl.arange(0, BLOCK_M)
    t_ok = t < num_tokens
    per_split = tl.cdiv(tl.cdiv(num_cols, BLOCK_K), tl.num_programs(1)) * BLOCK_K
    lo = tl.program_id(1) * per_split
    hi = tl.minimum(num_cols, lo + per_split)
    # The first step's weights before the wait (as _gemv), its product peeled off the
    # loop (whose loads triton pipelines).
    k = lo + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + row_start[None, :] + k[:, None],
                mask=(k < hi)[:, None] & row_ok[None, :], other=0.0)        # [BLOCK_K, N]
    if PDL:
        pdl.wait()
    acc = _gemm_step(x_ptr, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), t, t_ok, k,
                     hi, num_cols, stride_xt, GATED, DOT_FP32)
    for k0 in range(lo + BLOCK_K, hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + row_start[None, :] + k[:, None],
                    mask=(k < hi)[:, None] & row_ok[None, :], other=0.0)
        acc = _gemm_step(x_ptr, w, acc, t, t_ok, k, hi, num_cols, stride_xt, GATED, DOT_FP32)
    if PDL:
        pdl.release()
    if HAS_BIAS:  # once, by the first split
        first = tl.full([BLOCK_N], 0, tl.int32) + tl.program_id(1) == 0
        acc += tl.load(b_ptr + rows, mask=row_ok & first, other=0.0).to(tl.float32)[None, :]
    finish(acc, out_ptr, partial_ptr, count_ptr,
           t[:, None].to(tl.int64) * stride_ot + rows[None, :], num_tokens * stride_ot,
           t_ok[:, None] & row_ok[None, :], SPLIT)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can these kernels compute `x @ weight.T`: 1 to MAX_TOKENS tokens, one float dtype?"""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS and x.dtype == weight.dtype
            and x.dtype.is_floating_point)


def takes(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Do they by default: where they measured faster than cuBLAS? (`gated`: x holds gate
    and up; where they do not, silu_mul's kernel runs first, then cuBLAS.)"""
    if not fits(x, weight) or x.dtype not in DTYPES:
        return False
    tokens, (rows, cols) = x.shape[0], weight.shape
    if tokens <= 2:
        return cols >= 1024 or rows <= 16384
    if tokens <= ROW_TOKENS:
        return rows * cols <= 1 << 20
    if gated:  # the tile of 16 tokens (at 36 tokens, 64: slower than cuBLAS)
        return tokens <= GATED_TOKENS and rows * cols <= 1 << 21
    return rows * cols <= 1 << 21 and cols <= 1024


def constants(cols: int) -> dict:
    """Rows a program and columns a step, by the weight's row length (an H200 sweep of 2-8
    rows, 512-2048 columns and 4-8 warps: benchmarks/README.md)."""
    return dict(BLOCK_N=2 if cols >= 2048 else 4,
                BLOCK_K=min(2048, triton.next_power_of_2(cols)))


GEMM_ROWS, GEMM_COLS = 16, 128  # _gemm's tile of W (an H200 sweep: benchmarks/README.md)
GEMM_PROGRAMS = 256   # _gemm splits a gated walk until this many programs run...
MIN_SPLIT_STEPS = 2   # ...each walking at least this many steps of GEMM_COLS columns
MAX_SPLITS = 8


def gemm_splits(rows: int, cols: int, gated: bool = False) -> int:
    """Splits of `_gemm`'s column walk for a weight [rows, cols]: with a gated input
    (silu on load), enough that GEMM_PROGRAMS run, each walking at least MIN_SPLIT_STEPS
    steps; a plain one is walked whole (measured: module docstring)."""
    if not gated:
        return 1
    tiles, steps = triton.cdiv(rows, GEMM_ROWS), triton.cdiv(cols, GEMM_COLS)
    return max(1, min(MAX_SPLITS, steps // MIN_SPLIT_STEPS, triton.cdiv(GEMM_PROGRAMS, tiles)))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         gated: bool = False, splits: int | None = None) -> torch.Tensor:
    """x [T, K] (1 <= T <= MAX_TOKENS) @ weight [N, K].T (+ bias [N]) -> [T, N] in x's
    dtype; x, weight and bias of one float dtype. `gated`: x is [T, 2K], gate and up, and
    the product is of silu(gate) * up (a gated MLP's down projection). `splits`: of the
    GEMM's column walk (windows of more than ROW_TOKENS tokens; default `gemm_splits`)."""
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
    if tokens > ROW_TOKENS:
        tiles = triton.cdiv(rows, GEMM_ROWS)
        splits = splits or gemm_splits(rows, cols, gated)
        return split_sums(x, rows, tiles, splits, lambda out, partial, counts: _gemm[(
            tiles, splits)](
            x, weight, bias if bias is not None else out, out, partial, counts, tokens, rows,
            cols, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=max(16, triton.next_power_of_2(tokens)), BLOCK_N=GEMM_ROWS,
            BLOCK_K=GEMM_COLS, HAS_BIAS=bias is not None, GATED=gated,
            DOT_FP32=x.dtype == torch.float32 or x.device.type != "cuda", SPLIT=splits > 1,
            **pdl.constants(x.device), num_warps=4))
    out = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
    sizes = constants(cols)
    programs = triton.cdiv(rows, sizes["BLOCK_N"])
    _gemv[(programs,)](
        x, weight, bias if bias is not None else out, out, rows, cols, x.stride(0),
        weight.stride(0), out.stride(0), TOKENS=tokens,
        T_PAD=triton.next_power_of_2(tokens), HAS_BIAS=bias is not None, GATED=gated, **sizes,
        **pdl.constants(x.device), EARLY=pdl.one_wave(programs, x.device), num_warps=4)
    return out
