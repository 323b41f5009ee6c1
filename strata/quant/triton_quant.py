"""Triton kernels over GGUF-quantized weights kept as their file stores them (formats.py):
`gemv` (y = x @ W^T for a window of 1..32 tokens: the decode and verify path) and
`dequantize` (W dense, for the prompt-chunk path's GEMM). Both read only the block bytes.

Design. A row of W is a run of blocks; each format's row is walked in *groups* of values,
chosen so that a group's quants split in two contiguous runs of C values (C = 16 or 32),
each run with one scale and one offset per row (value = scale * q + offset):

    Q8_0, Q4_0, Q4_1   one 32-value block; its values 0..15 and 16..31 (C = 16)
    Q4_K, Q5_K         32 bytes of nibbles = sub-blocks 2c (low) and 2c+1 (high) (C = 32)
    Q6_K               16 bytes of low nibbles: two 16-value runs 64 apart (C = 16)

so a group loads its quant bytes as a [BLOCK_N, C] tile of contiguous bytes per row, and
its scales as per-row vectors (f16 fields rebuilt from two bytes and bitcast). The quants
stay small integers (exact in bf16/fp16), so the tokens multiply them directly and the
scale and offset apply to the per-row sums: sum_k x_k (s q_k + o) = s (x . q) + o sum(x).

`gemv`, windows of up to ROW_TOKENS tokens (decode, short verify runs): `_gemv_rows`,
program (i, j) owns a few rows and walks split j of their blocks whole, several blocks a
step — each block's groups, as two [rows, groups, C] tiles of quants (a Q4_K block: 4
groups, 32 nibble bytes each, the low nibbles sub-blocks 0, 2, 4, 6, the high ones 1, 3,
5, 7) with their scales (`_step_groups`, `_decode_groups`) —, multiplying on the CUDA
cores. How many rows, blocks a step and warps a program, and when to split, is the
weight's RowWalk (`row_walk`, by format and shape): WIDE walks 2048 values a step with 4
warps, so a 30B's qkv is one step a program, its o two, and neither splits; BY_BLOCK (Q6_K,
an lm_head's many rows, rows that a wide step would mostly pad) one block a step with one
warp. Windows of more: `_gemv`, program
(i, j) owns output rows i*BLOCK_N.. (a row tile) for all the window's tokens (padded to
a power of two, T_PAD) and walks split j of the rows' groups, so the weights are read
once for all tokens, with tl.dot (T_PAD >= 16; REDUCE_TOKENS: below it, a broadcast
sum). On the H200 `_gemv_rows` reads Q4_K 3-5x faster than `_gemv` did at one token
(benchmarks/README.md). The number of
splits follows the weight's and window's shapes only (enough programs to fill a GPU):
with one split the program stores y in x's dtype; with more, each stores an fp32 partial
and the last of a row tile's programs to finish adds them up and stores y (one launch,
no separate sum and cast: strata/layers/split_sums.py). `dequantize`: program (i, g)
writes group g of row tile i.

NOTE: nothing here syncs with the host or allocates by data (a launch can be captured in
a CUDA graph); tile sizes are fixed (no autotuning: a fresh machine compiles in seconds);
only long-stable triton.language is used (load/store/dot/trans/sum/where/bitcast casts,
atomic_add/atomic_xchg and debug_barrier for the split sums), and the kernels compile for
SM86 and SM90 (tests/test_quant_triton.py).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernels'
# `tl.constexpr` annotations as objects.
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from strata.layers import pdl
from strata.layers.split_sums import finish, split_sums
from strata.quant.formats import FORMATS

BLOCK_N = 64          # output rows per program
REDUCE_TOKENS = 4     # windows of up to this many tokens skip tl.dot
MAX_TOKENS = 32       # gemv's largest window
TARGET_PROGRAMS = 256  # gemv splits a row's groups until about this many programs run
MIN_SPLIT_GROUPS = 4  # ... but gives every split at least this many groups
MAX_SPLITS = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# _gemv_rows: windows of up to ROW_TOKENS tokens (RowWalk below).
ROW_TOKENS = 4

# Per format: (values per group, C = quants per run).
GROUPS = {"Q8_0": (32, 16), "Q4_0": (32, 16), "Q4_1": (32, 16),
          "Q4_K": (64, 32), "Q5_K": (64, 32), "Q6_K": (32, 16)}


@dataclass(frozen=True)
class RowWalk:
    """How `_gemv_rows` walks a weight's rows: `rows` a program of `warps` warps, `step`
    blocks a step (all of a step's blocks loaded and multiplied at once; a step of one
    block loads its scale fields once a row), each row tile's blocks split over programs
    until about `programs` run, each split at least `min_split_blocks` blocks."""
    rows: int
    step: int
    warps: int
    programs: int
    min_split_blocks: int


# H200 (benchmarks/README.md): walking 2048 values a step with 4 warps, a 30B's Q4_K qkv
# (5120 x 2048) took 6.7 us at one token instead of 9.2 walking by blocks, its o (2048 x
# 4096) 5.6 instead of 8.4, Q8_0's, Q4_0's and Q4_1's qkv 10.4, 8.8 and 7.4 instead of
# 15.3, 13.7 and 14.8; by blocks stay an lm_head's 151936 rows (Q4_K 118 us against 138
# wide), Q6_K (its 30B-sized weights gained ~1.5 us at one token, lost 2-9 at four), and
# rows that a wide step would mostly pad (576 Q8_0 values: 18 blocks in a step of 32).
WIDE_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K")
WIDE_VALUES = 2048       # values a wide step
WIDE_MAX_ROWS = 32768    # ... for weights of fewer rows
WIDE_MAX_PADDING = 0.25  # ... and at most this share of the steps' blocks past the row's end
WIDE = RowWalk(rows=4, step=0, warps=4, programs=512, min_split_blocks=8)  # step: row_walk
BY_BLOCK = RowWalk(rows=8, step=1, warps=1, programs=2048, min_split_blocks=2)


def row_walk(qtype: str, rows: int, blocks: int) -> RowWalk:
    """How `_gemv_rows` walks a weight of `rows` rows of `blocks` blocks of `qtype`: WIDE
    (its step in blocks) or BY_BLOCK, by the format and the shape only."""
    if qtype in WIDE_FORMATS and rows < WIDE_MAX_ROWS:
        step = min(WIDE_VALUES // FORMATS[qtype].block_values, triton.next_power_of_2(blocks))
        padded = triton.cdiv(blocks, step) * step
        if padded - blocks <= WIDE_MAX_PADDING * padded:
            return replace(WIDE, step=step)
    return BY_BLOCK


@triton.jit
def _f16(ptr, mask):
    """The f16 fields at `ptr` (two little-endian bytes each) as fp32; 0 where masked."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(scales_ptr, sub, mask):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block `sub` (0..7) from the 12 packed
    bytes at `scales_ptr` (a per-row pointer vector), as fp32."""
    # Bytes 0..3: low 6 bits of scales 0..3; 4..7: of mins 0..3; 8..11: low 4 bits of
    # scales (and high 4: of mins) 4..7, whose top two bits are the top bits of 0..7.
    i = sub % 4
    a = tl.load(scales_ptr + i, mask=mask, other=0).to(tl.int32)
    b = tl.load(scales_ptr + 4 + i, mask=mask, other=0).to(tl.int32)
    c = tl.load(scales_ptr + 8 + i, mask=mask, other=0).to(tl.int32)
    scale = tl.where(sub < 4, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(sub < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode_group(blocks_ptr, row_start, row_ok, g, FORMAT: tl.constexpr, C: tl.constexpr):
    """Group `g` of the rows starting at byte offsets `row_start` [BLOCK_N] (int64):
    (q_lo, q_hi) [BLOCK_N, C] fp32 integer quants, their per-row (scale_lo, scale_hi,
    off_lo, off_hi) [BLOCK_N], and the columns (k_lo, k_hi) where the two runs start.
    Value k_lo + j of a row is scale_lo * q_lo[:, j] + off_lo (likewise hi)."""
    j = tl.arange(0, C)
    ok = row_ok[:, None]
    if FORMAT == "Q8_0":  # d f16, 32 x int8
        base = row_start + g * 34
        d = _f16(blocks_ptr + base, row_ok)
        q_lo = tl.load(blocks_ptr + base[:, None] + 2 + j[None, :], mask=ok, other=0)
        q_hi = tl.load(blocks_ptr + base[:, None] + 18 + j[None, :], mask=ok, other=0)
        q_lo = q_lo.to(tl.int8, bitcast=True).to(tl.float32)
        q_hi = q_hi.to(tl.int8, bitcast=True).to(tl.float32)
        s_lo = d
        s_hi = d
        o_lo = tl.zeros_like(d)
        o_hi = o_lo
        k_lo = g * 32
        k_hi = k_lo + 16
    elif FORMAT == "Q4_0" or FORMAT == "Q4_1":  # d f16, [m f16,] 16 bytes: value j | j+16
        if FORMAT == "Q4_0":  # value d * (q - 8)
            base = row_start + g * 18
            d = _f16(blocks_ptr + base, row_ok)
            off = tl.zeros_like(d)
            qs = blocks_ptr + base[:, None] + 2 + j[None, :]
            zero = 8
        else:  # value d * q + m
            base = row_start + g * 20
            d = _f16(blocks_ptr + base, row_ok)
            off = _f16(blocks_ptr + base + 2, row_ok)
            qs = blocks_ptr + base[:, None] + 4 + j[None, :]
            zero = 0
        byte = tl.load(qs, mask=ok, other=0).to(tl.int32)
        q_lo = ((byte & 15) - zero).to(tl.float32)
        q_hi = ((byte >> 4) - zero).to(tl.float32)
        s_lo = d
        s_hi = d
        o_lo = off
        o_hi = off
        k_lo = g * 32
        k_hi = k_lo + 16
    elif FORMAT == "Q4_K" or FORMAT == "Q5_K":
        # d, dmin f16, 12 bytes of scales/mins, [Q5_K: 32 bytes of 5th bits,] 128 bytes of
        # nibbles: byte c*32 + j holds value j of sub-block 2c (low) and 2c+1 (high).
        block = g // 4
        chunk = g % 4
        if FORMAT == "Q4_K":
            base = row_start + block * 144
            qs = blocks_ptr + base[:, None] + 16 + chunk * 32 + j[None, :]
        else:
            base = row_start + block * 176
            qs = blocks_ptr + base[:, None] + 48 + chunk * 32 + j[None, :]
        d = _f16(blocks_ptr + base, row_ok)
        dmin = _f16(blocks_ptr + base + 2, row_ok)
        sc_lo, mn_lo = _k_scale_min(blocks_ptr + base + 4, 2 * chunk, row_ok)
        sc_hi, mn_hi = _k_scale_min(blocks_ptr + base + 4, 2 * chunk + 1, row_ok)
        byte = tl.load(qs, mask=ok, other=0).to(tl.int32)
        lo = byte & 15
        hi = byte >> 4
        if FORMAT == "Q5_K":  # bit b of byte 16 + j: the 5th bit of value j, sub-block b
            qh = tl.load(blocks_ptr + base[:, None] + 16 + j[None, :], mask=ok,
                         other=0).to(tl.int32)
            lo = lo | (((qh >> (2 * chunk)) & 1) << 4)
            hi = hi | (((qh >> (2 * chunk + 1)) & 1) << 4)
        q_lo = lo.to(tl.float32)
        q_hi = hi.to(tl.float32)
        s_lo = d * sc_lo
        s_hi = d * sc_hi
        o_lo = -(dmin * mn_lo)
        o_hi = -(dmin * mn_hi)
        k_lo = g * 64
        k_hi = k_lo + 32
    else:  # Q6_K
        # 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, d f16. Half h of a
        # block (128 values): low-nibble byte h*64 + b (b < 64) holds values b (low) and
        # 64 + b (high); their top bits are in byte 128 + h*32 + b % 32, at bits
        # 2 * (b // 32) and 2 * (2 + b // 32). A group: 16 such bytes, b0 = 16 * (g % 4).
        block = g // 8
        half = (g // 4) % 2
        b0 = (g % 4) * 16
        base = row_start + block * 210
        ql = tl.load(blocks_ptr + base[:, None] + half * 64 + b0 + j[None, :], mask=ok,
                     other=0).to(tl.int32)
        qh = tl.load(blocks_ptr + base[:, None] + 128 + half * 32 + b0 % 32 + j[None, :],
                     mask=ok, other=0).to(tl.int32)
        q_lo = ((ql & 15) | (((qh >> (2 * (b0 // 32))) & 3) << 4)) - 32
        q_hi = ((ql >> 4) | (((qh >> (2 * (2 + b0 // 32))) & 3) << 4)) - 32
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)
        first = half * 128 + b0  # the low run's first value in its block
        d = _f16(blocks_ptr + base + 208, row_ok)
        sc_lo = tl.load(blocks_ptr + base + 192 + first // 16, mask=row_ok, other=0)
        sc_hi = tl.load(blocks_ptr + base + 192 + (first + 64) // 16, mask=row_ok,
                        other=0)
        s_lo = d * sc_lo.to(tl.int8, bitcast=True).to(tl.float32)
        s_hi = d * sc_hi.to(tl.int8, bitcast=True).to(tl.float32)
        o_lo = tl.zeros_like(d)
        o_hi = o_lo
        k_lo = block * 256 + first
        k_hi = k_lo + 64
    return q_lo, q_hi, s_lo, s_hi, o_lo, o_hi, k_lo, k_hi


@triton.jit
def _accumulate(acc, x_ptr, stride_xt, num_tokens, k0, q, scale, offset,
                C: tl.constexpr, T_PAD: tl.constexpr, HAS_OFFSET: tl.constexpr,
                USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc [T_PAD, BLOCK_N] + the window's tokens' columns k0.. k0+C times one run of
    quants q [BLOCK_N, C] with its per-row scale and offset."""
    t = tl.arange(0, T_PAD)
    x = tl.load(x_ptr + t[:, None] * stride_xt + k0 + tl.arange(0, C)[None, :],
                mask=(t < num_tokens)[:, None], other=0.0)                  # [T_PAD, C]
    if USE_DOT:
        if DOT_FP32:
            dots = tl.dot(x.to(tl.float32), tl.trans(q), input_precision="ieee")
        else:  # the quants are small integers: exact in x's dtype
            dots = tl.dot(x, tl.trans(q.to(x.dtype)))
    else:
        dots = tl.sum(x.to(tl.float32)[:, None, :] * q[None, :, :], axis=2)  # [T_PAD, BLOCK_N]
    acc += dots * scale[None, :]
    if HAS_OFFSET:
        acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * offset[None, :]
    return acc


