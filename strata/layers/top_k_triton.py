"""Jit helpers (no launches) shared by the routing and fused-experts kernels:
`_rounded` (fp32 rounded to an activation dtype, as a PyTorch op writing it would) and
`_choose` (the softmax top-k of rows of router logits, kept in registers).

route_triton's kernels store `_choose`'s experts and weights for the fused experts'
grouping; a one-token window's gate and up kernel calls it in every program instead
(moe_triton's `_chosen_tile`), so that no launch runs between the router's logits and
the experts.
"""

# NOTE: no `from __future__ import annotations` here: triton reads the helpers'
# `tl.constexpr` annotations as objects.
import triton
import triton.language as tl


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
def _choose(logits, e, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
            RANKED: tl.constexpr, RENORMALISE: tl.constexpr):
    """Rows of logits [R, BLOCK_E] (fp32, -inf past the experts, finite in every row) ->
    (experts [R, BLOCK_K] int32, their probabilities [R, BLOCK_K] fp32, ranks [R, BLOCK_E]
    int32): each row's k most probable experts in descending order (the lower id first
    among equal ones), renormalised where asked (entries past TOP_K: expert 0, weight 0).
    RANKED: each expert's rank among its row's probabilities (the experts more probable,
    or as probable with a lower id) in one comparison of all pairs [R, BLOCK_E, BLOCK_E];
    else k rounds of two reductions, one after another (the ranks are then 0)."""
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]            # 0 past the experts
    j = tl.arange(0, BLOCK_K)
    if RANKED:
        mine = probs[:, :, None]                              # [R, BLOCK_E, 1]
        other = probs[:, None, :]                             # [R, 1, BLOCK_E]
        before = (other > mine) | ((other == mine) & (e[None, None, :] < e[None, :, None]))
        rank = tl.sum(before.to(tl.int32), axis=2)            # [R, BLOCK_E]
        picked = (rank[:, :, None] == j[None, None, :]) & (j < TOP_K)[None, None, :]
        experts = tl.sum(tl.where(picked, e[None, :, None], 0), axis=1)
        chosen = tl.sum(tl.where(picked, probs[:, :, None], 0.0), axis=1)
    else:
        rank = tl.zeros([logits.shape[0], BLOCK_E], dtype=tl.int32)
        experts = tl.zeros([logits.shape[0], BLOCK_K], dtype=tl.int32)
        chosen = tl.zeros([logits.shape[0], BLOCK_K], dtype=tl.float32)
        for r in tl.static_range(TOP_K):
            best = tl.max(probs, axis=1)
            expert = tl.min(tl.where(probs == best[:, None], e[None, :], BLOCK_E), axis=1)
            experts = tl.where(j[None, :] == r, expert[:, None], experts)
            chosen = tl.where(j[None, :] == r, best[:, None], chosen)
            probs = tl.where(e[None, :] == expert[:, None], -1.0, probs)  # below every one
    if RENORMALISE:
        chosen = chosen / tl.sum(chosen, axis=1)[:, None]
    return experts, chosen, rank
