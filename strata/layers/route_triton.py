"""Softmax top-k routing (SparseMoE's router) as Triton kernels.

`softmax_top_k`: after the router's logits, a program per token loads the token's logits,
takes their softmax in float32, picks the k largest probabilities in descending order (the
first index among equal ones), divides them by their sum where the model renormalises, and
writes the experts (int64) and the weights rounded to the activations' dtype — what
`softmax`, `topk`, the division and the cast cost five launches for (about 12 us a layer
on the H200 for one token, most of it torch.topk's sort; benchmarks/README.md). Up to 1024
experts and top-16. Prompt chunks, longer windows and an expert cache's windows take it.

`route_window`: a decode or verify window bound for the fused experts, in one launch
instead of three (the router's matmul, the top-k above and moe_triton's grouping of the
pairs by expert: 11.4 us a layer on the H200 for one token of the 30B's shape, 7.4 in one).
It takes up to moe_triton's MAX_TOKENS tokens; SparseMoE gives it windows of up to
WINDOW_TOKENS (beyond, its one program's top-k over all tokens cost more than it saved).
Program e computes the router's logit of expert e for every token (fp32 sums rounded to
x's dtype, as the matmul writes them) into a scratch row, and counts itself in at an
int32 counter; the last program to arrive takes the window's softmax top-k for all its
tokens at once (the same arithmetic as `softmax_top_k`), writes experts and weights, and
groups the pairs (moe_triton's `_group_pairs`) for the fused kernels. A router kept
quantized (or with a bias, or in another dtype than x) computes its logits first; then
the launch is that last program alone.

`norm_logits`: the decoder's post-attention residual add and norm (norm_triton's
arithmetic) and the router's logits of the normed rows, in one launch of a few programs,
each norming the rows and multiplying NORM_LOGIT_EXPERTS router rows. A one-token
window's fused experts take their top-k of those logits in their own first kernel
(moe_triton's RouterChoice, SparseMoE.add_norm_forward): no launch routes it at all.

NOTE: no host sync and shapes that follow (T, E, k) only: captured in CUDA graphs. The
counter is one of counters.py's (zero between launches: the last program sets it back).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernels'
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

from strata.layers import moe_triton, pdl
from strata.layers.norm_triton import _normed
from strata.layers.moe_triton import _group_pairs
from strata.layers.top_k_triton import _choose, _rounded
from strata.layers.counters import arrival_counters

MAX_EXPERTS = 1024
MAX_TOP_K = 16
WINDOW_TOKENS = 4  # SparseMoE's windows of up to this many tokens take `route_window`
ROUTER_VALUES = 4096  # router weights x tokens a program multiplies per step
RANKED_PAIRS = 16384  # rows x experts^2 up to which the top-k compares all pairs at once
NORM_LOGIT_EXPERTS = 4  # router rows a program of `_norm_logits` multiplies, at most
NORM_LOGIT_VALUES = 8192  # ... and at most this many router values


@triton.jit
def _top_k(logits, t, t_ok, e, weights_ptr, experts_ptr, TOP_K: tl.constexpr,
           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RANKED: tl.constexpr,
           RENORMALISE: tl.constexpr):
    """Rows `t` of logits [T_PAD, BLOCK_E] (fp32; -inf past the experts; rows `t_ok` are
    tokens) -> each token's k most probable experts (int64, descending) and their
    probabilities (renormalised where asked) in weights' dtype, stored at row t * TOP_K
    (top_k_triton's `_choose`, by ranks where RANKED). Returns the ranks [T_PAD, BLOCK_E]."""
    logits = tl.where(t_ok[:, None], logits, 0.0)             # padding rows: no NaN
    experts, chosen, rank = _choose(logits, e, TOP_K, BLOCK_E, BLOCK_K, RANKED, RENORMALISE)
    j = tl.arange(0, BLOCK_K)
    at = t[:, None] * TOP_K + j[None, :]
    mask = t_ok[:, None] & (j < TOP_K)[None, :]
    tl.store(experts_ptr + at, experts.to(tl.int64), mask=mask)
    dtype = weights_ptr.dtype.element_ty
    tl.store(weights_ptr + at, _rounded(chosen, dtype).to(dtype), mask=mask)
    return rank


@triton.jit
def _group_one(rank, e, counts_ptr, starts_ptr, order_ptr, listed_ptr, num_experts,
               TOP_K: tl.constexpr):
    """`_group_pairs` of a one-token window from its ranks [1, BLOCK_E], without reading
    the experts back: each chosen expert has one pair (its rank), the routed experts by id
    are the first k listed, and a pair's slot is its expert's place among them."""
    rank = tl.sum(rank, axis=0)                               # [BLOCK_E]
    e_ok = e < num_experts
    routed = (rank < TOP_K).to(tl.int32)
    start = tl.cumsum(routed, axis=0) - routed
    tl.store(counts_ptr + e, routed, mask=e_ok)
    tl.store(starts_ptr + e, start, mask=e_ok)
    tl.store(order_ptr + start, rank.to(tl.int64), mask=routed > 0)
    tl.store(listed_ptr + start, e.to(tl.int64), mask=routed > 0)


@triton.jit
def _softmax_top_k(logits_ptr, weights_ptr, experts_ptr, num_experts, stride_t,
                   TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   RANKED: tl.constexpr, RENORMALISE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl.wait()
    t = tl.zeros([1], dtype=tl.int64) + tl.program_id(0)  # the token, as a 1-row tile
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t[:, None] * stride_t + e[None, :],
                     mask=(e < num_experts)[None, :], other=-float("inf")).to(tl.float32)
    if PDL:
        pdl.release()
    _top_k(logits, t, t >= 0, e, weights_ptr, experts_ptr, TOP_K, BLOCK_E, BLOCK_K, RANKED,
           RENORMALISE)


@triton.jit
def _route_window(x_ptr, router_ptr, logits_ptr, weights_ptr, experts_ptr,
                  counts_ptr, starts_ptr, order_ptr, listed_ptr, arrived_ptr,
                  num_tokens, hidden, num_experts, num_listed, stride_xt, stride_re,
                  stride_lt,
                  ROUTER: tl.constexpr, T_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  RANKED: tl.constexpr, RENORMALISE: tl.constexpr, PAIRS: tl.constexpr,
                  CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl.wait()
    t = tl.arange(0, T_PAD)
    t_ok = t < num_tokens
    if ROUTER:  # program e: expert e's logit for every token, then count in
        expert = tl.program_id(0)
        row = router_ptr + expert.to(tl.int64) * stride_re
        acc = tl.zeros([T_PAD], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_H):
            k = k0 + tl.arange(0, BLOCK_H)
            k_ok = k < hidden
            w = tl.load(row + k, mask=k_ok, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_xt + k[None, :],
                        mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x * w[None, :], axis=1)
        if PDL:  # the fused kernels launch while the last program routes
            pdl.release()
        logit = _rounded(acc, x_ptr.dtype.element_ty)  # as the matmul writes them
        tl.store(logits_ptr + t * stride_lt + expert, logit, mask=t_ok)
        tl.debug_barrier()
        last = tl.atomic_add(arrived_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1
    else:
        if PDL:
            pdl.release()
        last = tl.program_id(0) == 0
    if last:
        e = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + t[:, None] * stride_lt + e[None, :],
                         mask=t_ok[:, None] & (e < num_experts)[None, :],
                         other=-float("inf"), cache_modifier=".cg").to(tl.float32)
        if ROUTER:
            tl.atomic_xchg(arrived_ptr, 0)
        rank = _top_k(logits, t, t_ok, e, weights_ptr, experts_ptr, TOP_K, BLOCK_E, BLOCK_K,
                      RANKED, RENORMALISE)
        if RANKED and T_PAD == 1:  # one token: its ranks are its grouping
            _group_one(rank, e, counts_ptr, starts_ptr, order_ptr, listed_ptr, num_experts,
                       TOP_K)
        else:
            tl.debug_barrier()  # the experts written, by all of this program's threads
            _group_pairs(experts_ptr, counts_ptr, starts_ptr, order_ptr, listed_ptr,
                         num_tokens * TOP_K, num_experts, num_listed, PAIRS, BLOCK_E, CHUNK)


@triton.jit
def _norm_logits(x_ptr, res_ptr, norm_ptr, router_ptr, sum_ptr, normed_ptr, logits_ptr,
                 num_tokens, hidden, num_experts, stride_x, stride_r, stride_re, eps,
                 T_PAD: tl.constexpr, BLOCK_H: tl.constexpr, EXPERTS: tl.constexpr,
                 ONE_PLUS: tl.constexpr, PDL: tl.constexpr):
    """Program p: the rows x + res normalised (norm_triton's `_normed`: program 0 stores
    the sum and the normed rows), then the router's logits of its EXPERTS experts for
    every token (fp32 sums rounded to x's dtype, as the matmul writes them)."""
    t = tl.arange(0, T_PAD)
    i = tl.arange(0, BLOCK_H)
    # The weights before the wait (strata/layers/pdl.py): no kernel writes them.
    w = tl.load(norm_ptr + i, mask=i < hidden, other=0.0)
    e = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    e_ok = e < num_experts
    router = tl.load(router_ptr + e.to(tl.int64)[:, None] * stride_re + i[None, :],
                     mask=e_ok[:, None] & (i < hidden)[None, :], other=0.0).to(tl.float32)
    if PDL:
        pdl.wait()
    ok = (t < num_tokens)[:, None] & (i < hidden)[None, :]
    dtype = normed_ptr.dtype.element_ty
    x = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x + i[None, :], mask=ok, other=0.0)
    res = tl.load(res_ptr + t.to(tl.int64)[:, None] * stride_r + i[None, :], mask=ok,
                  other=0.0)
    if PDL:
        pdl.release()
    total = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
    normed = _normed(total, w, hidden, eps, ONE_PLUS)                   # [T_PAD, BLOCK_H]
    rows = t.to(tl.int64)[:, None] * hidden + i[None, :]
    if tl.program_id(0) == 0:
        tl.store(sum_ptr + rows, total, mask=ok)
        tl.store(normed_ptr + rows, normed, mask=ok)
    for token in tl.static_range(T_PAD):
        row = tl.sum(tl.where(t[:, None] == token, normed.to(tl.float32), 0.0), axis=0)
        logit = _rounded(tl.sum(router * row[None, :], axis=1), dtype)  # [EXPERTS]
        tl.store(logits_ptr + token * num_experts + e, logit,
                 mask=e_ok & (e * 0 + token < num_tokens))


def takes(num_experts: int, top_k: int) -> bool:
    """Do the kernels route top-k of this many experts?"""
    return 1 <= top_k <= min(num_experts, MAX_TOP_K) and num_experts <= MAX_EXPERTS


def _check(num_experts: int, top_k: int) -> None:
    if not takes(num_experts, top_k):
        raise ValueError(f"top-{top_k} of {num_experts} experts: the routing kernels take "
                         f"at most top-{MAX_TOP_K} of {MAX_EXPERTS}")


def _sizes(num_experts: int, top_k: int, t_pad: int = 1) -> dict:
    """The top-k's constexprs for rows of `num_experts` logits, `t_pad` rows a program."""
    block_e = max(16, triton.next_power_of_2(num_experts))
    return dict(TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=max(2, triton.next_power_of_2(top_k)),
                RANKED=t_pad * block_e * block_e <= RANKED_PAIRS)


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalise: bool,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype) -> (weights [T, k] in `dtype`, experts [T, k]
    int64): softmax(logits) in float32, its k largest in descending order, divided by
    their sum if `renormalise`."""
    tokens, num_experts = logits.shape
    _check(num_experts, top_k)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    experts = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _softmax_top_k[(tokens,)](
            logits, weights, experts, num_experts, logits.stride(0),
            **_sizes(num_experts, top_k), RENORMALISE=renormalise,
            **pdl.constants(logits.device), num_warps=4)
    return weights, experts


def dense_router(gate: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The router's weight [E, H] if the kernel multiplies it (dense in x's dtype, no
    bias), else None (then its own forward computes the logits)."""
    w = gate.weight
    if (getattr(gate, "bias", None) is None and w.dtype == x.dtype and w.dim() == 2
            and w.shape[1] == x.shape[1] and w.stride(1) == 1 and w.device == x.device):
        return w
    return None


