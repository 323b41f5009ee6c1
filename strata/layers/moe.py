"""Mixture-of-experts feed-forward: top-k routing and a grouped expert computation.

Two routers: softmax top-k (SparseMoE, qwen3_moe; on CUDA Triton kernels, route_triton.py,
which for the fused experts' windows also group the pairs, all in one launch) and
DeepSeek-V3's sigmoid scores with a selection bias and group-limited top-k
(GroupedTopKRouter, used with always-on shared experts by SharedExpertMoE).
Token-expert pairs are sorted by expert so that each expert multiplies one contiguous
slice of rows (a grouped matrix product); the loop, where there is one, runs over
experts, never over tokens. Decode and verify windows on CUDA take the
fused kernels of moe_triton.py instead. Expert weights are dense, or (`--quantized-weights
on`) their GGUF blocks: the fused kernels decode them as they go, the grouped product
dequantizes each routed expert. With --experts-in-ram the routed experts live in host RAM
and a stage-wide VRAM cache of them (strata/experts): `offload` then gives both paths
their weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.layers.linear import LinearFactory, ParamSpec, with_spec
from strata.layers.mlp import GatedMLP
from strata.layers.norm import RMSNorm
from strata.quant import triton_available

FUSED_MAX_TOKENS = 32  # the fused path's largest window (decode and verify windows)

FLOAT32 = ParamSpec(torch.float32)


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, linear: LinearFactory):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = linear(hidden, num_experts)  # router
        self.experts = GroupedExperts(hidden, intermediate, num_experts,
                                      quantized=linear.format.quantized)

    router = "auto"  # "torch", "triton" (route_triton.py) or "auto": triton on CUDA

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self._with_shared(x, self._routed(x))

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor,
                         norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer on norm(x + residual): (its output, x + residual), the decoder's
        post-attention add and norm made here (DecoderLayer). A window of one or two tokens
        on the kernels' path takes one launch for the add, the norm and the router's logits
        (route_triton's `norm_logits`) and none for the top-k and the grouping: every
        program of the experts' gate and up kernel takes its expert from the logits
        (moe_triton's RouterChoice). Other windows: the norm's own launch, then `forward`."""
        router = self._router_chooses(x, norm)
        if router is None:
            h, normed = norm.add_and_norm(x, residual)
            return self(normed), h
        from strata.layers import moe_triton, route_triton
        h, normed, logits = route_triton.norm_logits(x, residual, norm, router)
        choice = moe_triton.RouterChoice(logits, self.top_k, self.norm_topk_prob)
        return self._with_shared(normed, self.experts(normed, None, None, choice=choice)), h

    def _router_chooses(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor | None:
        """The router's dense weight where the experts' kernel takes the top-k of a window
        of up to moe_triton.CHOOSE_TOKENS tokens itself (`add_norm_forward`), else None.
        Quantized experts' one-warp row kernels take it in k rounds (ranking 128 experts in
        every program decoded Qwen3-30B-A3B's Q4_K shape slower than the routing launch,
        330 against 341 tok/s; in k rounds 353 against 321, both on an H100:
        benchmarks/README.md)."""
        if not (self._kernel_routes(x) and self.experts.takes_route(x)
                and norm.runs_kernel(x)):
            return None
        from strata.layers.moe_triton import CHOOSE_TOKENS
        from strata.layers.route_triton import dense_router
        return dense_router(self.gate, x) if x.shape[0] <= CHOOSE_TOKENS else None

    def _with_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The routed experts' output plus what every token passes through (none here)."""
        return routed

    def _routed(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if self._kernel_routes(x):
            from strata.layers import route_triton
            if (x.shape[0] <= route_triton.WINDOW_TOKENS
                    and self.experts.takes_route(x)):  # the router's launch groups the pairs
                weights, experts, route = route_triton.route_window(
                    x, self.gate, self.top_k, self.norm_topk_prob)
                return self.experts(x, experts, weights, route)
            weights, experts = route_triton.softmax_top_k(self.gate(x), self.top_k,
                                                          self.norm_topk_prob, x.dtype)
            return self.experts(x, experts, weights)
        logits = self.gate(x)
        router_probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(router_probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, experts, weights.to(x.dtype))

    def predict_experts(self, x: torch.Tensor) -> torch.Tensor:
        """The experts this layer would route x to [T, k] (the expert cache's prefetch
        applies it to the previous layer's input)."""
        return torch.topk(self.gate(x), self.top_k, dim=-1).indices

    def _kernel_routes(self, x: torch.Tensor) -> bool:
        """route_triton's kernels route: `router` "triton", or "auto" on CUDA with triton
        for the expert counts and top-k they take (else torch routes)."""
        if self.router != "auto":
            return self.router == "triton"
        if not (x.is_cuda and triton_available()):
            return False
        from strata.layers.route_triton import takes
        return takes(self.gate.out_features, self.top_k)


class GatedSharedMoE(SparseMoE):
    """Qwen3-Next / Qwen3.5: SparseMoE plus one shared expert, scaled per token by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_intermediate: int, linear: LinearFactory):
        super().__init__(hidden, intermediate, num_experts, top_k, norm_topk_prob, linear)
        self.shared_expert = GatedMLP(hidden, shared_intermediate, linear)
        self.shared_expert_gate = linear(hidden, 1)

    def _with_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class GroupedTopKRouter(nn.Module):
    """DeepSeek-V3 / GLM-4.5 routing, in float32 like the reference. Sigmoid scores plus
    `e_score_correction_bias` choose the experts, but the weights are the plain scores.
    The choice is limited to the `topk_groups` best of `num_groups` equal groups of
    experts, a group scoring the sum of its two best biased scores.

    NOTE: its parameters stay float32 when the stage's weights are bf16, as transformers
    keeps them: a bf16 router flips expert choices."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, num_groups: int = 1,
                 topk_groups: int = 1, norm_topk_prob: bool = True, scaling: float = 1.0):
        super().__init__()
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling
        self.weight = with_spec(nn.Parameter(torch.empty(num_experts, hidden)), FLOAT32)
        # A parameter (not a buffer) so that the stage loads it with the weights.
        self.e_score_correction_bias = with_spec(
            nn.Parameter(torch.empty(num_experts), requires_grad=False), FLOAT32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> expert ids [T, k], float32 weights [T, k]."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()         # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.num_groups > 1:
            grouped = choice.view(x.shape[0], self.num_groups, -1)           # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)        # [T, G]
            best = torch.topk(group_scores, self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)
        experts = torch.topk(choice, self.top_k, dim=-1).indices            # [T, k]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


class SharedExpertMoE(nn.Module):
    """Routed experts chosen by `gate`, plus shared experts that every token passes
    through (one gated MLP of `shared_intermediate` rows; none when 0)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, gate: nn.Module,
                 shared_intermediate: int, linear: LinearFactory):
        super().__init__()
        self.gate = gate
        self.experts = GroupedExperts(hidden, intermediate, num_experts,
                                      quantized=linear.format.quantized)
        if shared_intermediate:
            self.shared_experts = GatedMLP(hidden, shared_intermediate, linear)

    def predict_experts(self, x: torch.Tensor) -> torch.Tensor:
        """The experts this layer would route x to [T, k] (see SparseMoE's)."""
        return self.gate(x)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        experts, weights = self.gate(x)
        out = self.experts(x, experts, weights.to(x.dtype))
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


class GroupedExperts(nn.Module):
    """Expert weights stacked per projection: gate/up [E, I, hidden], down [E, hidden, I].

    Two paths compute the same sum. `fused` (moe_triton.py: two Triton kernels that read
    only the experts the window's tokens route to, no host sync) runs windows of up to
    FUSED_MAX_TOKENS tokens on CUDA where triton is installed: decode and verify windows,
    which CUDA graphs capture. `grouped` runs the rest (prompt chunks, the CPU): tokens
    sorted by expert, one grouped product per projection, its expert counts read on the
    host. `path` pins one (benchmarks); `auto` chooses per window."""

    path = "auto"
    offload = None  # an expert cache's view (experts/cache.py: CachedExperts), set by the
                    # stage with --experts-in-ram: the weights then live in host RAM

    def __init__(self, hidden: int, intermediate: int, num_experts: int,
                 quantized: bool = False):
        """`quantized`: the stacked weights may stay in their file's GGUF blocks (uint8
        [E, out, row bytes] with a `qtype`; the loader decides from the file)."""
        super().__init__()
        self.num_experts = num_experts
        spec = ParamSpec(quantized=quantized)
        self.gate_proj = with_spec(nn.Parameter(torch.empty(num_experts, intermediate, hidden)),
                                   spec)
        self.up_proj = with_spec(nn.Parameter(torch.empty(num_experts, intermediate, hidden)),
                                 spec)
        self.down_proj = with_spec(nn.Parameter(torch.empty(num_experts, hidden, intermediate)),
                                   spec)

    @property
    def capture_limit(self) -> int:
        """Largest window (tokens) a CUDA graph may capture: the fused path's, where it runs."""
        if self.offload is not None:
            return FUSED_MAX_TOKENS if self._fused_runs(self.offload.cache.pool) else 0
        return FUSED_MAX_TOKENS if self._fused_runs(self.gate_proj) else 0

    @property
    def fusable(self) -> bool:
        """The three projections are alike, all dense or all in GGUF blocks (a file may
        store one in a type that is dequantized at load: the grouped path takes those)."""
        return len({w.dtype == torch.uint8
                    for w in (self.gate_proj, self.up_proj, self.down_proj)}) == 1

    def _fused_runs(self, t: torch.Tensor) -> bool:
        """The fused path runs for these weights on `t`'s device (CUDA with triton)."""
        return self.fusable and t.is_cuda and triton_available()

    def _path(self, x: torch.Tensor) -> str:
        if self.path != "auto":
            return self.path
        return ("fused" if self._fused_runs(x) and x.shape[0] <= FUSED_MAX_TOKENS
                else "grouped")

    def takes_route(self, x: torch.Tensor) -> bool:
        """Does this window take its pairs grouped by the router's kernel (route_triton's
        `route_window`)? The fused path over the layer's own weights (no expert cache)."""
        return self.offload is None and self._path(x) == "fused"

    def forward(self, x: torch.Tensor, experts: torch.Tensor | None,
                weights: torch.Tensor | None, route: tuple[torch.Tensor, ...] | None = None,
                choice=None) -> torch.Tensor:
        """`route`: the pairs grouped by expert already (where `takes_route`). `choice`
        (experts and weights None; a one-token window where `takes_route`): the fused
        kernels take the top-k of the router's logits themselves (moe_triton.RouterChoice)."""
        if self.offload is not None:
            self.offload.before(x)
        path = self._path(x)
        if path == "fused" and self.offload is not None:
            return self.offload.fused(x, experts, weights)
        if path == "fused":
            from strata.layers import moe_triton
            if self.gate_proj.dtype == torch.uint8:
                return moe_triton.fused_experts_quantized(
                    x, experts, weights, *((w, w.qtype) for w in
                                           (self.gate_proj, self.up_proj, self.down_proj)),
                    route=route, choice=choice)
            return moe_triton.fused_experts(x, experts, weights, self.gate_proj, self.up_proj,
                                            self.down_proj, route=route, choice=choice)
        return self.grouped(x, experts, weights)

    def grouped(self, x: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = experts.shape
        flat = experts.reshape(-1)                             # [T*k]
        order = torch.argsort(flat, stable=True)
        rows = x[order // top_k]                               # [T*k, hidden], grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        gate_w, up_w, down_w = (self.gate_proj, self.up_proj, self.down_proj)
        if self.offload is not None:  # the routed experts gathered from slots and host RAM
            gate_w, up_w, down_w = self.offload.gathered(counts)
        gate = grouped_mm(rows, gate_w, counts)
        up = grouped_mm(rows, up_w, counts)
        out = grouped_mm(F.silu(gate) * up, down_w, counts)  # [T*k, hidden]
        out = out * weights.reshape(-1)[order, None]
        # back in pair order, each token's k rows summed in order: deterministic (an
        # index_add_ adds them with atomics on CUDA, in a different order every run)
        pairs = torch.empty_like(out)
        pairs[order] = out
        return pairs.view(tokens, top_k, -1).sum(dim=1)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows: [N, in] sorted by expert, counts[e] rows for expert e; weight: [E, out, in]
    (or its GGUF blocks [E, out, row bytes] with a `qtype`: each routed expert is then
    dequantized to rows' dtype for its product). Returns [N, out] with
    rows[i] @ weight[expert(i)].T."""
    if weight.dtype == torch.uint8:
        from strata import quant
        return looped_mm(rows, counts,
                         lambda e: quant.dequantize(weight[e], weight.qtype, rows.dtype),
                         weight.shape[1])
    if rows.is_cuda and rows.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    return looped_mm(rows, counts, weight.__getitem__, weight.shape[1])


def looped_mm(rows: torch.Tensor, counts: torch.Tensor, weight_of,
              out_features: int) -> torch.Tensor:
    """grouped_mm one expert at a time: weight_of(e) is expert e's dense [out, in]."""
    out = rows.new_empty(rows.shape[0], out_features)
    start = 0
    for expert, count in enumerate(counts.tolist()):  # NOTE: one host read per layer
        if count:
            out[start:start + count] = rows[start:start + count] @ weight_of(expert).T
            start += count
    return out
