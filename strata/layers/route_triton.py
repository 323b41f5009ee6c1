"""Softmax top-k routing (SparseMoE's router after its logits) as one Triton kernel: a
program per token loads the token's router logits, takes their softmax in float32, picks
the k largest probabilities in descending order (the first index among equal ones), divides
them by their sum where the model renormalises, and writes the experts (int64) and the
weights rounded to the activations' dtype — what `softmax`, `topk`, the division and the
cast cost five launches for (about 12 us a layer on the H200 for one token, most of it
torch.topk's sort; benchmarks/README.md). Up to 1024 experts and top-16.

NOTE: no host sync and shapes that follow (T, E, k) only: captured in CUDA graphs.
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernels'
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

from strata.layers.moe_triton import _rounded

MAX_EXPERTS = 1024
MAX_TOP_K = 16


@triton.jit
def _softmax_top_k(logits_ptr, weights_ptr, experts_ptr, num_experts, stride_t,
                   TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   RENORMALISE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * stride_t + e, mask=e < num_experts,
                     other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)                    # 0 past num_experts
    j = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
    for rank in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        expert = tl.min(tl.where(probs == best, e, BLOCK_E), axis=0)
        tl.store(experts_ptr + token * TOP_K + rank, expert.to(tl.int64))
        chosen = tl.where(j == rank, best, chosen)
        probs = tl.where(e == expert, -1.0, probs)           # below every probability
    if RENORMALISE:
        chosen = chosen / tl.sum(chosen, axis=0)
    dtype = weights_ptr.dtype.element_ty
    tl.store(weights_ptr + token * TOP_K + j, _rounded(chosen, dtype).to(dtype),
             mask=j < TOP_K)


def takes(num_experts: int, top_k: int) -> bool:
    """Does the kernel route top-k of this many experts?"""
    return 1 <= top_k <= min(num_experts, MAX_TOP_K) and num_experts <= MAX_EXPERTS


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalise: bool,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype) -> (weights [T, k] in `dtype`, experts [T, k]
    int64): softmax(logits) in float32, its k largest in descending order, divided by
    their sum if `renormalise`."""
    tokens, num_experts = logits.shape
    if not takes(num_experts, top_k):
        raise ValueError(f"softmax_top_k: top-{top_k} of {num_experts} experts (at most "
                         f"top-{MAX_TOP_K} of {MAX_EXPERTS})")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    experts = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _softmax_top_k[(tokens,)](
            logits, weights, experts, num_experts, logits.stride(0), TOP_K=top_k,
            BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
            BLOCK_K=max(2, triton.next_power_of_2(top_k)), RENORMALISE=renormalise,
            num_warps=4)
    return weights, experts