def norm_logits(x: torch.Tensor, residual: torch.Tensor, norm, router: torch.Tensor):
    """(x + residual, `norm` of it, the router's logits of that [T, E] in float32) for a
    window of up to WINDOW_TOKENS tokens in one launch, where norm_triton's kernel and the
    router's matmul take two: `norm` an RMSNorm (its weight, eps and `one_plus`), `router`
    the dense weight [E, H] that `dense_router` gives."""
    tokens, hidden = x.shape
    num_experts = router.shape[0]
    if not 1 <= tokens <= WINDOW_TOKENS:
        raise ValueError(f"norm_logits takes 1 to {WINDOW_TOKENS} tokens, not {tokens}")
    x, residual = x.contiguous(), residual.contiguous()
    total = torch.empty_like(x)
    normed = torch.empty_like(x)
    logits = torch.empty(tokens, num_experts, dtype=torch.float32, device=x.device)
    block_h = triton.next_power_of_2(hidden)
    # NOTE: a program holds EXPERTS router rows of BLOCK_H in fp32: fewer for wide rows
    experts = min(triton.next_power_of_2(num_experts), NORM_LOGIT_EXPERTS,
                  max(1, NORM_LOGIT_VALUES // block_h))
    _norm_logits[(triton.cdiv(num_experts, experts),)](
        x, residual, norm.weight, router, total, normed, logits, tokens, hidden, num_experts,
        x.stride(0), residual.stride(0), router.stride(0), norm.eps,
        T_PAD=triton.next_power_of_2(tokens), BLOCK_H=block_h, EXPERTS=experts,
        ONE_PLUS=norm.one_plus, **pdl.constants(x.device),
        num_warps=min(8, max(1, block_h // 256)))
    return total, normed, logits


def route_window(x: torch.Tensor, gate: torch.nn.Module, top_k: int, renormalise: bool):
    """x [T, H] (1 <= T <= moe_triton.MAX_TOKENS) and the router `gate` (a Linear of H ->
    E) -> (weights [T, k] in x's dtype, experts [T, k] int64, route): `softmax_top_k` of
    gate(x), and `route` the pairs grouped by expert for moe_triton's fused kernels
    (`_route`'s four tensors), in one launch."""
    tokens, hidden = x.shape
    num_experts = gate.out_features
    _check(num_experts, top_k)
    if not 1 <= tokens <= moe_triton.MAX_TOKENS:
        raise ValueError(f"route_window takes 1 to {moe_triton.MAX_TOKENS} tokens, not "
                         f"{tokens}")
    device = x.device
    x = x.contiguous()
    router = dense_router(gate, x)
    if router is None:
        logits = gate(x).float()
    else:
        logits = torch.empty(tokens, num_experts, dtype=torch.float32, device=device)
    pairs = tokens * top_k
    weights = torch.empty(tokens, top_k, dtype=x.dtype, device=device)
    experts = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    counts, starts, order, listed = route = moe_triton.route_buffers(pairs, num_experts,
                                                                     device)
    grouping = moe_triton.grouping_constants(pairs, num_experts)
    t_pad = triton.next_power_of_2(tokens)
    _route_window[(num_experts if router is not None else 1,)](
        x, router if router is not None else x, logits, weights, experts, counts, starts,
        order, listed, arrival_counters(device), tokens, hidden, num_experts, listed.shape[0],
        x.stride(0), router.stride(0) if router is not None else 0, logits.stride(0),
        ROUTER=router is not None, T_PAD=t_pad,
        BLOCK_H=min(triton.next_power_of_2(hidden), max(16, ROUTER_VALUES // t_pad)),
        **_sizes(num_experts, top_k, t_pad), RENORMALISE=renormalise, PAIRS=grouping["PAIRS"],
        CHUNK=grouping["CHUNK"], **pdl.constants(device), num_warps=4)
    return weights, experts, route
