"""strata/layers/moe_triton.py's `fused_experts` against `GroupedExperts.forward` (its
kernels run in triton's interpreter on the CPU, see conftest.py): windows of 1, 3 and 32
tokens at top-k 2 and 8 in fp32 and bf16, 512 experts at top-k 10, experts shared by
several tokens, a token naming one expert more often than a tile has rows, shapes over
several tiles with partial ones; the experts that no token routes to are never read;
both routers of moe.py give it inputs it takes (whole layers agree with it swapped in);
its host code never syncs; the kernels compile for SM86 and SM90 without a GPU; and what
it does not take is a clear ValueError."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from conftest import SM86_SHARED, TRITON_TYPES, compile_kernel, offline_compiled

pytest.importorskip("triton")

from strata.layers import moe_triton
from strata.layers.linear import LinearFactory
from strata.layers.moe import GroupedExperts, GroupedTopKRouter, SharedExpertMoE, SparseMoE
from strata.layers.moe_triton import fused_experts

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def grouped_experts(num_experts: int, hidden: int, inter: int, dtype=torch.float32,
                    seed: int = 0) -> GroupedExperts:
    """GroupedExperts with random weights (scaled so that activations stay near 1)."""
    g = torch.Generator().manual_seed(seed)
    module = GroupedExperts(hidden, inter, num_experts)
    with torch.no_grad():
        for param in (module.gate_proj, module.up_proj):
            param.copy_(torch.randn(param.shape, generator=g) * hidden ** -0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) * inter ** -0.5)
    return reference(module.to(dtype))


def reference(module: GroupedExperts) -> GroupedExperts:
    """`module`, its forward pinned to the grouped (reference) path where it has paths."""
    module.path = "grouped"
    return module


def routing(tokens: int, top_k: int, num_experts: int, dtype=torch.float32, seed: int = 1):
    """Random x-independent routing: distinct experts per token [T, k], weights [T, k]."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g).softmax(dim=-1).to(dtype)
    return experts, weights


def window(tokens: int, hidden: int, dtype=torch.float32, seed: int = 2) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fused(module: GroupedExperts, x, experts, weights) -> torch.Tensor:
    return fused_experts(x, experts, weights, module.gate_proj.detach(),
                         module.up_proj.detach(), module.down_proj.detach())


