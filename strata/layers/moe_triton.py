"""A fused mixture-of-experts path for decode and verify windows (1..32 tokens): the same
result as `GroupedExperts.forward` (moe.py), reading only the experts that the window's
tokens route to, each of them once for all its tokens.

Design. The window's T*k token-expert pairs (pair p = t*k + j routes token t to expert
experts[t, j]) are grouped by expert on the device: counts per expert by `scatter_add_`
into zeros(E), the pairs' order by a stable argsort of their experts, and each expert's
first slot by an exclusive cumsum of the counts. At most S = min(E, T*k) experts have
pairs: a stable argsort of (count == 0) lists them first, and its first S entries (the
routed experts, then unrouted ones as padding) name the experts of the grids' first axis.
Two kernels follow, one program per (listed expert, tile of BLOCK_N output columns):

    _gate_up  grid (S, cdiv(I, BLOCK_N)): the expert's pairs' token rows [BLOCK_T, BLOCK_K]
              times its gate and up tiles, walking H BLOCK_K at a time, so each weight
              tile is read once for all the expert's tokens; silu(g) * u, in x's dtype,
              into h [T*k, I] at the pairs' sorted slots.
    _down     grid (S, cdiv(H, BLOCK_N)): h's rows of the expert times its down tile,
              walking I; each pair's row times its routing weight, in fp32, into
              out [T*k, H] at the pair's own index p.

and y = out.view(T, k, H).sum(1): each token's k rows added in a fixed order (no atomics,
so the result is deterministic). A decoding window of DeepSeek-V3 (k = 8 of E = 256)
thus launches 8 programs per column tile, not 256; a program of an expert that no pair
routes to (padding of the list) runs no step and reads no weight; one of an expert with
more pairs than BLOCK_T (a token naming an expert twice) walks them BLOCK_T at a time.
BLOCK_T (16 or 32: tl.dot takes at least 16 rows) follows the window's size, BLOCK_N and
BLOCK_K the weights' shapes; the tiles are masked, so H and I need not divide them. Sums
are fp32; g, u and silu(g) are rounded to x's dtype where the reference rounds them (its
matmuls and silu write x's dtype); the expert outputs are weighted and summed in fp32
before the final cast.

NOTE: nothing here syncs with the host or allocates by data: every buffer's shape
follows (T, k, E, H, I) and each program loads its expert and that expert's count, so a
launch can be captured in a CUDA graph. Tile sizes are fixed (no autotuning: a fresh
machine compiles in seconds), and only long-stable triton.language is used (load/store/
dot/exp, casts and bitcasts); the kernels compile for SM86 and SM90
(tests/test_moe_triton.py).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernels'
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

MAX_TOKENS = 32   # the largest window
MAX_TOP_K = 10
BLOCK_N = 64      # output columns per program
BLOCK_K = 64      # inner-dimension step
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 sums (IEEE fp32 products when DOT_FP32)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _rounded(v, dtype: tl.constexpr):
    """fp32 `v` rounded to the nearest value of `dtype` (ties to even), kept in fp32.
    NOTE: bf16 by hand: triton's interpreter truncates fp32 -> bf16 casts (triton 3.9)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return v.to(dtype).to(tl.float32)


