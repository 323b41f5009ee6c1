"""A fused mixture-of-experts path for decode and verify windows (1..32 tokens): the same
result as `GroupedExperts.forward` (moe.py), reading only the experts that the window's
tokens route to, each of them once for all its tokens.

Design. The window's T*k token-expert pairs (pair p = t*k + j routes token t to expert
experts[t, j]) are grouped by expert on the device, by one program (`_route_pairs`): each
expert's count, each expert's first slot (an exclusive cumsum of the counts), the pairs in
expert order (each pair's slot is its rank among the pairs by (expert, index): a stable
sort), and the routed experts listed first. At most S = min(E, T*k) experts have pairs:
the first S listed (the routed experts in id order, then unrouted ones as padding) name
the experts of the grids' first axis. (As six PyTorch ops — scatter_add_, cumsum, two
argsorts — the grouping took 35 us of a 1-token window's 73 on the H200.) Two kernels
follow, one program per (listed expert, tile of BLOCK_N output columns):

    _gate_up  grid (S, cdiv(I, BLOCK_N)): the expert's pairs' token rows [BLOCK_T, BLOCK_K]
              times its gate and up tiles, walking H BLOCK_K at a time, so each weight
              tile is read once for all the expert's tokens; silu(g) * u, in x's dtype,
              into h [T*k, I] at the pairs' sorted slots.
    _down     grid (S, cdiv(H, BLOCK_N)): h's rows of the expert times its down tile,
              walking I; each pair's row times its routing weight, in fp32, into
              out [T*k, H] at the pair's own index p.

and y = out.view(T, k, H).sum(1) in x's dtype: each token's k rows added in order (no
atomic adds, so the result is deterministic) by one more launch (`_combine`). (Adding them
in the last `_down` program of each column tile, counted in by counters.py, saved that
launch yet measured no faster: benchmarks/README.md.) A router may have grouped the pairs
already (route_triton's `route_window`: the router's logits, top-k and this grouping in
one launch); `route` then skips `_route_pairs`. A window of one or two tokens
(CHOOSE_TOKENS) needs no grouping launch at all (`choice`, RouterChoice): each program of
its gate and up kernel takes its token's top-k of the router's logits itself
(`_chosen_tile`: the same choice in every program of a token, top_k_triton's `_choose`),
program i serves pair i (token i // k's (i % k)-th chosen expert) in slot i, and program
(i, 0) writes what `_down` reads of the pairs and the weights; `_down` then walks pairs,
not experts (PAIRWISE), so an expert both tokens name is read twice. With --l2-prefetch
(`down_asks`) each program of such a window's gate and up kernel also asks the SM's
bulk-copy unit for its share of its expert's down weights into L2
(strata/layers/l2_prefetch.py), so that `_down` reads them from there. The decoder's
post-attention norm and the router's matmul are then one launch before it (route_triton's
`norm_logits`): H100, Qwen3-30B-A3B's shape in bf16, one-token decode 279 -> 300 tok/s
(benchmarks/README.md). A decoding window of DeepSeek-V3 (k = 8
of E = 256) thus launches 8 programs per column tile, not 256; a program of an expert
that no pair routes to (padding of the list) runs no step and reads no weight; one of an
expert with more pairs than BLOCK_T (a token naming an expert twice) walks them BLOCK_T
at a time. BLOCK_T (16 or 32: tl.dot takes at least 16 rows) follows the window's size,
BLOCK_N and BLOCK_K the window's size (narrower, deeper tiles up to SMALL_TOKENS) and the
weights' shapes; the tiles are masked, so H and I need not divide them. Sums are fp32;
g, u and silu(g) are rounded to x's dtype where the reference rounds them (its matmuls
and silu write x's dtype); the expert outputs are weighted and summed in fp32
before the final cast.

Quantized experts. `fused_experts_quantized` takes each projection as a pair (blocks,
qtype): the stacked experts' weights kept as the GGUF file stores them (uint8 [E, rows,
row bytes], formats.py), gate, up and down each of its own format. The routing and the
two grids are those above; `_gate_up_q` and `_down_q` walk the inner dimension one
format *group* at a time instead of BLOCK_K columns: triton_quant's `_decode_group`
yields the tile's rows' integer quants (two runs of C values, each with a per-row scale
and offset) and triton_quant's `_accumulate` adds scale * (x . q) + offset * sum(x) for
the program's gathered rows (their pointers, a row stride of 0), by tl.dot for windows
of more than REDUCE_TOKENS tokens and a broadcast sum below. The gate's and the up's
groups are walked in turn (they may differ in format); the epilogues (silu(g) * u into
h, the weighted rows into out) are the dense kernels' own. Windows of up to ROW_TOKENS
tokens (decode) take `_gate_up_q_rows` and `_down_q_rows` instead: a program owns Q_ROWS
rows of one expert and, pair by pair, walks their blocks whole (triton_quant's
`_decode_block`, as its `_gemv_rows` walks by blocks), one warp a program — 5x faster at
one token on the H200 (benchmarks/README.md). Gate and up of one format are walked in
one loop, Q_UNROLL blocks a step, so that a program has four blocks' loads in flight, not
one; down sums each block's products into [Q_ROWS, groups, C] and reduces them once after
its walk. A group never spans two blocks, so the inner dimensions must be whole blocks: H
(and I, for down) a multiple of 256 for the K-quants, of 32 for Q8_0 and Q4_x.

Expert caches (--experts-in-ram, strata/experts/cache.py). Given `rows` (int64 [E]), the
projections are a cache's pool of slots and each program reads its expert's weights at
the row rows[e] of them (`_program_tile`, CACHED): a slot, or a row outside the pool that
lands on the expert's bytes in pinned host memory (read over PCIe; negative when host
memory lies below the pool). `usage` then gains the window's pair counts per expert.

NOTE: nothing here syncs with the host or allocates by data: every buffer's shape
follows (T, k, E, H, I) and each program loads its expert and that expert's count, so a
launch can be captured in a CUDA graph. Tile sizes are fixed (no autotuning: a fresh
machine compiles in seconds), and only long-stable triton.language is used (load/store/
dot/exp, casts and bitcasts); the kernels compile for SM86 and SM90
(tests/test_moe_triton.py).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernels'
# `tl.constexpr` annotations as objects.
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.layers import l2_prefetch, pdl
from strata.layers.top_k_triton import _choose, _rounded
from strata.quant.formats import FORMATS
from strata.quant.triton_quant import (GROUPS, ROW_TOKENS, _accumulate,
                                       _block_dot, _decode_block, _decode_group, _runs,
                                       block_constants, check_blocks, gemv_constants)

MAX_TOKENS = 32   # the largest window
MAX_TOP_K = 10
CHOOSE_TOKENS = 2  # windows of up to this many tokens may choose their experts in the
                   # gate and up kernel (RouterChoice): an expert two tokens name is read
                   # twice, ~3% more bytes at two tokens of Qwen3-30B-A3B, ~9% at four
BLOCK_N = 64      # output columns per program
BLOCK_K = 64      # inner-dimension step
SMALL_TOKENS = 4  # windows of up to this many tokens take narrower, deeper tiles
SMALL_BLOCK_N = 32  # (H200, the 30B's experts at one token: gate/up 16.5 us instead of
SMALL_BLOCK_K = 128  # 18.5; at four, down 28.0 instead of 30.4; benchmarks/README.md)
NUM_WARPS = 4
NUM_STAGES = 4    # pipelined loads of 16-bit tiles (H200: 73 vs 96 us a 1-token window)
NUM_STAGES_FP32 = 2  # fp32 tiles are twice the bytes: 2 stages fit SM86's shared memory
QUANT_STAGES = 2
Q_ROWS = 4        # decode windows' row kernels: rows a program (one warp)
Q_UNROLL = 2      # ... and blocks of gate and up a loop step, at most (H200: README)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 sums (IEEE fp32 products when DOT_FP32)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _act(acc_g, acc_u, dtype: tl.constexpr):
    """silu(g) * u of the fp32 sums acc_g, acc_u, in `dtype`. The reference rounds gate,
    up and silu(gate) to x's dtype (h's): so do we."""
    g = _rounded(acc_g, dtype)
    u = _rounded(acc_u, dtype)
    act = _rounded(g / (1.0 + tl.exp(-g)), dtype)
    return _rounded(act * u, dtype).to(dtype)


@triton.jit
def _store_act(acc_g, acc_u, h_ptr, rows, slot_ok, cols, col_ok):
    """silu(g) * u (_act) of acc_g, acc_u [BLOCK_T, BLOCK_N] into h's `rows` [BLOCK_T, 1]
    (pointers) at `cols`."""
    tl.store(rows + cols[None, :], _act(acc_g, acc_u, h_ptr.dtype.element_ty),
             mask=slot_ok[:, None] & col_ok[None, :])


@triton.jit
def _store_weighted(acc, out_ptr, weights_ptr, order_ptr, start, slot, slot_ok, cols,
                    col_ok, stride_ot):
    """Each slot's row of acc [BLOCK_T, BLOCK_N] times its pair's routing weight, in fp32,
    into out [T*k, H] at the pair's own index."""
    pair = tl.load(order_ptr + start + slot, mask=slot_ok, other=0)
    weight = tl.load(weights_ptr + pair, mask=slot_ok, other=0.0).to(tl.float32)
    out = out_ptr + pair[:, None] * stride_ot + cols[None, :]
    tl.store(out, acc * weight[:, None], mask=slot_ok[:, None] & col_ok[None, :])