def assert_matches(y: torch.Tensor, ref: torch.Tensor):
    """y close to ref in ref's dtype's tolerance, relative to ref's largest magnitude."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = TOL[ref.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


@pytest.mark.parametrize("tokens,top_k,num_experts", [
    (1, 8, 128), (3, 2, 8), (32, 10, 512), (7, 4, 60), (32, 8, 16), (5, 1, 1)])
def test_routing_groups_pairs_as_a_stable_sort(tokens, top_k, num_experts):
    """`_route`'s one program equals the PyTorch it replaced: counts by scatter_add_,
    starts by cumsum, order by a stable argsort of the pairs' experts, listed by a stable
    argsort of (count == 0) cut to min(E, T*k); with repeated experts in a window, many
    tokens on few experts and expert counts that are not powers of two."""
    g = torch.Generator().manual_seed(tokens * 1000 + num_experts)
    experts = torch.randint(0, num_experts, (tokens, top_k), generator=g)
    if num_experts >= top_k:  # top-k routing names distinct experts per token
        experts = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices
    counts, starts, order, listed = moe_triton._route(experts, num_experts)
    flat = experts.reshape(-1)
    want_counts = torch.bincount(flat, minlength=num_experts).to(torch.int32)
    assert torch.equal(counts, want_counts)
    assert torch.equal(starts, torch.cumsum(want_counts, 0, dtype=torch.int32) - want_counts)
    assert order.dtype == torch.int64 and torch.equal(order, torch.argsort(flat, stable=True))
    want_listed = torch.argsort((want_counts == 0).to(torch.int32), stable=True)
    assert listed.dtype == torch.int64
    assert torch.equal(listed, want_listed[:min(num_experts, flat.numel())])


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("tokens", [1, 3, 32])
def test_equals_grouped_experts(tokens, top_k, dtype):
    """I = 48 fills part of a 64-column tile; at top-k 8 of 8 every token reads every
    expert, and with 32 tokens each expert serves all of them."""
    module = grouped_experts(8, 64, 48, dtype)
    x = window(tokens, 64, dtype)
    experts, weights = routing(tokens, top_k, 8, dtype)
    assert_matches(fused(module, x, experts, weights), module(x, experts, weights))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_512_experts_at_top_k_10(dtype):
    module = grouped_experts(512, 32, 16, dtype)
    x = window(4, 32, dtype)
    experts, weights = routing(4, 10, 512, dtype, seed=3)
    experts[1, :3] = torch.tensor([511, 0, 256])  # both ends of the experts
    assert_matches(fused(module, x, experts, weights), module(x, experts, weights))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_experts_and_several_tiles(dtype):
    """Expert 2 serves all five tokens, the others one to three; each token's three pairs
    go to different experts. H = 160 and I = 80: three inner steps and two column tiles,
    the last of each partial."""
    module = grouped_experts(6, 160, 80, dtype, seed=4)
    x = window(5, 160, dtype)
    experts = torch.tensor([[2, 0, 5], [2, 1, 4], [3, 2, 0], [1, 5, 2], [4, 3, 2]])
    weights = torch.rand(5, 3, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert_matches(fused(module, x, experts, weights), module(x, experts, weights))


@torch.no_grad()
@pytest.mark.parametrize("tokens,top_k", [(3, 8), (32, 3)])
def test_an_expert_named_more_often_than_a_tile_has_rows(tokens, top_k):
    """A router never names one expert twice for a token, but given so, an expert has
    more pairs than the window has tokens (24 > 16 rows of a tile, 96 > 32): its
    programs walk them a tile at a time, and the sum still counts each pair."""
    module = grouped_experts(4, 64, 48)
    x = window(tokens, 64)
    experts = torch.ones(tokens, top_k, dtype=torch.long)
    experts[0, 0] = 3
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(6))
    assert_matches(fused(module, x, experts, weights), module(x, experts, weights))


@torch.no_grad()
def test_experts_that_no_token_routes_to_are_never_read():
    """NaN weights in every expert the window does not route to leave the output exactly
    as with clean weights."""
    module = grouped_experts(16, 64, 48)
    x = window(3, 64)
    experts, weights = routing(3, 2, 16, seed=7)
    clean = fused(module, x, experts, weights)
    unused = torch.ones(16, dtype=torch.bool)
    unused[experts.reshape(-1)] = False
    assert unused.sum() >= 10
    for param in module.parameters():
        param[unused] = float("nan")
    poisoned = fused(module, x, experts, weights)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)
    assert_matches(clean, grouped_experts(16, 64, 48)(x, experts, weights))


class FusedExperts(torch.nn.Module):
    """A GroupedExperts' weights, multiplied by `fused_experts`: swapped into a layer."""

    def __init__(self, experts: GroupedExperts):
        super().__init__()
        self.inner = experts

    def forward(self, x, experts, weights):
        return fused(self.inner, x, experts, weights)


def randomized(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * param.shape[-1] ** -0.5)
    return layer


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7])
def test_sparse_moe_routing(tokens, dtype):
    """qwen3_moe's softmax top-k (renormalised, weights cast to x's dtype)."""
    layer = randomized(SparseMoE(64, 48, 8, 3, True, LinearFactory()), seed=8).to(dtype)
    reference(layer.experts)
    x = window(tokens, 64, dtype, seed=9)
    ref = layer(x)
    layer.experts = FusedExperts(layer.experts)
    assert_matches(layer(x), ref)


@torch.no_grad()
@pytest.mark.parametrize("tokens", [2, 32])
def test_grouped_top_k_routing_with_shared_experts(tokens):
    """DeepSeek-V3's sigmoid scores, selection bias and group-limited top-k (2 groups of
    4 of 16 experts), float32 weights, and the shared experts added."""
    router = GroupedTopKRouter(64, 16, 4, num_groups=4, topk_groups=2, scaling=2.5)
    layer = randomized(SharedExpertMoE(64, 48, 16, router, 32, LinearFactory()), seed=10)
    reference(layer.experts)
    x = window(tokens, 64, seed=11)
    experts, weights = router(x)
    assert experts.shape == (tokens, 4) and weights.dtype == torch.float32
    ref = layer(x)
    layer.experts = FusedExperts(layer.experts)
    assert_matches(layer(x), ref)