@triton.jit
def _gate_up(x_ptr, gate_ptr, up_ptr, h_ptr,           # [T, H], [E, I, H] x2, [T*k, I]
             listed_ptr, counts_ptr, starts_ptr, order_ptr,  # [S], [E] x2, [T*k]
             top_k, hidden, inter,
             stride_xt, stride_ge, stride_gi, stride_ue, stride_ui, stride_ht,
             BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT_FP32: tl.constexpr):
    expert = tl.load(listed_ptr + tl.program_id(0))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)         # rows of I
    col_ok = cols < inter
    count = tl.load(counts_ptr + expert)
    start = tl.load(starts_ptr + expert)
    gate = gate_ptr + expert.to(tl.int64) * stride_ge + cols.to(tl.int64)[None, :] * stride_gi
    up = up_ptr + expert.to(tl.int64) * stride_ue + cols.to(tl.int64)[None, :] * stride_ui
    dtype = h_ptr.dtype.element_ty
    for first in range(0, count, BLOCK_T):  # once, unless a token names an expert twice
        slot = first + tl.arange(0, BLOCK_T)
        slot_ok = slot < count
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
        # The reference rounds gate, up and silu(gate) to x's dtype: so do we.
        g = _rounded(acc_g, dtype)
        u = _rounded(acc_u, dtype)
        act = _rounded(g / (1.0 + tl.exp(-g)), dtype)
        out = h_ptr + (start + slot).to(tl.int64)[:, None] * stride_ht + cols[None, :]
        tl.store(out, _rounded(act * u, dtype).to(dtype),
                 mask=slot_ok[:, None] & col_ok[None, :])


@triton.jit
def _down(h_ptr, down_ptr, weights_ptr, out_ptr,        # [T*k, I], [E, H, I], [T*k], [T*k, H]
          listed_ptr, counts_ptr, starts_ptr, order_ptr,
          hidden, inter,
          stride_ht, stride_de, stride_dh, stride_ot,
          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          DOT_FP32: tl.constexpr):
    expert = tl.load(listed_ptr + tl.program_id(0))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)         # rows of H
    col_ok = cols < hidden
    count = tl.load(counts_ptr + expert)
    start = tl.load(starts_ptr + expert)
    down = down_ptr + expert.to(tl.int64) * stride_de + cols.to(tl.int64)[None, :] * stride_dh
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
        pair = tl.load(order_ptr + start + slot, mask=slot_ok, other=0)
        weight = tl.load(weights_ptr + pair, mask=slot_ok, other=0.0).to(tl.float32)
        out = out_ptr + pair[:, None] * stride_ot + cols[None, :]
        tl.store(out, acc * weight[:, None], mask=slot_ok[:, None] & col_ok[None, :])


def kernel_constants(tokens: int, hidden: int, inter: int, dtype: torch.dtype,
                     device_type: str = "cuda") -> tuple[dict, dict, int]:
    """(_gate_up's constexprs, _down's constexprs, num_warps) for a window of `tokens`
    tokens of `dtype` and experts of `hidden` x `inter`. A gate/up step reads two
    [BLOCK_K, BLOCK_N] tiles (16 KB in bf16, 32 KB in fp32): within SM86's 99 KB of shared
    memory at two stages."""
    # NOTE: triton's interpreter (CPU tensors) multiplies bf16 tl.dot operands as their
    # raw bits (triton 3.9): there the dot runs in fp32.
    dot_fp32 = dtype == torch.float32 or (dtype == torch.bfloat16 and device_type != "cuda")
    block_t = max(16, triton.next_power_of_2(tokens))

    def tiles(cols: int, inner: int) -> dict:
        return dict(BLOCK_T=block_t, BLOCK_N=min(BLOCK_N, max(16, triton.next_power_of_2(cols))),
                    BLOCK_K=min(BLOCK_K, max(16, triton.next_power_of_2(inner))),
                    DOT_FP32=dot_fp32)

    return tiles(inter, hidden), tiles(hidden, inter), 4