# NOTE: the window's size changes with every call: not specialised on.
@triton.jit(do_not_specialize=["num_tokens"])
def _gemv(x_ptr, blocks_ptr, out_ptr,          # [T, K], [N, row bytes] uint8, [T, N]
          partial_ptr, count_ptr,              # fp32 [S, T, N], int32 [tiles]
          num_tokens, num_rows, stride_xt, stride_row, num_groups,
          FORMAT: tl.constexpr, C: tl.constexpr, T_PAD: tl.constexpr,
          BLOCK_N: tl.constexpr, HAS_OFFSET: tl.constexpr, USE_DOT: tl.constexpr,
          DOT_FP32: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl.wait()
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    row_start = rows.to(tl.int64) * stride_row
    per_split = tl.cdiv(num_groups, tl.num_programs(1))
    lo = split * per_split
    hi = tl.minimum(num_groups, lo + per_split)
    acc = tl.zeros([T_PAD, BLOCK_N], dtype=tl.float32)
    for g in range(lo, hi):
        q_lo, q_hi, s_lo, s_hi, o_lo, o_hi, k_lo, k_hi = _decode_group(
            blocks_ptr, row_start, row_ok, g, FORMAT, C)
        acc = _accumulate(acc, x_ptr, stride_xt, num_tokens, k_lo, q_lo, s_lo, o_lo,
                          C, T_PAD, HAS_OFFSET, USE_DOT, DOT_FP32)
        acc = _accumulate(acc, x_ptr, stride_xt, num_tokens, k_hi, q_hi, s_hi, o_hi,
                          C, T_PAD, HAS_OFFSET, USE_DOT, DOT_FP32)
    if PDL:
        pdl.release()
    t = tl.arange(0, T_PAD)
    finish(acc, out_ptr, partial_ptr, count_ptr,
            t[:, None].to(tl.int64) * num_rows + rows[None, :], num_tokens * num_rows,
            (t < num_tokens)[:, None] & row_ok[None, :], SPLIT)


@triton.jit
def _dequantize(blocks_ptr, out_ptr,                # [N, row bytes] uint8, [N, K]
                num_rows, stride_row, stride_out,
                FORMAT: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    row_ok = rows < num_rows
    q_lo, q_hi, s_lo, s_hi, o_lo, o_hi, k_lo, k_hi = _decode_group(
        blocks_ptr, rows.to(tl.int64) * stride_row, row_ok, g, FORMAT, C)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + tl.arange(0, C)[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out + k_lo, (q_lo * s_lo[:, None] + o_lo[:, None]).to(dtype),
             mask=row_ok[:, None])
    tl.store(out + k_hi, (q_hi * s_hi[:, None] + o_hi[:, None]).to(dtype),
             mask=row_ok[:, None])


@triton.jit
def _decode_groups(blocks_ptr, base, h, FORMAT: tl.constexpr, C: tl.constexpr):
    """Groups of several rows' blocks, each group a [1, N] entry: `base` [ROWS, N] the
    byte offset (int64) of the block that holds it, `h` [1, N] its index in that block
    (0..G-1) — a block's G groups, or several blocks' (group i of a step: block i // G,
    group i % G). Returns (q_a, s_a, o_a, q_b, s_b, o_b): the quants q [ROWS, N, C] (fp32
    integers) and the per-run scale and offset [ROWS, N]. Run a of group h holds the
    block's values _run_starts(h) + j, run b those `second` further; value = s * q + o.
    Each quant byte is loaded once (a nibble byte feeds both runs). NOTE: `base` may be
    negative (an expert cache's rows in host memory, before its pool): no mask may test
    its sign."""
    hq = h[:, :, None]
    j = tl.arange(0, C)[None, None, :]
    at = base[:, :, None]
    every = base == base
    groups = (h * 0).to(tl.float32)  # [1, N] zeros: per-block fields broadcast to the groups
    if FORMAT == "Q8_0":  # d f16, 32 x int8: values j | 16 + j
        q_a = tl.load(blocks_ptr + at + 2 + j).to(tl.int8, bitcast=True).to(tl.float32)
        q_b = tl.load(blocks_ptr + at + 18 + j).to(tl.int8, bitcast=True).to(tl.float32)
        s_a = _f16(blocks_ptr + base, every) + groups
        s_b = s_a
        o_a = tl.zeros_like(s_a)
        o_b = o_a
    elif FORMAT == "Q4_0" or FORMAT == "Q4_1":  # d f16, [m f16,] 16 bytes: j | 16 + j
        byte = tl.load(blocks_ptr + at + (2 if FORMAT == "Q4_0" else 4) + j).to(tl.int32)
        zero = 8 if FORMAT == "Q4_0" else 0
        q_a = ((byte & 15) - zero).to(tl.float32)
        q_b = ((byte >> 4) - zero).to(tl.float32)
        s_a = _f16(blocks_ptr + base, every) + groups
        s_b = s_a
        if FORMAT == "Q4_0":
            o_a = tl.zeros_like(s_a)
        else:
            o_a = _f16(blocks_ptr + base + 2, every) + groups
        o_b = o_a
    elif FORMAT == "Q4_K" or FORMAT == "Q5_K":  # byte 32h + j: sub-blocks 2h | 2h + 1
        byte = tl.load(blocks_ptr + at + (16 if FORMAT == "Q4_K" else 48) + hq * 32
                       + j).to(tl.int32)
        lo = byte & 15
        hi = byte >> 4
        if FORMAT == "Q5_K":  # bit b of byte 16 + j: the fifth bit of value j, sub-block b
            qh = tl.load(blocks_ptr + at + 16 + j).to(tl.int32)
            lo = lo | (((qh >> (2 * hq)) & 1) << 4)
            hi = hi | (((qh >> (2 * hq + 1)) & 1) << 4)
        q_a = lo.to(tl.float32)
        q_b = hi.to(tl.float32)
        d = _f16(blocks_ptr + base, every)
        dmin = _f16(blocks_ptr + base + 2, every)
        sc_a, mn_a = _k_scales(blocks_ptr + base + 4, 2 * h)
        sc_b, mn_b = _k_scales(blocks_ptr + base + 4, 2 * h + 1)
        s_a = d * sc_a
        s_b = d * sc_b
        o_a = -(dmin * mn_a)
        o_b = -(dmin * mn_b)
    else:  # Q6_K (see _decode_group): group h = 16 low-nibble bytes of half h // 4
        half = hq // 4
        b0 = (hq % 4) * 16
        ql = tl.load(blocks_ptr + at + half * 64 + b0 + j).to(tl.int32)
        qh = tl.load(blocks_ptr + at + 128 + half * 32 + b0 % 32 + j).to(tl.int32)
        q_a = (((ql & 15) | (((qh >> (2 * (b0 // 32))) & 3) << 4)) - 32).to(tl.float32)
        q_b = (((ql >> 4) | (((qh >> (2 * (2 + b0 // 32))) & 3) << 4)) - 32).to(tl.float32)
        first = (h // 4) * 128 + (h % 4) * 16
        d = _f16(blocks_ptr + base + 208, every)
        sp = blocks_ptr + base + 192
        s_a = d * tl.load(sp + first // 16).to(tl.int8, bitcast=True).to(tl.float32)
        s_b = d * tl.load(sp + (first + 64) // 16).to(tl.int8, bitcast=True).to(tl.float32)
        o_a = tl.zeros_like(s_a)
        o_b = o_a
    return q_a, s_a, o_a, q_b, s_b, o_b


@triton.jit
def _k_scales(scales_ptr, sub):
    """Q4_K/Q5_K: the 6-bit scales and mins of sub-blocks `sub` [1, N] from the 12 bytes at
    `scales_ptr` [ROWS, N], as fp32 [ROWS, N] (_k_scale_min's unpacking)."""
    i = sub % 4
    a = tl.load(scales_ptr + i).to(tl.int32)
    b = tl.load(scales_ptr + 4 + i).to(tl.int32)
    c = tl.load(scales_ptr + 8 + i).to(tl.int32)
    scale = tl.where(sub < 4, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(sub < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _run_starts(h, FORMAT: tl.constexpr):
    """Where the run a of groups `h` (their indices in their blocks) starts in its block,
    and how far run b is from it."""
    if FORMAT == "Q4_K" or FORMAT == "Q5_K":
        return h * 64, 32
    if FORMAT == "Q6_K":
        return (h // 4) * 128 + (h % 4) * 16, 64
    return h * 32, 16


@triton.jit
def _step_groups(row_start, b0, end, FORMAT: tl.constexpr, G: tl.constexpr,
                 STEP: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_VALUES: tl.constexpr):
    """A step over blocks b0 .. b0 + STEP - 1 of rows starting at byte offsets `row_start`
    [ROWS], as their STEP * G groups: (base [ROWS, N] each group's block's byte offset —
    [ROWS, 1] for a step of one block, so that its scale fields load once a row —, h
    [1, N] its index in the block, first [N] the column where its run a starts, second,
    ok [N] whether its block is before `end`). Blocks past `end` read block end - 1 again
    (their x is masked to 0, so they add nothing)."""
    i = tl.arange(0, STEP * G)
    block = b0 + i // G
    h = i % G
    if STEP == 1:
        base = (row_start + b0 * BLOCK_BYTES)[:, None]
    else:
        base = row_start[:, None] + (tl.minimum(block, end - 1)
                                     * BLOCK_BYTES).to(tl.int64)[None, :]
    first, second = _run_starts(h, FORMAT)
    return base, h[None, :], block * BLOCK_VALUES + first, second, block < end


@triton.jit
def _decode_block(blocks_ptr, base, FORMAT: tl.constexpr, G: tl.constexpr, C: tl.constexpr):
    """_decode_groups of one block a row, at byte offsets `base` [ROWS]: its G groups."""
    return _decode_groups(blocks_ptr, base[:, None], tl.arange(0, G)[None, :], FORMAT, C)


@triton.jit
def _runs(FORMAT: tl.constexpr, G: tl.constexpr):
    """Where a block's groups' runs a start [G], and how far run b is from them."""
    return _run_starts(tl.arange(0, G), FORMAT)


@triton.jit
def _block_dot(q_a, s_a, o_a, q_b, s_b, o_b, x_ptr, first, second, C: tl.constexpr):
    """A decoded block (_decode_block) times the block's values of one token, at x_ptr:
    [ROWS] fp32."""
    return _groups_dot(q_a, s_a, o_a, q_b, s_b, o_b, x_ptr, first, second, first >= 0, C)


@triton.jit
def _groups_dot(q_a, s_a, o_a, q_b, s_b, o_b, x_ptr, first, second, ok, C: tl.constexpr):
    """Decoded groups (_decode_groups) times one token's values at x_ptr + first [N]
    (run a) and + first + second (run b), masked to 0 where not `ok` [N]: [ROWS] fp32."""
    at = first[:, None] + tl.arange(0, C)[None, :]                       # [N, C]
    x_a = tl.load(x_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
    x_b = tl.load(x_ptr + at + second, mask=ok[:, None], other=0.0).to(tl.float32)
    y = (s_a * tl.sum(q_a * x_a[None, :, :], axis=2) + o_a * tl.sum(x_a, axis=1)[None, :]
         + s_b * tl.sum(q_b * x_b[None, :, :], axis=2) + o_b * tl.sum(x_b, axis=1)[None, :])
    return tl.sum(y, axis=1)


@triton.jit
def _rows_dot(acc, t, q_a, s_a, o_a, q_b, s_b, o_b, x_ptr, stride_xt, first, second, ok,
              C: tl.constexpr, TOKENS: tl.constexpr):
    """acc [T_PAD, ROWS] + each token's product with a step's decoded groups."""
    for token in tl.static_range(TOKENS):
        y = _groups_dot(q_a, s_a, o_a, q_b, s_b, o_b, x_ptr + token * stride_xt, first,
                        second, ok, C)
        acc = tl.where(t[:, None] == token, acc + y[None, :], acc)
    return acc


# NOTE: the window's size is a constexpr here (1..ROW_TOKENS: a few variants).
@triton.jit
def _gemv_rows(x_ptr, blocks_ptr, out_ptr,          # [T, K], [N, row bytes] uint8, [T, N]
               partial_ptr, count_ptr,              # fp32 [S, T, N], int32 [tiles]
               num_rows, stride_xt, stride_row, num_blocks,
               FORMAT: tl.constexpr, G: tl.constexpr, C: tl.constexpr,
               BLOCK_BYTES: tl.constexpr, BLOCK_VALUES: tl.constexpr, TOKENS: tl.constexpr,
               T_PAD: tl.constexpr, ROWS: tl.constexpr, STEP: tl.constexpr,
               SPLIT: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    row_start = tl.where(row_ok, rows, 0).to(tl.int64) * stride_row
    per_split = tl.cdiv(num_blocks, tl.num_programs(1))
    lo = tl.program_id(1) * per_split
    hi = tl.minimum(num_blocks, lo + per_split)
    t = tl.arange(0, T_PAD)
    # The first step's blocks are read and decoded before the wait (pdl.py: no kernel
    # writes a weight); a split without blocks decodes its tile's last one, adding 0.
    base, h, first, second, ok = _step_groups(row_start, tl.minimum(lo, hi - 1), hi, FORMAT,
                                              G, STEP, BLOCK_BYTES, BLOCK_VALUES)
    q_a, s_a, o_a, q_b, s_b, o_b = _decode_groups(blocks_ptr, base, h, FORMAT, C)
    if PDL:
        pdl.wait()
    ok = ok & (first * 0 + lo < hi)
    acc = _rows_dot(tl.zeros([T_PAD, ROWS], dtype=tl.float32), t, q_a, s_a, o_a, q_b, s_b,
                    o_b, x_ptr, stride_xt, first, second, ok, C, TOKENS)
    for b0 in range(lo + STEP, hi, STEP):
        base, h, first, second, ok = _step_groups(row_start, b0, hi, FORMAT, G, STEP,
                                                  BLOCK_BYTES, BLOCK_VALUES)
        q_a, s_a, o_a, q_b, s_b, o_b = _decode_groups(blocks_ptr, base, h, FORMAT, C)
        acc = _rows_dot(acc, t, q_a, s_a, o_a, q_b, s_b, o_b, x_ptr, stride_xt, first,
                        second, ok, C, TOKENS)
    if PDL:
        pdl.release()
    finish(acc, out_ptr, partial_ptr, count_ptr,
            t[:, None].to(tl.int64) * num_rows + rows[None, :], TOKENS * num_rows,
            (t < TOKENS)[:, None] & row_ok[None, :], SPLIT)


def check_blocks(blocks: torch.Tensor, qtype: str, name: str | None = None,
                 stacked: bool = False) -> tuple[int, int]:
    """(rows, values per row) of a quantized weight — uint8 [rows, row bytes], or
    [experts, rows, row bytes] when `stacked` — or a ValueError naming the problem (and
    the weight, `name`, where given)."""
    label = name or qtype
    if qtype not in FORMATS or qtype not in GROUPS:
        raise ValueError(f"{name + ': ' if name else ''}unsupported quantization type "
                         f"{qtype!r}; supported: {', '.join(GROUPS)}")
    fmt = FORMATS[qtype]
    layout = "3-D uint8 tensor [experts, rows, row bytes]" if stacked else \
        "2-D uint8 tensor [rows, row bytes]"
    if blocks.dtype != torch.uint8 or blocks.dim() != (3 if stacked else 2):
        raise ValueError(f"{label} blocks must be a {layout}, not {blocks.dtype} of shape "
                         f"{tuple(blocks.shape)}")
    row_bytes = blocks.shape[-1]
    if row_bytes == 0 or row_bytes % fmt.block_bytes:
        raise ValueError(f"{f'{name} ({qtype})' if name else qtype}: a row of {row_bytes} "
                         f"bytes is not a whole number of {fmt.block_bytes}-byte blocks")
    if blocks.stride(-1) != 1:
        raise ValueError(f"{label} blocks must be contiguous along a row")
    return blocks.shape[-2], row_bytes // fmt.block_bytes * fmt.block_values


def gemv_constants(tokens: int, dtype: torch.dtype, qtype: str,
                   device_type: str = "cuda") -> tuple[dict, int]:
    """`_gemv`'s constexprs and num_warps for a window of `tokens` tokens of `dtype`."""
    use_dot = tokens > REDUCE_TOKENS
    # NOTE: triton's interpreter (CPU tensors) multiplies bf16 tl.dot operands as their
    # raw bits (triton 3.9): there the dot runs in fp32.
    dot_fp32 = dtype == torch.float32 or (dtype == torch.bfloat16 and device_type != "cuda")
    constants = dict(FORMAT=qtype, C=GROUPS[qtype][1],
                     T_PAD=max(16, triton.next_power_of_2(tokens)) if use_dot
                     else triton.next_power_of_2(tokens),
                     BLOCK_N=BLOCK_N, HAS_OFFSET=qtype in ("Q4_1", "Q4_K", "Q5_K"),
                     USE_DOT=use_dot, DOT_FP32=dot_fp32)
    return constants, 4


def gemv_splits(rows: int, groups: int) -> int:
    """Splits of each row tile's groups: by the weight's shape only."""
    tiles = triton.cdiv(rows, BLOCK_N)
    return max(1, min(MAX_SPLITS, triton.cdiv(TARGET_PROGRAMS, tiles),
                      groups // MIN_SPLIT_GROUPS))


def gemv(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """y = x @ W^T for x [T, K] (1 <= T <= 32; float32, bfloat16 or float16) and W [N, K]
    quantized as `blocks` [N, row bytes] of `qtype` -> [T, N] in x's dtype (fp32 sums)."""
    rows, values = check_blocks(blocks, qtype)
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be a 2-D float32, bfloat16 or float16 tensor [tokens, "
                         f"{values}], not {x.dtype} of shape {tuple(x.shape)}")
    tokens = x.shape[0]
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"gemv takes 1 to {MAX_TOKENS} tokens, not {tokens}")
    if x.shape[1] != values:
        raise ValueError(f"x has {x.shape[1]} features but the {qtype} weight's rows hold "
                         f"{values} values")
    if x.device != blocks.device:
        raise ValueError(f"x is on {x.device} but the weight on {blocks.device}")
    x = x.contiguous()
    if tokens <= ROW_TOKENS:
        return _gemv_by_rows(x, blocks, qtype, rows, values)
    groups = values // GROUPS[qtype][0]
    splits = gemv_splits(rows, groups)
    constants, num_warps = gemv_constants(tokens, x.dtype, qtype, x.device.type)
    tiles = triton.cdiv(rows, BLOCK_N)
    return split_sums(x, rows, tiles, splits, lambda out, partial, counts: _gemv[(
        tiles, splits)](
        x, blocks, out, partial, counts, tokens, rows, x.stride(0), blocks.stride(0), groups,
        **constants, SPLIT=splits > 1, **pdl.constants(x.device), num_warps=num_warps,
        num_stages=2))


def row_splits(walk: RowWalk, rows: int, blocks: int) -> int:
    """Splits of each row tile's blocks (_gemv_rows): by the walk and the weight's shape."""
    tiles = triton.cdiv(rows, walk.rows)
    return max(1, min(MAX_SPLITS, triton.cdiv(walk.programs, tiles),
                      blocks // walk.min_split_blocks))


def row_constants(tokens: int, qtype: str, walk: RowWalk, blocks: int) -> dict:
    """`_gemv_rows`' constexprs for a window of `tokens` (<= ROW_TOKENS) tokens walked as
    `walk`, in splits of `blocks` blocks a row (a step of more blocks than a split has is
    cut to the split)."""
    return dict(**block_constants(qtype), TOKENS=tokens, T_PAD=triton.next_power_of_2(tokens),
                ROWS=walk.rows, STEP=min(walk.step, triton.next_power_of_2(blocks)))


def block_constants(qtype: str) -> dict:
    """A format's constexprs for walking its blocks whole (_decode_groups, _gemv_rows)."""
    fmt = FORMATS[qtype]
    group_values, run_values = GROUPS[qtype]
    return dict(FORMAT=qtype, G=fmt.block_values // group_values, C=run_values,
                BLOCK_BYTES=fmt.block_bytes, BLOCK_VALUES=fmt.block_values)


def _gemv_by_rows(x: torch.Tensor, blocks: torch.Tensor, qtype: str, rows: int,
                  values: int) -> torch.Tensor:
    num_blocks = values // FORMATS[qtype].block_values
    walk = row_walk(qtype, rows, num_blocks)
    splits = row_splits(walk, rows, num_blocks)
    tiles = triton.cdiv(rows, walk.rows)
    return split_sums(x, rows, tiles, splits, lambda out, partial, counts: _gemv_rows[(
        tiles, splits)](
        x, blocks, out, partial, counts, rows, x.stride(0), blocks.stride(0), num_blocks,
        **row_constants(x.shape[0], qtype, walk, triton.cdiv(num_blocks, splits)),
        SPLIT=splits > 1, **pdl.constants(x.device), num_warps=walk.warps))


def dequantize(blocks: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` (float32, bfloat16 or float16) from `blocks` [N, row bytes] of
    `qtype`, computed in fp32."""
    rows, values = check_blocks(blocks, qtype)
    if dtype not in DTYPES:
        raise ValueError(f"dequantize writes float32, bfloat16 or float16, not {dtype}")
    out = torch.empty(rows, values, dtype=dtype, device=blocks.device)
    if rows:
        _dequantize[(triton.cdiv(rows, BLOCK_N), values // GROUPS[qtype][0])](
            blocks, out, rows, blocks.stride(0), out.stride(0), FORMAT=qtype,
            C=GROUPS[qtype][1], BLOCK_N=BLOCK_N, num_warps=4, num_stages=2)
    return out