@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 3), (128, 8), (512, 10)])
@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_top_k_routes_as_torch(experts, top_k, renormalise, dtype):
    """route_triton's kernel (triton's interpreter) against softmax, topk, the division
    and the cast: the same experts in the same (descending) order — among equal
    probabilities (bf16 logits) any of them —, the same weights."""
    from strata.layers.route_triton import softmax_top_k

    logits = window(5, experts, dtype, seed=experts + top_k) * 3
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    want, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        want = want / want.sum(dim=-1, keepdim=True)
    weights, got = softmax_top_k(logits, top_k, renormalise, dtype)
    assert got.dtype == torch.int64 and weights.dtype == dtype
    if dtype == torch.float32:  # no ties: the same experts
        assert torch.equal(got, chosen)
    else:  # bf16 logits tie often: any k of the largest, in descending order
        picked = probs.gather(1, got)
        assert torch.equal(picked, probs.gather(1, chosen))
        assert all(len(set(row)) == top_k for row in got.tolist())
    torch.testing.assert_close(weights, want.to(dtype), rtol=1e-6 if dtype == torch.float32
                               else 8e-3, atol=1e-7)
    with pytest.raises(ValueError, match="top-17 of 512 experts"):
        softmax_top_k(window(1, 512, seed=1), 17, True, dtype)
    # what it does not take, SparseMoE routes with torch instead (route_triton.takes)
    from strata.layers.route_triton import takes
    assert takes(512, 10) and takes(1024, 16)
    assert not takes(512, 17) and not takes(2048, 8) and not takes(8, 9)


@torch.no_grad()
def test_sparse_moe_routes_by_the_triton_kernel_as_by_torch():
    """A SparseMoE layer whose router is the kernel (as on CUDA) equals its torch one."""
    layer = randomized(SparseMoE(64, 48, 16, 4, True, LinearFactory()), seed=12)
    reference(layer.experts)
    x = window(6, 64, seed=13)
    ref = layer(x)
    layer.router = "triton"
    assert_matches(layer(x), ref)


def dense_router(hidden: int, num_experts: int, dtype, bias: bool = False, seed: int = 14):
    """A router Linear of random weights (a bias makes route_window compute its logits
    with the Linear's own forward first)."""
    from strata.layers.linear import Linear, ParamSpec
    gate = Linear(hidden, num_experts, bias, ParamSpec())
    return randomized(gate, seed).to(dtype)


