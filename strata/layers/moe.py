"""Mixture-of-experts feed-forward: top-k routing and a grouped expert computation.

Token-expert pairs are sorted by expert so that each expert multiplies one contiguous
slice of rows (a grouped matrix product); the loop, where there is one, runs over
experts, never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # router
        self.experts = GroupedExperts(hidden, intermediate, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        router_probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(router_probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, experts, weights.to(x.dtype))


class GroupedExperts(nn.Module):
    """Expert weights stacked per projection: gate/up [E, I, hidden], down [E, hidden, I]."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = experts.shape
        flat = experts.reshape(-1)                             # [T*k]
        order = torch.argsort(flat, stable=True)
        rows = x[order // top_k]                               # [T*k, hidden], grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        gate = grouped_mm(rows, self.gate_proj, counts)
        up = grouped_mm(rows, self.up_proj, counts)
        out = grouped_mm(F.silu(gate) * up, self.down_proj, counts)  # [T*k, hidden]
        out = out * weights.reshape(-1)[order, None]
        result = torch.zeros_like(x)
        return result.index_add_(0, order // top_k, out)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows: [N, in] sorted by expert, counts[e] rows for expert e; weight: [E, out, in].
    Returns [N, out] with rows[i] @ weight[expert(i)].T."""
    if rows.is_cuda and rows.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for expert, count in enumerate(counts.tolist()):  # NOTE: one host read per layer
        if count:
            out[start:start + count] = rows[start:start + count] @ weight[expert].T
            start += count
    return out