def _check(x, experts, weights, gate_proj, up_proj, down_proj) -> None:
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be a 2-D float32, bfloat16 or float16 tensor [tokens, "
                         f"hidden], not {x.dtype} of shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"fused_experts takes 1 to {MAX_TOKENS} tokens, not {tokens}")
    if experts.dim() != 2 or experts.shape[0] != tokens or experts.dtype not in (
            torch.int64, torch.int32):
        raise ValueError(f"experts must be an int64 or int32 tensor [{tokens}, top_k], not "
                         f"{experts.dtype} of shape {tuple(experts.shape)}")
    if not 1 <= experts.shape[1] <= MAX_TOP_K:
        raise ValueError(f"fused_experts takes a top-k of 1 to {MAX_TOP_K}, not "
                         f"{experts.shape[1]}")
    if weights.shape != experts.shape or not weights.is_floating_point():
        raise ValueError(f"weights must be a floating tensor of the experts' shape "
                         f"{tuple(experts.shape)}, not {weights.dtype} of shape "
                         f"{tuple(weights.shape)}")
    for name, w in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        if w.dim() != 3 or w.dtype != x.dtype:
            raise ValueError(f"{name} must be a 3-D {x.dtype} tensor, not {w.dtype} of "
                             f"shape {tuple(w.shape)}")
    num_experts, inter = gate_proj.shape[:2]
    if gate_proj.shape != (num_experts, inter, hidden) or up_proj.shape != gate_proj.shape:
        raise ValueError(f"gate_proj and up_proj must be [experts, intermediate, {hidden}] "
                         f"alike, not {tuple(gate_proj.shape)} and {tuple(up_proj.shape)}")
    if down_proj.shape != (num_experts, hidden, inter):
        raise ValueError(f"down_proj must be [{num_experts}, {hidden}, {inter}], not "
                         f"{tuple(down_proj.shape)}")
    if num_experts == 0 or inter == 0 or hidden == 0:
        raise ValueError("fused_experts needs at least one expert and nonzero sizes")
    for name, t in (("experts", experts), ("weights", weights), ("gate_proj", gate_proj),
                    ("up_proj", up_proj), ("down_proj", down_proj)):
        if t.device != x.device:
            raise ValueError(f"x is on {x.device} but {name} on {t.device}")


def _inner_contiguous(w: torch.Tensor) -> torch.Tensor:
    return w if w.stride(2) == 1 else w.contiguous()


def fused_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                  gate_proj: torch.Tensor, up_proj: torch.Tensor,
                  down_proj: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, j], for
    x [T, H] (1 <= T <= 32; float32, bfloat16 or float16), experts [T, k] (int64 or
    int32 ids in 0..E-1, 1 <= k <= 10), weights [T, k] (any float dtype), gate_proj and
    up_proj [E, I, H] and down_proj [E, H, I] in x's dtype -> [T, H] in x's dtype: what
    `GroupedExperts.forward` computes, without a host sync."""
    _check(x, experts, weights, gate_proj, up_proj, down_proj)
    tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_experts, inter = gate_proj.shape[:2]
    pairs = tokens * top_k
    x = x.contiguous()
    gate_proj, up_proj, down_proj = map(_inner_contiguous, (gate_proj, up_proj, down_proj))
    flat = experts.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones(pairs, dtype=torch.int32, device=x.device))
    starts = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).contiguous()
    order = torch.argsort(flat, stable=True)                              # [T*k] pair ids
    # The routed experts first (at most S of them), then unrouted ones: S int64 ids.
    listed = torch.argsort((counts == 0).to(torch.int32), stable=True)
    listed = listed[:min(num_experts, pairs)]
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    gate_up_constants, down_constants, num_warps = kernel_constants(
        tokens, hidden, inter, x.dtype, x.device.type)
    _gate_up[(listed.shape[0], triton.cdiv(inter, gate_up_constants["BLOCK_N"]))](
        x, gate_proj, up_proj, h, listed, counts, starts, order, top_k, hidden, inter,
        x.stride(0), gate_proj.stride(0), gate_proj.stride(1), up_proj.stride(0),
        up_proj.stride(1), h.stride(0), **gate_up_constants, num_warps=num_warps,
        num_stages=2)
    _down[(listed.shape[0], triton.cdiv(hidden, down_constants["BLOCK_N"]))](
        h, down_proj, weights.reshape(-1).contiguous(), out, listed, counts, starts, order,
        hidden, inter, h.stride(0), down_proj.stride(0), down_proj.stride(1), out.stride(0),
        **down_constants, num_warps=num_warps, num_stages=2)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
