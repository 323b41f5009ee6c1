"""Jit helpers (no launches) shared by the routing and fused-experts kernels:
`_rounded` (fp32 rounded to an activation dtype, as a PyTorch op writing it would) and
`_choose` (one token's softmax top-k, kept in registers).

route_triton's `_top_k` and `_ranked_top_k` store a window's choice for moe_triton's
grouping launch; `_choose` makes the same choice where every program of a one-token
window's gate and up kernel takes its expert itself (moe_triton's `_ranked_tile`), so
that no launch runs between the router's logits and the experts.
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
    """One token's logits [BLOCK_E] (fp32, -inf past the experts) -> (experts [BLOCK_K]
    int32, their probabilities [BLOCK_K] fp32): `_top_k`'s (or, RANKED, `_ranked_top_k`'s)
    choice and weights, held in registers instead of stored (entries past TOP_K: expert
    0, weight 0). moe_triton's one-token kernels call it in every program."""
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    j = tl.arange(0, BLOCK_K)
    if RANKED:  # each expert's rank among the more probable (or as probable, lower ids)
        before = (probs[None, :] > probs[:, None]) | ((probs[None, :] == probs[:, None])
                                                      & (e[None, :] < e[:, None]))
        rank = tl.sum(before.to(tl.int32), axis=1)                       # [BLOCK_E]
        picked = (rank[:, None] == j[None, :]) & (j < TOP_K)[None, :]     # [BLOCK_E, BLOCK_K]
        experts = tl.sum(tl.where(picked, e[:, None], 0), axis=0)
        chosen = tl.sum(tl.where(picked, probs[:, None], 0.0), axis=0)
    else:
        experts = tl.zeros([BLOCK_K], dtype=tl.int32)
        chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
        for rank in tl.static_range(TOP_K):
            best = tl.max(probs, axis=0)
            expert = tl.min(tl.where(probs == best, e, BLOCK_E), axis=0)
            experts = tl.where(j == rank, expert, experts)
            chosen = tl.where(j == rank, best, chosen)
            probs = tl.where(e == expert, -1.0, probs)
    if RENORMALISE:
        chosen = chosen / tl.sum(chosen, axis=0)
    return experts, chosen