@torch.no_grad()
@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 128, 8), (5, 60, 4), (32, 512, 10),
                                                      (3, 8, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_route_window_routes_and_groups_as_the_separate_launches(tokens, num_experts,
                                                                   top_k, bias):
    """route_triton's one launch (the router's logits by its programs, the last one's
    top-k and grouping) equals the router's matmul, `softmax_top_k` and `_route` (fp32:
    the same experts; weights to float tolerance), with the router in the kernel or, with
    a bias, its logits given; and the counter it takes is 0 again after it."""
    from strata.layers import route_triton
    from strata.layers.counters import arrival_counters

    gate = dense_router(64, num_experts, torch.float32, bias)
    x = window(tokens, 64, seed=tokens) * 3
    weights, experts, route = route_triton.route_window(x, gate, top_k, renormalise=True)
    want_weights, want_experts = route_triton.softmax_top_k(gate(x), top_k, True,
                                                            torch.float32)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    for got, want in zip(route, moe_triton._route(want_experts, num_experts)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert not arrival_counters(x.device).any()


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_sparse_moe_routes_small_windows_in_one_launch(tokens, dtype, monkeypatch):
    """A SparseMoE layer whose router and experts take the kernels (as on CUDA) equals
    the reference layer (torch routing, grouped experts): windows of up to WINDOW_TOKENS
    tokens through `route_window` and the fused experts given its grouping, longer ones
    through `softmax_top_k` and the fused experts' own grouping."""
    from strata.layers import route_triton

    layer = randomized(SparseMoE(64, 48, 16, 4, True, LinearFactory()), seed=15).to(dtype)
    reference(layer.experts)
    x = window(tokens, 64, dtype, seed=16)
    ref = layer(x)
    layer.router, layer.experts.path = "triton", "fused"
    original, calls = route_triton.route_window, []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(route_triton, "route_window", counted)
    assert_matches(layer(x), ref)
    assert len(calls) == (tokens <= route_triton.WINDOW_TOKENS)


def test_the_host_code_never_syncs():
    """No host reads or data-sized results in the launcher (a CUDA graph could not
    capture them): none of these calls appears anywhere in the module."""
    banned = {"item", "tolist", "nonzero", "unique", "bincount", "cpu", "numpy",
              "masked_select", "repeat_interleave", "synchronize"}
    from strata.layers import route_triton

    for module in (moe_triton, route_triton):
        tree = ast.parse(inspect.getsource(module))
        called = {node.func.attr if isinstance(node.func, ast.Attribute) else
                  getattr(node.func, "id", None) for node in ast.walk(tree)
                  if isinstance(node, ast.Call)}
        assert not called & banned, module.__name__
    tree = ast.parse(inspect.getsource(moe_triton))
    assert "_route_pairs" in {getattr(n.value, "id", None) for n in ast.walk(tree)
                              if isinstance(n, ast.Subscript)}  # the grouping: one launch


def compile_offline(arch: int, tokens: int, dtype, hidden: int = 2048, inter: int = 768):
    """`_gate_up` and `_down` for a window of `tokens` tokens of `dtype` (Qwen3-30B-A3B's
    expert shape by default) as triton compiles them for an NVIDIA GPU of compute
    capability `arch` (no GPU needed), with the constants the launcher passes."""
    gate_up, down, launch = moe_triton.kernel_constants(tokens, hidden, inter, dtype)

    def types(name: str) -> str:
        return ("*i32" if name in ("counts_ptr", "starts_ptr") else
                "*i64" if name in ("listed_ptr", "order_ptr", "rows_ptr") else
                "*fp32" if name in ("out_ptr", "logits_ptr") else
                "*" + TRITON_TYPES[dtype] if name.endswith("_ptr") else "i32")

    cached = dict(CACHED=tokens > 1)  # an expert cache's rows table (decode: none)
    # a decode window's asks of its down weights into L2, where the GPU has the instruction
    asks = dict(ASKS=8 if arch >= 90 and tokens <= 2 and dtype != torch.float32 else 0,
                ASK_VALUES=8192)
    return [compile_kernel(kernel, arch, constants | cached, types, launch)
            for kernel, constants in ((moe_triton._gate_up,
                                       gate_up | moe_triton.UNCHOSEN | asks),
                                      (moe_triton._down, down | dict(PAIRWISE=False)))]


def compile_route(arch: int, pairs: int = 320, experts: int = 512):
    """`_route_pairs` as the launcher passes it for `pairs` pairs of `experts` experts
    (32 tokens at top-10 of 512 by default), compiled for compute capability `arch`."""
    import triton

    constants = dict(PAIRS=triton.next_power_of_2(pairs), EXPERTS=experts,
                     CHUNK=moe_triton.ROUTE_CHUNK)

    def types(name: str) -> str:
        return ("*i64" if name in ("experts_ptr", "order_ptr", "listed_ptr") else
                "*i32" if name.endswith("_ptr") else "i32")

    return compile_kernel(moe_triton._route_pairs, arch, constants, types,
                          dict(num_warps=4))


def compile_small(arch: int, experts: int = 512, top_k: int = 10,
                  windows: tuple[int, ...] = (1, 32)):
    """route_triton's `_softmax_top_k` (bf16 logits of `experts` experts, top-k) and
    `_route_window` (a dense bf16 router of 2048 columns, windows of `windows` tokens),
    compiled for compute capability `arch`. 512 experts take the top-k's loop, 128 its
    ranks (and one token its grouping from them)."""
    from strata.layers import route_triton

    def router(name: str) -> str:
        return {"logits_ptr": "*bf16", "weights_ptr": "*bf16", "experts_ptr": "*i64"}.get(
            name, "i32")

    def window_types(name: str) -> str:
        return {"x_ptr": "*bf16", "router_ptr": "*bf16", "logits_ptr": "*fp32",
                "weights_ptr": "*bf16", "experts_ptr": "*i64", "order_ptr": "*i64",
                "listed_ptr": "*i64"}.get(name, "*i32" if name.endswith("_ptr") else "i32")

    options = dict(num_warps=4)

    def window(tokens: int) -> dict:
        return route_triton._sizes(experts, top_k, tokens) | dict(
            ROUTER=True, T_PAD=tokens, BLOCK_H=min(2048, route_triton.ROUTER_VALUES // tokens),
            RENORMALISE=True, CHUNK=moe_triton.ROUTE_CHUNK,
            PAIRS=moe_triton.grouping_constants(tokens * top_k, experts)["PAIRS"])
    return [compile_kernel(route_triton._softmax_top_k, arch,
                           route_triton._sizes(experts, top_k) | dict(RENORMALISE=True),
                           router, options)] + [
        compile_kernel(route_triton._route_window, arch, window(tokens), window_types, options)
        for tokens in windows]


COMPILED = [("bfloat16", 1), ("bfloat16", 32), ("float32", 1), ("float32", 32)]


def test_the_kernels_compile_for_rtx3090_and_h200(tmp_path):
    """The interpreter runs what the GPU compiler may reject (types, layouts, shared
    memory): compile both kernels for decode and 32-token windows for SM86 and SM90,
    without a GPU. In a fresh process, since the compiler cannot run where the
    interpreter is chosen."""
    code = ("import torch; from test_moe_triton import COMPILED, compile_offline\n"
            "from test_moe_triton import compile_route, compile_small\n"
            "print(*[k.metadata.shared for d, t in COMPILED\n"
            "        for k in compile_offline(arch, t, getattr(torch, d))])\n"
            "print(compile_route(arch).metadata.shared)\n"
            "print(*[k.metadata.shared for k in compile_small(arch)])\n"
            "print(*[k.metadata.shared for k in compile_small(arch, 128, 8, (1, 4))])")
    shared = offline_compiled(code, tmp_path)
    assert len(shared) == 2 * (2 * len(COMPILED) + 7)
    assert max(shared) <= SM86_SHARED


def test_bad_inputs_are_clear_errors():
    module = grouped_experts(4, 32, 16)
    gate, up, down = (p.detach() for p in module.parameters())
    x = torch.zeros(2, 32)
    experts, weights = routing(2, 2, 4)

    def call(x=x, experts=experts, weights=weights, gate=gate, up=up, down=down):
        return fused_experts(x, experts, weights, gate, up, down)

    for tokens in (0, 33):
        with pytest.raises(ValueError, match=f"1 to 32 tokens, not {tokens}"):
            call(torch.zeros(tokens, 32), torch.zeros(tokens, 2, dtype=torch.long),
                 torch.zeros(tokens, 2))
    with pytest.raises(ValueError, match="x must be a 2-D float32, bfloat16 or float16"):
        call(x.double())
    with pytest.raises(ValueError, match="x must be a 2-D"):
        call(x[None])
    with pytest.raises(ValueError, match=r"experts must be an int64 or int32 tensor \[2, "):
        call(experts=experts[:1])
    with pytest.raises(ValueError, match="experts must be an int64 or int32"):
        call(experts=experts.float())
    with pytest.raises(ValueError, match="top-k of 1 to 10, not 11"):
        call(experts=torch.zeros(2, 11, dtype=torch.long), weights=torch.zeros(2, 11))
    with pytest.raises(ValueError, match=r"weights must be a floating tensor of the "
                                         r"experts' shape \(2, 2\)"):
        call(weights=weights[:, :1])
    with pytest.raises(ValueError, match="weights must be a floating tensor"):
        call(weights=experts)
    with pytest.raises(ValueError, match="gate_proj must be a 3-D torch.float32 tensor, "
                                         "not torch.bfloat16"):
        call(gate=gate.bfloat16())
    with pytest.raises(ValueError, match=r"gate_proj and up_proj must be \[experts, "
                                         r"intermediate, 32\] alike"):
        call(up=up[:, :8])
    with pytest.raises(ValueError, match=r"gate_proj and up_proj must be"):
        call(torch.zeros(2, 48))
    with pytest.raises(ValueError, match=r"down_proj must be \[4, 32, 16\], not \(4, 32, 8\)"):
        call(down=down[..., :8])