@triton.jit
def _program_tile(listed_ptr, counts_ptr, starts_ptr, rows_ptr, num_cols,
                  BLOCK_N: tl.constexpr, CACHED: tl.constexpr, PAIRWISE: tl.constexpr):
    """This program's expert's row of the weights (grid axis 0 walks the listed experts;
    the row is the expert itself, or where `rows` says when CACHED), its pairs' count and
    first slot, and its tile of BLOCK_N output columns (axis 1) with their mask. PAIRWISE
    (the gate and up kernel chose the experts: `_chosen_tile`): axis 0 walks the pairs,
    each its own expert's one pair in its own slot, an expert named twice read twice."""
    expert = tl.load(listed_ptr + tl.program_id(0))
    row = expert.to(tl.int64)
    if CACHED:
        row = tl.load(rows_ptr + expert)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PAIRWISE:
        return row, 1, tl.program_id(0), cols, cols < num_cols
    return (row, tl.load(counts_ptr + expert), tl.load(starts_ptr + expert), cols,
            cols < num_cols)


@triton.jit
def _chosen_tile(logits_ptr, listed_ptr, counts_ptr, starts_ptr, order_ptr, weights_ptr,
                 num_experts, num_cols, BLOCK_N: tl.constexpr, TOP_K: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RANKED: tl.constexpr,
                 RENORMALISE: tl.constexpr):
    """`_program_tile` of a window of a few tokens whose pairs no launch grouped: program
    i serves pair i (grid axis 0), token t = i // k: it takes the token's top-k from its
    router logits [T, E] (top_k_triton's `_choose`, the same in every program of the
    token) and its expert is the (i % k)-th chosen, with one pair, i, in slot i. Program
    (i, 0) writes the grouping that the down kernels read (listed[i], order[i] = i; and
    counts and starts of its expert, which only a one-token window's are right: with
    more tokens an expert may be named twice, and the down kernels walk pairs, PAIRWISE)
    and program (t * k, 0) the token's k weights, in the weights' dtype: what
    route_triton's `route_window` would have written, but for the listed experts' order
    (by pair and rank, not id), which no sum depends on."""
    i = tl.program_id(0)
    first = i - i % TOP_K  # the token's first pair
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + (i // TOP_K) * num_experts + e, mask=e < num_experts,
                     other=-float("inf"))
    experts, chosen, _ = _choose(logits[None, :], e, TOP_K, BLOCK_E, BLOCK_K, RANKED,
                                 RENORMALISE)
    experts, chosen = tl.sum(experts, axis=0), tl.sum(chosen, axis=0)  # the one row
    j = tl.arange(0, BLOCK_K)
    expert = tl.sum(tl.where(j == i - first, experts, 0), axis=0)
    if tl.program_id(1) == 0:
        tl.store(listed_ptr + i, expert.to(tl.int64))
        tl.store(counts_ptr + expert, 1)
        tl.store(starts_ptr + expert, i)
        tl.store(order_ptr + i, i.to(tl.int64))
        if i == first:
            dtype = weights_ptr.dtype.element_ty
            tl.store(weights_ptr + first + j, _rounded(chosen, dtype).to(dtype),
                     mask=j < TOP_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert.to(tl.int64), 1, i, cols, cols < num_cols


@triton.jit
def _gate_up_tile(listed_ptr, counts_ptr, starts_ptr, order_ptr, rows_ptr, logits_ptr,
                  weights_ptr, num_experts, num_cols, BLOCK_N: tl.constexpr,
                  CACHED: tl.constexpr, CHOOSE: tl.constexpr, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr, RANKED: tl.constexpr,
                  RENORMALISE: tl.constexpr):
    """A gate and up kernel's tile: `_chosen_tile`'s where it CHOOSEs the experts, else
    `_program_tile`'s."""
    if CHOOSE:
        row, count, start, cols, col_ok = _chosen_tile(
            logits_ptr, listed_ptr, counts_ptr, starts_ptr, order_ptr, weights_ptr,
            num_experts, num_cols, BLOCK_N, TOP_K, BLOCK_E, BLOCK_TOP, RANKED, RENORMALISE)
    else:
        row, count, start, cols, col_ok = _program_tile(
            listed_ptr, counts_ptr, starts_ptr, rows_ptr, num_cols, BLOCK_N, CACHED, False)
    return row, count, start, cols, col_ok


@triton.jit
def _gate_up(x_ptr, gate_ptr, up_ptr, h_ptr,           # [T, H], [E, I, H] x2, [T*k, I]
             listed_ptr, counts_ptr, starts_ptr, order_ptr, rows_ptr,  # [S], [E] x2, [T*k]
             logits_ptr, weights_ptr, num_experts,   # CHOOSE: [E] fp32, [k] (written)
             top_k, hidden, inter,
             stride_xt, stride_ge, stride_gi, stride_ue, stride_ui, stride_ht,
             BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT_FP32: tl.constexpr, CACHED: tl.constexpr, CHOOSE: tl.constexpr,
             TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr,
             RANKED: tl.constexpr, RENORMALISE: tl.constexpr, PDL: tl.constexpr,
             down_ptr, stride_de, ASKS: tl.constexpr, ASK_VALUES: tl.constexpr):
    if PDL:
        pdl.wait()
    row, count, start, cols, col_ok = _gate_up_tile(  # cols: rows of I
        listed_ptr, counts_ptr, starts_ptr, order_ptr, rows_ptr, logits_ptr, weights_ptr,
        num_experts, inter, BLOCK_N, CACHED, CHOOSE, TOP_K, BLOCK_E, BLOCK_TOP, RANKED,
        RENORMALISE)
    if ASKS > 0:  # this tile's share of its expert's down weights [H, I] into L2 for
        # `_down` (a listed expert no pair routes to, padding, asks for none)
        first, asks, size = l2_prefetch.share(tl.program_id(1), tl.num_programs(1),
                                              hidden * inter, ASKS, ASK_VALUES)
        done = l2_prefetch.ask(down_ptr + row * stride_de + first, asks & (count > 0), size)
        tl.store(h_ptr + done, done.to(h_ptr.dtype.element_ty), mask=done != 0)  # never
    gate = gate_ptr + row * stride_ge + cols.to(tl.int64)[None, :] * stride_gi
    up = up_ptr + row * stride_ue + cols.to(tl.int64)[None, :] * stride_ui
    for first in range(0, count, BLOCK_T):  # once, unless a token names an expert twice
        slot = first + tl.arange(0, BLOCK_T)
        slot_ok = slot < count
        if CHOOSE:  # the pair in slot i is pair i (_chosen_tile)
            pair = (start + slot).to(tl.int64)
        else:
            pair = tl.load(order_ptr + start + slot, mask=slot_ok, other=0)
        rows = x_ptr + (pair // top_k)[:, None] * stride_xt                # token rows
        acc_g = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            x = tl.load(rows + k[None, :], mask=slot_ok[:, None] & k_ok[None, :],
                        other=0.0)                                          # [BLOCK_T, BLOCK_K]
            w_ok = k_ok[:, None] & col_ok[None, :]
            g = tl.load(gate + k[:, None], mask=w_ok, other=0.0)            # [BLOCK_K, BLOCK_N]
            u = tl.load(up + k[:, None], mask=w_ok, other=0.0)
            acc_g += _dot(x, g, DOT_FP32)
            acc_u += _dot(x, u, DOT_FP32)
        if PDL:
            pdl.release()
        _store_act(acc_g, acc_u, h_ptr, h_ptr + (start + slot).to(tl.int64)[:, None] * stride_ht,
                   slot_ok, cols, col_ok)


@triton.jit
def _down(h_ptr, down_ptr, weights_ptr, out_ptr,        # [T*k, I], [E, H, I], [T*k], [T*k, H]
          listed_ptr, counts_ptr, starts_ptr, order_ptr, rows_ptr,
          hidden, inter,
          stride_ht, stride_de, stride_dh, stride_ot,
          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          DOT_FP32: tl.constexpr, CACHED: tl.constexpr, PAIRWISE: tl.constexpr,
          PDL: tl.constexpr):
    if PDL:
        pdl.wait()
    row, count, start, cols, col_ok = _program_tile(  # cols: rows of H
        listed_ptr, counts_ptr, starts_ptr, rows_ptr, hidden, BLOCK_N, CACHED, PAIRWISE)
    down = down_ptr + row * stride_de + cols.to(tl.int64)[None, :] * stride_dh
    for first in range(0, count, BLOCK_T):
        slot = first + tl.arange(0, BLOCK_T)
        slot_ok = slot < count
        rows = h_ptr + (start + slot).to(tl.int64)[:, None] * stride_ht
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            h = tl.load(rows + k[None, :], mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(down + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += _dot(h, w, DOT_FP32)
        if PDL:
            pdl.release()
        _store_weighted(acc, out_ptr, weights_ptr, order_ptr, start, slot, slot_ok, cols,
                        col_ok, stride_ot)


@triton.jit
def _project(acc, rows, num_rows, blocks_ptr, row_start, row_ok, num_groups,
             FORMAT: tl.constexpr, C: tl.constexpr, BLOCK_T: tl.constexpr,
             HAS_OFFSET: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc [BLOCK_T, BLOCK_N] + the gathered `rows` ([BLOCK_T, 1] pointers to each
    slot's input row; the first `num_rows` slots are real) times the quantized weight
    rows starting at byte offsets `row_start` [BLOCK_N], walking their `num_groups`
    groups. triton_quant's `_accumulate` reads its tokens' rows at x_ptr + t * stride:
    here x_ptr is the rows' pointers themselves and the stride 0."""
    for g in range(0, num_groups):
        q_lo, q_hi, s_lo, s_hi, o_lo, o_hi, k_lo, k_hi = _decode_group(
            blocks_ptr, row_start, row_ok, g, FORMAT, C)
        acc = _accumulate(acc, rows, 0, num_rows, k_lo, q_lo, s_lo, o_lo,
                          C, BLOCK_T, HAS_OFFSET, USE_DOT, DOT_FP32)
        acc = _accumulate(acc, rows, 0, num_rows, k_hi, q_hi, s_hi, o_hi,
                          C, BLOCK_T, HAS_OFFSET, USE_DOT, DOT_FP32)
    return acc


@triton.jit
def _gate_up_q(x_ptr, gate_ptr, up_ptr, h_ptr,        # [T, H], [E, I, bytes] u8 x2, [T*k, I]
               listed_ptr, counts_ptr, starts_ptr, order_ptr, rows_ptr,  # [S], [E] x2, [T*k]
               top_k, inter, gate_groups, up_groups,
               stride_xt, stride_ge, stride_gi, stride_ue, stride_ui, stride_ht,
               GATE_FORMAT: tl.constexpr, GATE_C: tl.constexpr, GATE_OFFSET: tl.constexpr,
               UP_FORMAT: tl.constexpr, UP_C: tl.constexpr, UP_OFFSET: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
               DOT_FP32: tl.constexpr, CACHED: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl.wait()
    row, count, start, cols, col_ok = _program_tile(
        listed_ptr, counts_ptr, starts_ptr, rows_ptr, inter, BLOCK_N, CACHED, False)
    gate = row * stride_ge + cols.to(tl.int64) * stride_gi  # byte offsets
    up = row * stride_ue + cols.to(tl.int64) * stride_ui
    for first in range(0, count, BLOCK_T):  # once, unless a token names an expert twice
        slot = first + tl.arange(0, BLOCK_T)
        slot_ok = slot < count
        pair = tl.load(order_ptr + start + slot, mask=slot_ok, other=0)
        rows = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt  # token rows
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        acc_g = _project(acc, rows, count - first, gate_ptr, gate, col_ok, gate_groups,
                         GATE_FORMAT, GATE_C, BLOCK_T, GATE_OFFSET, USE_DOT, DOT_FP32)
        acc_u = _project(acc, rows, count - first, up_ptr, up, col_ok, up_groups,
                         UP_FORMAT, UP_C, BLOCK_T, UP_OFFSET, USE_DOT, DOT_FP32)
        if PDL:
            pdl.release()
        _store_act(acc_g, acc_u, h_ptr, h_ptr + (start + slot).to(tl.int64)[:, None] * stride_ht,
                   slot_ok, cols, col_ok)


@triton.jit
def _down_q(h_ptr, down_ptr, weights_ptr, out_ptr,    # [T*k, I], [E, H, bytes] u8, [T*k], [T*k, H]
            listed_ptr, counts_ptr, starts_ptr, order_ptr, rows_ptr,
            hidden, down_groups,
            stride_ht, stride_de, stride_dh, stride_ot,
            FORMAT: tl.constexpr, C: tl.constexpr, HAS_OFFSET: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
            DOT_FP32: tl.constexpr, CACHED: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl.wait()
    row, count, start, cols, col_ok = _program_tile(
        listed_ptr, counts_ptr, starts_ptr, rows_ptr, hidden, BLOCK_N, CACHED, False)
    down = row * stride_de + cols.to(tl.int64) * stride_dh  # byte offsets
    for first in range(0, count, BLOCK_T):
        slot = first + tl.arange(0, BLOCK_T)
        slot_ok = slot < count
        rows = h_ptr + (start + slot).to(tl.int64)[:, None] * stride_ht
        acc = _project(tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32), rows, count - first,
                       down_ptr, down, col_ok, down_groups, FORMAT, C, BLOCK_T, HAS_OFFSET,
                       USE_DOT, DOT_FP32)
        if PDL:
            pdl.release()
        _store_weighted(acc, out_ptr, weights_ptr, order_ptr, start, slot, slot_ok, cols,
                        col_ok, stride_ot)


@triton.jit
def _row_dot(blocks_ptr, row_start, x_row, num_blocks, FORMAT: tl.constexpr,
             G: tl.constexpr, C: tl.constexpr, BLOCK_BYTES: tl.constexpr,
             BLOCK_VALUES: tl.constexpr, ROWS: tl.constexpr):
    """[ROWS]: the rows starting at byte offsets `row_start` [ROWS] (blocks of
    FORMAT, walked whole: triton_quant's _decode_block) times the token row at x_row. Each
    block's values are dequantized and multiplied into [ROWS, G, C] sums, added up once
    after the walk (H200, a 30B MoE layer: with a Q6_K down 16-17% faster than a sum per
    block, with a Q4_K one level at 1-2 tokens and 4% slower at 4; benchmarks/README.md)."""
    first, second = _runs(FORMAT, G)
    at = first[:, None] + tl.arange(0, C)[None, :]                         # [G, C]
    acc_a = tl.zeros([ROWS, G, C], dtype=tl.float32)
    acc_b = tl.zeros([ROWS, G, C], dtype=tl.float32)
    for b in range(0, num_blocks):
        q_a, s_a, o_a, q_b, s_b, o_b = _decode_block(blocks_ptr, row_start + b * BLOCK_BYTES,
                                                     FORMAT, G, C)
        x_a = tl.load(x_row + b * BLOCK_VALUES + at).to(tl.float32)
        x_b = tl.load(x_row + b * BLOCK_VALUES + at + second).to(tl.float32)
        acc_a += (q_a * s_a[:, :, None] + o_a[:, :, None]) * x_a[None]
        acc_b += (q_b * s_b[:, :, None] + o_b[:, :, None]) * x_b[None]
    return tl.sum(tl.sum(acc_a + acc_b, axis=2), axis=1)


@triton.jit
def _pair_dots(gate_ptr, gate, up_ptr, up, x_row, num_blocks, FORMAT: tl.constexpr,
               G: tl.constexpr, C: tl.constexpr, BLOCK_BYTES: tl.constexpr,
               BLOCK_VALUES: tl.constexpr, ROWS: tl.constexpr, UNROLL: tl.constexpr):
    """(gate rows . x, up rows . x) [ROWS] for gate and up of one format, walked in one
    loop (UNROLL blocks a step) so that each step's loads of both are in flight at once."""
    first, second = _runs(FORMAT, G)
    acc_g = tl.zeros([ROWS], dtype=tl.float32)
    acc_u = tl.zeros([ROWS], dtype=tl.float32)
    for b0 in range(0, num_blocks, UNROLL):
        for i in tl.static_range(UNROLL):
            b = b0 + i
            g_a, gs_a, go_a, g_b, gs_b, go_b = _decode_block(
                gate_ptr, gate + b * BLOCK_BYTES, FORMAT, G, C)
            u_a, us_a, uo_a, u_b, us_b, uo_b = _decode_block(
                up_ptr, up + b * BLOCK_BYTES, FORMAT, G, C)
            x_b = x_row + b * BLOCK_VALUES
            acc_g += _block_dot(g_a, gs_a, go_a, g_b, gs_b, go_b, x_b, first, second, C)
            acc_u += _block_dot(u_a, us_a, uo_a, u_b, us_b, uo_b, x_b, first, second, C)
    return acc_g, acc_u


@triton.jit
def _gate_up_q_rows(x_ptr, gate_ptr, up_ptr, h_ptr,   # [T, H], [E, I, bytes] u8 x2, [T*k, I]
                    listed_ptr, counts_ptr, starts_ptr, order_ptr, rows_ptr,
                    logits_ptr, weights_ptr, num_experts,  # CHOOSE: as _gate_up's
                    top_k, inter, gate_blocks, up_blocks,
                    stride_xt, stride_ge, stride_gi, stride_ue, stride_ui, stride_ht,
                    GATE_FORMAT: tl.constexpr, GATE_G: tl.constexpr, GATE_C: tl.constexpr,
                    GATE_BYTES: tl.constexpr, GATE_VALUES: tl.constexpr,
                    UP_FORMAT: tl.constexpr, UP_G: tl.constexpr, UP_C: tl.constexpr,
                    UP_BYTES: tl.constexpr, UP_VALUES: tl.constexpr, ROWS: tl.constexpr,
                    UNROLL: tl.constexpr, CACHED: tl.constexpr, CHOOSE: tl.constexpr,
                    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr,
                    RANKED: tl.constexpr, RENORMALISE: tl.constexpr, PDL: tl.constexpr):
    """A window of a few tokens: ROWS rows of I of one expert, each pair in turn, the
    blocks walked whole (the pairs of one expert re-read its rows: from L2)."""
    if PDL:
        pdl.wait()
    row, count, start, rows, row_ok = _gate_up_tile(
        listed_ptr, counts_ptr, starts_ptr, order_ptr, rows_ptr, logits_ptr, weights_ptr,
        num_experts, inter, ROWS, CACHED, CHOOSE, TOP_K, BLOCK_E, BLOCK_TOP, RANKED,
        RENORMALISE)
    safe = tl.where(row_ok, rows, 0).to(tl.int64)
    gate = row * stride_ge + safe * stride_gi
    up = row * stride_ue + safe * stride_ui
    for s in range(0, count):
        if CHOOSE:  # the pair in slot i is pair i (_chosen_tile)
            pair = start + s
        else:
            pair = tl.load(order_ptr + start + s)
        x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xt
        if GATE_FORMAT == UP_FORMAT:  # walked together
            g, u = _pair_dots(gate_ptr, gate, up_ptr, up, x_row, gate_blocks, GATE_FORMAT,
                              GATE_G, GATE_C, GATE_BYTES, GATE_VALUES, ROWS, UNROLL)
        else:
            g = _row_dot(gate_ptr, gate, x_row, gate_blocks, GATE_FORMAT, GATE_G, GATE_C,
                         GATE_BYTES, GATE_VALUES, ROWS)
            u = _row_dot(up_ptr, up, x_row, up_blocks, UP_FORMAT, UP_G, UP_C, UP_BYTES,
                         UP_VALUES, ROWS)
        if PDL:
            pdl.release()
        tl.store(h_ptr + (start + s).to(tl.int64) * stride_ht + rows,
                 _act(g, u, h_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _down_q_rows(h_ptr, down_ptr, weights_ptr, out_ptr,  # [T*k, I], [E, H, bytes] u8, ...
                 listed_ptr, counts_ptr, starts_ptr, order_ptr, rows_ptr,
                 hidden, down_blocks, stride_ht, stride_de, stride_dh, stride_ot,
                 FORMAT: tl.constexpr, G: tl.constexpr, C: tl.constexpr,
                 BLOCK_BYTES: tl.constexpr, BLOCK_VALUES: tl.constexpr, ROWS: tl.constexpr,
                 CACHED: tl.constexpr, PAIRWISE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl.wait()
    row, count, start, rows, row_ok = _program_tile(
        listed_ptr, counts_ptr, starts_ptr, rows_ptr, hidden, ROWS, CACHED, PAIRWISE)
    down = row * stride_de + tl.where(row_ok, rows, 0).to(tl.int64) * stride_dh
    for s in range(0, count):
        pair = tl.load(order_ptr + start + s)
        acc = _row_dot(down_ptr, down, h_ptr + (start + s).to(tl.int64) * stride_ht,
                       down_blocks, FORMAT, G, C, BLOCK_BYTES, BLOCK_VALUES, ROWS)
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        if PDL:
            pdl.release()
        tl.store(out_ptr + pair.to(tl.int64) * stride_ot + rows, acc * weight, mask=row_ok)


def kernel_constants(tokens: int, hidden: int, inter: int, dtype: torch.dtype,
                     device_type: str = "cuda") -> tuple[dict, dict, dict]:
    """(_gate_up's constexprs, _down's constexprs, launch options) for a window of
    `tokens` tokens of `dtype` and experts of `hidden` x `inter`. A gate/up step reads two
    [BLOCK_K, BLOCK_N] tiles and the tokens' [BLOCK_T, BLOCK_K] (20 KB in bf16 at 32
    tokens, 40 KB in fp32; the same with the 32 x 128 tiles of windows up to SMALL_TOKENS):
    within SM86's 99 KB of shared memory at four stages in 16 bits and two in fp32."""
    # NOTE: triton's interpreter (CPU tensors) multiplies bf16 tl.dot operands as their
    # raw bits (triton 3.9): there the dot runs in fp32.
    dot_fp32 = dtype == torch.float32 or (dtype == torch.bfloat16 and device_type != "cuda")
    block_t = max(16, triton.next_power_of_2(tokens))

    block_n, block_k = (SMALL_BLOCK_N, SMALL_BLOCK_K) if tokens <= SMALL_TOKENS else (
        BLOCK_N, BLOCK_K)

    def tiles(cols: int, inner: int) -> dict:
        return dict(BLOCK_T=block_t, BLOCK_N=min(block_n, max(16, triton.next_power_of_2(cols))),
                    BLOCK_K=min(block_k, max(16, triton.next_power_of_2(inner))),
                    DOT_FP32=dot_fp32)

    stages = NUM_STAGES_FP32 if dtype == torch.float32 else NUM_STAGES
    return tiles(inter, hidden), tiles(hidden, inter), dict(num_warps=NUM_WARPS,
                                                            num_stages=stages)


def _check_x(x) -> None:
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be a 2-D float32, bfloat16 or float16 tensor [tokens, "
                         f"hidden], not {x.dtype} of shape {tuple(x.shape)}")


def _check_window(x, experts, weights, caller: str) -> None:
    """The window's checks, shared by both launchers (`caller` names the one in errors)."""
    _check_x(x)
    tokens = x.shape[0]
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"{caller} takes 1 to {MAX_TOKENS} tokens, not {tokens}")
    if experts.dim() != 2 or experts.shape[0] != tokens or experts.dtype not in (
            torch.int64, torch.int32):
        raise ValueError(f"experts must be an int64 or int32 tensor [{tokens}, top_k], not "
                         f"{experts.dtype} of shape {tuple(experts.shape)}")
    if not 1 <= experts.shape[1] <= MAX_TOP_K:
        raise ValueError(f"{caller} takes a top-k of 1 to {MAX_TOP_K}, not "
                         f"{experts.shape[1]}")
    if weights.shape != experts.shape or not weights.is_floating_point():
        raise ValueError(f"weights must be a floating tensor of the experts' shape "
                         f"{tuple(experts.shape)}, not {weights.dtype} of shape "
                         f"{tuple(weights.shape)}")
    for name, t in (("experts", experts), ("weights", weights)):
        if t.device != x.device:
            raise ValueError(f"x is on {x.device} but {name} on {t.device}")


def _check(x, gate_proj, up_proj, down_proj) -> None:
    """fused_experts' weights against x (the window's routing: `_routing`)."""
    _check_x(x)
    hidden = x.shape[1]
    for name, w in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        if w.dim() != 3 or w.dtype != x.dtype:
            raise ValueError(f"{name} must be a 3-D {x.dtype} tensor, not {w.dtype} of "
                             f"shape {tuple(w.shape)}")
    num_experts, inter = gate_proj.shape[:2]  # with a rows table: the cache's slots
    if gate_proj.shape != (num_experts, inter, hidden) or up_proj.shape != gate_proj.shape:
        raise ValueError(f"gate_proj and up_proj must be [experts, intermediate, {hidden}] "
                         f"alike, not {tuple(gate_proj.shape)} and {tuple(up_proj.shape)}")
    if down_proj.shape != (num_experts, hidden, inter):
        raise ValueError(f"down_proj must be [{num_experts}, {hidden}, {inter}], not "
                         f"{tuple(down_proj.shape)}")
    if num_experts == 0 or inter == 0 or hidden == 0:
        raise ValueError("fused_experts needs at least one expert and nonzero sizes")
    for name, t in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        if t.device != x.device:
            raise ValueError(f"x is on {x.device} but {name} on {t.device}")


@triton.jit
def _combine(out_ptr, y_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
             PDL: tl.constexpr):
    """y[t] = the sum of out's rows t*k .. t*k + k - 1 in order (fp32), in y's dtype."""
    if PDL:  # the next kernel may launch now: it reads nothing of ours before its wait
        pdl.release()
        pdl.wait()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(out_ptr + (token * TOP_K + j) * hidden + cols, mask=ok, other=0.0)
    dtype = y_ptr.dtype.element_ty
    tl.store(y_ptr + token * hidden + cols, _rounded(acc, dtype).to(dtype), mask=ok)


COMBINE_BLOCK = 512  # hidden columns per _combine program


def _combined(out: torch.Tensor, tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's k weighted expert rows of out [T*k, H] (fp32) summed, in `dtype`: one
    launch for what .sum and the cast took two for."""
    hidden = out.shape[1]
    y = torch.empty(tokens, hidden, dtype=dtype, device=out.device)
    _combine[(tokens, triton.cdiv(hidden, COMBINE_BLOCK))](
        out, y, hidden, TOP_K=top_k, BLOCK_H=COMBINE_BLOCK, **pdl.constants(out.device),
        num_warps=4)
    return y


ASK_VALUES = 8192  # down weights a thread of the gate and up kernel asks into L2 (16 KB)


def down_asks(down_proj: torch.Tensor, tokens: int, inter: int, block_n: int,
              cached: bool) -> dict:
    """The gate and up kernel's asks of its expert's down weights into L2 (--l2-prefetch):
    windows of up to CHOOSE_TOKENS tokens over the layer's own 16-bit weights (no expert
    cache, whose rows may lie in host memory) on a GPU with the bulk prefetch; ASKS, each
    program's count, covers the expert's H x I values over its cdiv(I, block_n) tiles."""
    if not (tokens <= CHOOSE_TOKENS and not cached and l2_prefetch.enabled
            and down_proj.is_cuda and l2_prefetch.supported(down_proj.device)
            and down_proj.element_size() == 2 and down_proj.is_contiguous()
            and down_proj.data_ptr() % 16 == 0 and down_proj.stride(0) % 8 == 0):
        # NOTE: the instruction takes 16-byte aligned runs of whole 16-byte units
        return dict(down_ptr=down_proj, stride_de=0, ASKS=0, ASK_VALUES=ASK_VALUES)
    asks = triton.cdiv(down_proj.shape[1] * down_proj.shape[2], ASK_VALUES)
    return dict(down_ptr=down_proj, stride_de=down_proj.stride(0), ASK_VALUES=ASK_VALUES,
                ASKS=triton.next_power_of_2(triton.cdiv(asks, triton.cdiv(inter, block_n))))


def _inner_contiguous(w: torch.Tensor) -> torch.Tensor:
    return w if w.stride(2) == 1 else w.contiguous()


@triton.jit
def _route_pairs(experts_ptr, counts_ptr, starts_ptr, order_ptr, listed_ptr,
                 num_pairs, num_experts, num_listed,
                 PAIRS: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
                 PDL: tl.constexpr):
    """One program: `_group_pairs` (the fused kernels launch meanwhile)."""
    if PDL:
        pdl.wait()
        pdl.release()
    _group_pairs(experts_ptr, counts_ptr, starts_ptr, order_ptr, listed_ptr, num_pairs,
                 num_experts, num_listed, PAIRS, EXPERTS, CHUNK)


@triton.jit
def _group_pairs(experts_ptr, counts_ptr, starts_ptr, order_ptr, listed_ptr,
                 num_pairs, num_experts, num_listed,
                 PAIRS: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
    """The pairs' experts [num_pairs] -> counts, starts [E] int32, order [num_pairs] int64
    (pair ids by (expert, pair id)), listed [num_listed] int64 (routed experts by id, then
    unrouted ones by id), by one program (`_route_pairs`, or route_triton's router after
    it chose the experts). PAIRS and EXPERTS are powers of two at least num_pairs and
    num_experts; padding pairs carry expert EXPERTS (none)."""
    q = tl.arange(0, PAIRS)
    q_ok = q < num_pairs
    eq = tl.load(experts_ptr + q, mask=q_ok, other=EXPERTS).to(tl.int32)
    e = tl.arange(0, EXPERTS)
    e_ok = e < num_experts
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    for first in range(0, PAIRS, CHUNK):  # counts, CHUNK pairs at a time
        c = first + tl.arange(0, CHUNK)
        ec = tl.load(experts_ptr + c, mask=c < num_pairs, other=EXPERTS).to(tl.int32)
        counts += tl.sum((e[:, None] == ec[None, :]).to(tl.int32), axis=1)
    tl.store(counts_ptr + e, counts, mask=e_ok)
    tl.store(starts_ptr + e, tl.cumsum(counts, axis=0) - counts, mask=e_ok)
    for first in range(0, PAIRS, CHUNK):  # each pair's slot: the pairs sorted before it
        p = first + tl.arange(0, CHUNK)
        p_ok = p < num_pairs
        ep = tl.load(experts_ptr + p, mask=p_ok, other=EXPERTS).to(tl.int32)
        before = (eq[None, :] < ep[:, None]) | ((eq[None, :] == ep[:, None])
                                                & (q[None, :] < p[:, None]))
        rank = tl.sum((before & q_ok[None, :]).to(tl.int32), axis=1)
        tl.store(order_ptr + rank, p.to(tl.int64), mask=p_ok)
    routed = ((counts > 0) & e_ok).to(tl.int32)
    unrouted = ((counts == 0) & e_ok).to(tl.int32)
    position = tl.where(routed > 0, tl.cumsum(routed, axis=0) - routed,
                        tl.sum(routed, axis=0) + tl.cumsum(unrouted, axis=0) - unrouted)
    tl.store(listed_ptr + position, e.to(tl.int64), mask=e_ok & (position < num_listed))


ROUTE_CHUNK = 32  # pairs per step of _route_pairs ([EXPERTS, 32] comparisons at most)


def _note_usage(rows: torch.Tensor | None, usage: torch.Tensor | None,
                counts: torch.Tensor) -> torch.Tensor:
    """The rows table the kernels read (the counts, unread, where there is none), after
    adding the window's pair counts to `usage`."""
    if rows is None:
        return counts
    if rows.dtype != torch.int64 or rows.dim() != 1 or rows.device != counts.device:
        raise ValueError(f"rows must be an int64 tensor [experts] on {counts.device}, not "
                         f"{rows.dtype} of shape {tuple(rows.shape)} on {rows.device}")
    if usage is not None:
        usage += counts
    return rows


def _route(experts: torch.Tensor, num_experts: int):
    """The window's pairs grouped by expert, on the device: (counts [E] int32, starts [E]
    int32 (each expert's first slot), order [T*k] int64 (the pairs by expert, stably),
    listed [S] int64 (the routed experts first, then unrouted ones as padding)), by one
    launch of `_route_pairs`."""
    pairs = experts.numel()
    flat = experts.reshape(-1).contiguous()
    counts, starts, order, listed = route = route_buffers(pairs, num_experts, experts.device)
    _route_pairs[(1,)](flat, counts, starts, order, listed, pairs, num_experts,
                       listed.shape[0], **grouping_constants(pairs, num_experts),
                       **pdl.constants(experts.device), num_warps=4)
    return route


def route_buffers(pairs: int, num_experts: int, device: torch.device,
                  pairwise: bool = False):
    """`_route`'s four outputs, empty: counts and starts [E] int32, order [pairs] int64,
    listed [min(E, pairs)] int64 (`pairwise`: [pairs], an expert per pair, as the gate and
    up kernel lists them when it chooses: `_chosen_tile`)."""
    return (torch.empty(num_experts, dtype=torch.int32, device=device),
            torch.empty(num_experts, dtype=torch.int32, device=device),
            torch.empty(pairs, dtype=torch.int64, device=device),
            torch.empty(pairs if pairwise else min(num_experts, pairs), dtype=torch.int64,
                        device=device))


def grouping_constants(pairs: int, num_experts: int) -> dict:
    """`_group_pairs`' constexprs for `pairs` pairs of `num_experts` experts."""
    return dict(PAIRS=max(ROUTE_CHUNK, triton.next_power_of_2(pairs)),
                EXPERTS=max(16, triton.next_power_of_2(num_experts)), CHUNK=ROUTE_CHUNK)


@dataclass(frozen=True)
class RouterChoice:
    """The routing of a window of up to CHOOSE_TOKENS tokens left to the gate and up kernel
    (`_chosen_tile`): the router's logits [T, E] (float32, rounded as its matmul writes
    them: route_triton's `norm_logits`) and the softmax top-k to take of them (as
    route_triton's `softmax_top_k` would), so that no launch runs between the logits and
    the experts."""
    logits: torch.Tensor
    top_k: int
    renormalise: bool


UNCHOSEN = dict(CHOOSE=False, TOP_K=1, BLOCK_E=16, BLOCK_TOP=2, RANKED=False,
                RENORMALISE=False)  # the gate and up kernels' CHOOSE constexprs, unused


def _routing(x: torch.Tensor, experts, weights, num_experts: int, route, choice,
             rows, caller: str):
    """What both launchers' kernels take of the routing: (route's four tensors, the
    weights [T*k], top_k, the gate and up kernel's CHOOSE arguments (logits, weights to
    write, experts) and constexprs). Without a `choice`, `route` or a `_route` launch
    groups the given experts; with one, the gate and up kernel chooses and groups."""
    if choice is None:
        _check_window(x, experts, weights, caller)
        route = route or _route(experts, num_experts)
        return (route, weights.reshape(-1).contiguous(), experts.shape[1],
                (route[0], route[0], 0), UNCHOSEN)
    from strata.layers import route_triton
    logits, top_k, tokens = choice.logits, choice.top_k, x.shape[0]
    if not 1 <= tokens <= CHOOSE_TOKENS:
        raise ValueError(f"{caller} chooses the experts of windows of 1 to {CHOOSE_TOKENS} "
                         f"tokens only, not of {tokens} tokens")
    if logits.shape != (tokens, num_experts) or logits.dtype != torch.float32 or (
            logits.device != x.device):
        raise ValueError(f"the router's logits must be float32 [{tokens}, {num_experts}] on "
                         f"{x.device}, not {logits.dtype} {tuple(logits.shape)} on "
                         f"{logits.device}")
    if not (route_triton.takes(num_experts, top_k) and top_k <= MAX_TOP_K):
        raise ValueError(f"{caller} chooses a top-k of 1 to {MAX_TOP_K}, not {top_k} of "
                         f"{num_experts} experts")
    if rows is not None or route is not None:
        raise ValueError(f"{caller} chooses the experts only of the layer's own weights, "
                         f"grouped by itself (no rows table, no route)")
    sizes = route_triton._sizes(num_experts, top_k)
    pairs = tokens * top_k
    chosen = torch.empty(pairs, dtype=x.dtype, device=x.device)
    route = route_buffers(pairs, num_experts, x.device, pairwise=True)
    return (route, chosen, top_k, (logits, chosen, num_experts),
            dict(CHOOSE=True, TOP_K=top_k, BLOCK_E=sizes["BLOCK_E"],
                 BLOCK_TOP=sizes["BLOCK_K"], RANKED=sizes["RANKED"],
                 RENORMALISE=choice.renormalise))


def fused_experts(x: torch.Tensor, experts: torch.Tensor | None, weights: torch.Tensor | None,
                  gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                  rows: torch.Tensor | None = None, usage: torch.Tensor | None = None,
                  route: tuple[torch.Tensor, ...] | None = None,
                  choice: RouterChoice | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j], for
    x [T, H] (1 <= T <= 32; float32, bfloat16 or float16), experts [T, k] (int64 or
    int32 ids in 0..E-1, 1 <= k <= 10), weights [T, k] (any float dtype), gate_proj and
    up_proj [E, I, H] and down_proj [E, H, I] in x's dtype -> [T, H] in x's dtype: what
    `GroupedExperts.forward` computes, without a host sync. With `rows` (int64 [E]) the
    projections are a cache's slots and expert e's weights are their row rows[e], which
    may lie outside them (an expert kept in host memory: the row's address, relative to
    each projection's first row, is where its bytes are); `usage` (int32 [E]) then gains
    each expert's pair count. `route`: the pairs already grouped (`_route`'s four
    tensors, as route_triton's `route_window` writes them with the experts). `choice`
    (experts and weights None): a one-token window whose gate and up kernel takes the
    top-k of the router's logits itself (RouterChoice)."""
    _check(x, gate_proj, up_proj, down_proj)
    tokens, hidden = x.shape
    num_experts, inter = (len(rows) if rows is not None else gate_proj.shape[0],
                          gate_proj.shape[1])
    route, weights, top_k, choose, choose_constants = _routing(
        x, experts, weights, num_experts, route, choice, rows, "fused_experts")
    counts, starts, order, listed = route
    pairs = tokens * top_k
    x = x.contiguous()
    gate_proj, up_proj, down_proj = map(_inner_contiguous, (gate_proj, up_proj, down_proj))
    cached = _note_usage(rows, usage, counts)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    gate_up_constants, down_constants, launch = kernel_constants(
        tokens, hidden, inter, x.dtype, x.device.type)
    _gate_up[(listed.shape[0], triton.cdiv(inter, gate_up_constants["BLOCK_N"]))](
        x, gate_proj, up_proj, h, listed, counts, starts, order, cached, *choose, top_k,
        hidden, inter, x.stride(0), gate_proj.stride(0), gate_proj.stride(1),
        up_proj.stride(0), up_proj.stride(1), h.stride(0), **gate_up_constants,
        CACHED=rows is not None, **choose_constants, **pdl.constants(x.device),
        **down_asks(down_proj, tokens, inter, gate_up_constants["BLOCK_N"], rows is not None),
        **launch)
    _down[(listed.shape[0], triton.cdiv(hidden, down_constants["BLOCK_N"]))](
        h, down_proj, weights, out, listed, counts, starts, order,
        cached, hidden, inter, h.stride(0), down_proj.stride(0), down_proj.stride(1),
        out.stride(0), **down_constants, CACHED=rows is not None, PAIRWISE=choice is not None,
        **pdl.constants(x.device), **launch)
    return _combined(out, tokens, top_k, x.dtype)


def quantized_constants(tokens: int, dtype: torch.dtype, qtypes: tuple[str, str, str],
                        hidden: int, inter: int,
                        device_type: str = "cuda") -> tuple[dict, dict, dict]:
    """(_gate_up_q's constexprs, _down_q's constexprs, launch options) for a window of `tokens`
    tokens of `dtype` and experts of `hidden` x `inter` whose gate, up and down are of
    `qtypes`. The window's tiling (BLOCK_T, tl.dot or a broadcast sum) and each format's
    run length and offset are triton_quant's gemv's for the same window."""
    def of(qtype: str) -> dict:
        return gemv_constants(tokens, dtype, qtype, device_type)[0]

    gate, up, down = map(of, qtypes)
    window = dict(BLOCK_T=gate["T_PAD"], USE_DOT=gate["USE_DOT"], DOT_FP32=gate["DOT_FP32"])

    def block_n(cols: int) -> int:
        return min(BLOCK_N, max(16, triton.next_power_of_2(cols)))

    gate_up = dict(GATE_FORMAT=gate["FORMAT"], GATE_C=gate["C"], GATE_OFFSET=gate["HAS_OFFSET"],
                   UP_FORMAT=up["FORMAT"], UP_C=up["C"], UP_OFFSET=up["HAS_OFFSET"],
                   BLOCK_N=block_n(inter), **window)
    down = dict(FORMAT=down["FORMAT"], C=down["C"], HAS_OFFSET=down["HAS_OFFSET"],
                BLOCK_N=block_n(hidden), **window)
    return gate_up, down, dict(num_warps=NUM_WARPS, num_stages=QUANT_STAGES)


def quantized_row_constants(qtypes: tuple[str, str, str], hidden: int) -> tuple[dict, dict]:
    """(_gate_up_q_rows' constexprs, _down_q_rows') for gate, up and down of `qtypes`
    (experts of hidden size `hidden`)."""
    gate, up, down = map(block_constants, qtypes)
    names = dict(FORMAT="FORMAT", G="G", C="C", BLOCK_BYTES="BYTES", BLOCK_VALUES="VALUES")
    gate_up = {f"{side}_{names[k]}": v for side, constants in (("GATE", gate), ("UP", up))
               for k, v in constants.items()}
    blocks = hidden // gate["BLOCK_VALUES"]
    unroll = max(u for u in range(1, Q_UNROLL + 1) if blocks % u == 0)
    return gate_up | dict(ROWS=Q_ROWS, UNROLL=unroll), down | dict(ROWS=Q_ROWS)


def _quantized(name: str, weight, x: torch.Tensor) -> tuple[torch.Tensor, str, int]:
    """(blocks, qtype, values per row) of one projection's pair, or a ValueError."""
    if not (isinstance(weight, (tuple, list)) and len(weight) == 2
            and isinstance(weight[0], torch.Tensor) and isinstance(weight[1], str)):
        raise ValueError(f"{name} must be a pair (blocks, qtype), not {type(weight).__name__}")
    blocks, qtype = weight
    values = check_blocks(blocks, qtype, name, stacked=True)[1]
    if blocks.device != x.device:
        raise ValueError(f"x is on {x.device} but {name} on {blocks.device}")
    return blocks, qtype, values


def _check_inner(name: str, qtype: str, values: int, size: int, what: str) -> None:
    """A ValueError unless `name`'s rows of `values` values span `size` (x's hidden size or
    the experts' intermediate size, `what`)."""
    block = FORMATS[qtype].block_values
    if size % block:
        raise ValueError(f"{name} is {qtype}, whose blocks hold {block} values: the {what} "
                         f"({size}) must be a multiple of {block}")
    if values != size:
        raise ValueError(f"{name}'s rows hold {values} values but the {what} is {size}")


def fused_experts_quantized(x: torch.Tensor, experts: torch.Tensor | None,
                            weights: torch.Tensor | None,
                            gate: tuple[torch.Tensor, str], up: tuple[torch.Tensor, str],
                            down: tuple[torch.Tensor, str],
                            rows: torch.Tensor | None = None,
                            usage: torch.Tensor | None = None,
                            route: tuple[torch.Tensor, ...] | None = None,
                            choice: RouterChoice | None = None) -> torch.Tensor:
    """`fused_experts` with quantized experts: gate, up and down each a pair (blocks,
    qtype) of a format of strata/quant/formats.py (each its own), gate and up blocks
    uint8 [E, I, row bytes of H], down blocks uint8 [E, H, row bytes of I], as the GGUF
    file stores them -> [T, H] in x's dtype: what `GroupedExperts.forward` computes with
    the experts dequantized, without a host sync. H and I must be whole blocks of their
    formats (multiples of 256 for the K-quants, 32 for Q8_0 and Q4_x). `rows`, `usage`
    `route` and `choice` are `fused_experts`' (a cache's slots, experts kept in host
    memory; the pairs already grouped; the top-k left to the gate and up kernel)."""
    caller = "fused_experts_quantized"
    _check_x(x)
    tokens, hidden = x.shape
    gate_blocks, gate_qtype, gate_values = _quantized("gate", gate, x)
    up_blocks, up_qtype, up_values = _quantized("up", up, x)
    down_blocks, down_qtype, down_values = _quantized("down", down, x)
    num_experts, inter = gate_blocks.shape[:2]
    if up_blocks.shape[:2] != (num_experts, inter):
        raise ValueError(f"gate and up must hold [experts, intermediate] rows alike, not "
                         f"{tuple(gate_blocks.shape[:2])} and {tuple(up_blocks.shape[:2])}")
    if down_blocks.shape[:2] != (num_experts, hidden):
        raise ValueError(f"down must hold [{num_experts}, {hidden}] rows, not "
                         f"{tuple(down_blocks.shape[:2])}")
    if num_experts == 0 or inter == 0:
        raise ValueError(f"{caller} needs at least one expert and nonzero sizes")
    _check_inner("gate", gate_qtype, gate_values, hidden, "hidden size")
    _check_inner("up", up_qtype, up_values, hidden, "hidden size")
    _check_inner("down", down_qtype, down_values, inter, "intermediate size")

    route, weights, top_k, choose, choose_constants = _routing(
        x, experts, weights, len(rows) if rows is not None else num_experts, route, choice,
        rows, caller)
    counts, starts, order, listed = route
    pairs = tokens * top_k
    x = x.contiguous()
    cached = _note_usage(rows, usage, counts)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    if tokens <= ROW_TOKENS:  # decode: each expert's rows walked block by block
        gate_up_rows, down_rows = quantized_row_constants((gate_qtype, up_qtype, down_qtype),
                                                          hidden)
        _gate_up_q_rows[(listed.shape[0], triton.cdiv(inter, Q_ROWS))](
            x, gate_blocks, up_blocks, h, listed, counts, starts, order, cached, *choose,
            top_k, inter, hidden // FORMATS[gate_qtype].block_values,
            hidden // FORMATS[up_qtype].block_values, x.stride(0), gate_blocks.stride(0),
            gate_blocks.stride(1), up_blocks.stride(0), up_blocks.stride(1), h.stride(0),
            **gate_up_rows, CACHED=rows is not None,
            **(choose_constants | dict(RANKED=False)),  # one warp: k rounds, not E^2 pairs
            **pdl.constants(x.device), num_warps=1)
        _down_q_rows[(listed.shape[0], triton.cdiv(hidden, Q_ROWS))](
            h, down_blocks, weights, out, listed, counts, starts,
            order, cached, hidden, inter // FORMATS[down_qtype].block_values, h.stride(0),
            down_blocks.stride(0), down_blocks.stride(1), out.stride(0), **down_rows,
            CACHED=rows is not None, PAIRWISE=choice is not None, **pdl.constants(x.device),
            num_warps=1)
        return _combined(out, tokens, top_k, x.dtype)
    gate_up_constants, down_constants, launch = quantized_constants(
        tokens, x.dtype, (gate_qtype, up_qtype, down_qtype), hidden, inter, x.device.type)
    _gate_up_q[(listed.shape[0], triton.cdiv(inter, gate_up_constants["BLOCK_N"]))](
        x, gate_blocks, up_blocks, h, listed, counts, starts, order, cached, top_k, inter,
        hidden // GROUPS[gate_qtype][0], hidden // GROUPS[up_qtype][0],
        x.stride(0), gate_blocks.stride(0), gate_blocks.stride(1), up_blocks.stride(0),
        up_blocks.stride(1), h.stride(0), **gate_up_constants, CACHED=rows is not None,
        **pdl.constants(x.device), **launch)
    _down_q[(listed.shape[0], triton.cdiv(hidden, down_constants["BLOCK_N"]))](
        h, down_blocks, weights, out, listed, counts, starts, order,
        cached, hidden, inter // GROUPS[down_qtype][0], h.stride(0), down_blocks.stride(0),
        down_blocks.stride(1), out.stride(0), **down_constants, CACHED=rows is not None,
        **pdl.constants(x.device), **launch)
    return _combined(out, tokens, top_k, x.dtype)
