"""Windows of one or two tokens whose fused experts choose their own top-k (moe_triton's
RouterChoice, route_triton's `norm_logits`; kernels in triton's interpreter on the CPU,
see conftest.py): the gate and up kernel's choice and pairs give the route kernel's
outputs bit for bit (dense and quantized experts, top-k by ranks and by rounds, ties,
with and without renormalisation, an expert two tokens name); the norm and router launch
equals the norm's kernel and the router's matmul; SparseMoE and the Qwen3-Next MoE take
the path for one or two tokens only, with the same outputs, with dense experts and with
experts in GGUF blocks; an engine's greedy tokens are the same with it; the kernels
compile for SM86 and SM90 without a GPU; and what it does not take is a clear error."""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_TYPES, build_tiny, compile_kernel, offline_compiled, prompts
from test_moe_triton import assert_matches, grouped_experts, randomized, window
from test_moe_triton_quant import keep_quantized, quantized_experts

pytest.importorskip("triton")

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.layers import moe_triton, route_triton
from strata.layers.linear import LinearFactory
from strata.layers.moe import GatedSharedMoE, GroupedExperts, SparseMoE
from strata.layers.moe_triton import RouterChoice, fused_experts, fused_experts_quantized
from strata.layers.norm import RMSNorm, ZeroCentredRMSNorm
from strata.sampling.params import SamplingParams


def logits_of(num_experts: int, seed: int, ties: bool = False, tokens: int = 1) -> torch.Tensor:
    """The tokens' router logits [T, E] in float32 (`ties`: on a coarse grid, so that
    several experts share a probability and the lower id must win)."""
    logits = 3 * torch.randn(tokens, num_experts,
                             generator=torch.Generator().manual_seed(seed))
    return (logits * 2).round() / 2 if ties else logits


def dense(module: GroupedExperts):
    return tuple(p.detach() for p in (module.gate_proj, module.up_proj, module.down_proj))


@torch.no_grad()
@pytest.mark.parametrize("num_experts,top_k,dtype,renormalise,ties,tokens", [
    (16, 4, torch.float32, True, False, 1),
    (128, 8, torch.bfloat16, True, True, 1),    # ranks (128^2 pairs), Qwen3-30B-A3B's routing
    (200, 6, torch.float32, False, True, 1),    # rounds (256^2 pairs are too many to rank)
    (512, 10, torch.bfloat16, True, False, 1),  # Qwen3-Next's
    (8, 4, torch.float32, True, True, 2),       # two tokens naming the same experts
    (128, 8, torch.bfloat16, True, False, 2),
])
def test_the_gate_and_up_kernel_chooses_as_the_route_kernel(num_experts, top_k, dtype,
                                                            renormalise, ties, tokens):
    """The experts and weights the kernels choose from the logits give the output that
    `softmax_top_k`'s experts and weights give, bit for bit, and the reference's; the
    grouping they leave lists the chosen experts (by token, then rank) with one pair
    each, an expert two tokens name listed twice."""
    module = grouped_experts(num_experts, 32, 16, dtype, seed=num_experts)
    x = window(tokens, 32, dtype, seed=3)
    logits = logits_of(num_experts, seed=top_k, ties=ties, tokens=tokens)
    weights, experts = route_triton.softmax_top_k(logits, top_k, renormalise, dtype)
    want = fused_experts(x, experts, weights, *dense(module))
    seen = []
    real = moe_triton._routing
    moe_triton_routing = lambda *a: seen.append(real(*a)) or seen[-1]  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe_triton, "_routing", moe_triton_routing)
        got = fused_experts(x, None, None, *dense(module),
                            choice=RouterChoice(logits, top_k, renormalise))
    assert torch.equal(got, want)
    assert_matches(got, module(x, experts, weights))
    (counts, starts, order, listed), chosen = seen[0][:2]
    assert torch.equal(listed, experts.flatten()) and torch.equal(chosen, weights.flatten())
    assert torch.equal(order, torch.arange(tokens * top_k))
    if tokens == 1:  # (with more, an expert named twice keeps one pair's start)
        assert torch.equal(counts[listed], torch.ones(top_k, dtype=torch.int32))
        assert torch.equal(starts[listed], torch.arange(top_k, dtype=torch.int32))
    elif num_experts == 8:  # the case this parameter set is for: an expert named twice
        assert set(experts[0].tolist()) & set(experts[1].tolist())


@torch.no_grad()
@pytest.mark.parametrize("qtypes,tokens", [(("Q8_0", "Q8_0", "Q4_1"), 1),
                                           (("Q4_0", "Q4_1", "Q8_0"), 1),
                                           (("Q8_0", "Q8_0", "Q4_1"), 2)])
def test_quantized_experts_choose_too(qtypes, tokens):
    """The row kernels of quantized experts (gate and up of one format walked together,
    or of two walked in turn) choose as the route kernel would, bit for bit, for one
    token and for two (which name some of the 8 experts both)."""
    pairs = quantized_experts(qtypes, 8, 64, 32, seed=5)
    x = window(tokens, 64, torch.float32, seed=6)
    logits = logits_of(8, seed=7, tokens=tokens)
    weights, experts = route_triton.softmax_top_k(logits, 3, True, torch.float32)
    want = fused_experts_quantized(x, experts, weights, *pairs)
    got = fused_experts_quantized(x, None, None, *pairs, choice=RouterChoice(logits, 3, True))
    assert torch.equal(got, want)


def norm_of(kind: type[RMSNorm], hidden: int, dtype, seed: int) -> RMSNorm:
    norm = kind(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("kind,num_experts", [(RMSNorm, 24), (ZeroCentredRMSNorm, 128)])
def test_norm_logits_equals_the_norm_then_the_router(dtype, tokens, kind, num_experts,
                                                     monkeypatch):
    """The one launch's sum and normed rows are norm_triton's kernel's bit for bit; its
    logits are the router's matmul of them (float tolerance: the sum's order), and within
    a step of the PyTorch norms then the matmul."""
    norm = norm_of(kind, 64, dtype, seed=num_experts)
    router = (0.3 * torch.randn(num_experts, 64, generator=torch.Generator().manual_seed(2))
              ).to(dtype)
    x, residual = window(tokens, 64, dtype, seed=4), window(tokens, 64, dtype, seed=5)
    total, normed, logits = route_triton.norm_logits(x, residual, norm, router)
    monkeypatch.setattr(RMSNorm, "path", "triton")
    kernel_total, kernel_normed = norm.add_and_norm(x, residual)
    assert torch.equal(total, kernel_total) and torch.equal(normed, kernel_normed)
    assert logits.dtype == torch.float32 and logits.shape == (tokens, num_experts)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits, (normed @ router.T).float(), rtol=tol, atol=tol)
    monkeypatch.setattr(RMSNorm, "path", "torch")
    ref_total, ref_normed = norm.add_and_norm(x, residual)
    step = 1e-6 if dtype == torch.float32 else 3.2e-2  # the interpreter truncates to bf16
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=step, atol=step)
    torch.testing.assert_close(total.float(), ref_total.float(), rtol=step, atol=0)


@torch.no_grad()
def test_norm_logits_of_wide_rows_take_one_router_row_a_program(monkeypatch):
    """Rows of 8192 values: a program holds one router row (NORM_LOGIT_VALUES), and the
    logits are still every expert's."""
    launches = []
    real = route_triton._norm_logits.__getitem__
    monkeypatch.setattr(type(route_triton._norm_logits), "__getitem__",
                        lambda self, grid: launches.append(grid) or real(grid))
    norm, router = norm_of(RMSNorm, 8192, torch.float32, seed=3), 0.01 * torch.randn(3, 8192)
    x, residual = window(1, 8192, seed=7), window(1, 8192, seed=8)
    _, normed, logits = route_triton.norm_logits(x, residual, norm, router)
    assert launches == [(3,)]
    torch.testing.assert_close(logits, normed @ router.T, rtol=1e-5, atol=1e-5)


def kernel_paths(monkeypatch) -> None:
    """The paths a CUDA stage takes (here in the interpreter): the norms' kernel, the
    routing kernels and the fused experts."""
    monkeypatch.setattr(RMSNorm, "path", "triton")
    monkeypatch.setattr(SparseMoE, "router", "triton")
    monkeypatch.setattr(GroupedExperts, "path", "fused")


def counted(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 2, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_layers_choose_for_one_or_two_tokens(tokens, shared, monkeypatch):
    """`add_norm_forward` on the kernels' path: a window of one or two tokens launches
    `norm_logits` and no route kernel, and gives what the norm's kernel then the route
    kernel's path give, bit for bit, and what PyTorch's paths give; longer windows keep
    that path. With a shared expert (Qwen3-Next's, zero-centred norm) too."""
    if shared:
        layer = GatedSharedMoE(64, 32, 16, 4, True, 48, LinearFactory())
        norm = norm_of(ZeroCentredRMSNorm, 64, torch.float32, seed=1)
    else:
        layer = SparseMoE(64, 32, 16, 4, True, LinearFactory())
        norm = norm_of(RMSNorm, 64, torch.float32, seed=1)
    layer = randomized(layer, seed=21)
    x, residual = window(tokens, 64, seed=22), window(tokens, 64, seed=23)
    torch_out, torch_h = layer.add_norm_forward(x, residual, norm)  # CPU: PyTorch's paths
    kernel_paths(monkeypatch)
    launches = counted(monkeypatch, route_triton, "norm_logits")
    routes = counted(monkeypatch, route_triton, "route_window")
    out, h = layer.add_norm_forward(x, residual, norm)
    chooses = tokens <= moe_triton.CHOOSE_TOKENS
    assert (launches, len(routes)) == ([1] if chooses else [], int(not chooses))
    monkeypatch.setattr(SparseMoE, "_router_chooses", lambda *a: None)
    routed_out, routed_h = layer.add_norm_forward(x, residual, norm)
    assert torch.equal(out, routed_out) and torch.equal(h, routed_h)
    assert_matches(out, torch_out)
    torch.testing.assert_close(h, torch_h, rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("qtypes", [("Q8_0", "Q8_0", "Q4_1"), ("Q4_0", "Q8_0", "Q8_0")])
def test_quantized_experts_choose_for_one_token_in_a_layer(qtypes, monkeypatch):
    """A SparseMoE whose experts stay in GGUF blocks (gate and up of one format, walked
    together, or of two): a one-token window launches `norm_logits` and no route kernel,
    and the row kernels' choice in k rounds gives the route kernel's path bit for bit."""
    layer = randomized(SparseMoE(64, 32, 16, 4, True, LinearFactory()), seed=31)
    keep_quantized(layer.experts, quantized_experts(qtypes, 16, 64, 32, seed=7))
    norm = norm_of(RMSNorm, 64, torch.float32, seed=2)
    x, residual = window(1, 64, seed=32), window(1, 64, seed=33)
    kernel_paths(monkeypatch)
    launches = counted(monkeypatch, route_triton, "norm_logits")
    routes = counted(monkeypatch, route_triton, "route_window")
    out, h = layer.add_norm_forward(x, residual, norm)
    assert (launches, routes) == ([1], [])
    monkeypatch.setattr(SparseMoE, "_router_chooses", lambda *a: None)
    routed_out, routed_h = layer.add_norm_forward(x, residual, norm)
    assert routes == [1]
    assert torch.equal(out, routed_out) and torch.equal(h, routed_h)


def test_an_engine_gives_the_same_tokens_with_it(tmp_path, monkeypatch):
    """A tiny qwen3_moe on the kernels' paths (PyTorch attention), two requests with up to
    3 drafts: the same greedy tokens whether one-token windows choose in the experts'
    kernel or route by the route kernel; and they did choose."""
    folder = tmp_path / "moe"
    model = build_tiny("qwen3_moe", folder, num_hidden_layers=2, mlp_only_layers=[])
    batch = prompts(2, model.config.vocab_size, seed=8, low=5, high=20)
    batch[0] = batch[0][:5] * 3  # repeats: the lookup proposer drafts
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(folder), attention_backend="reference", parallel=2,
                                 spec=3, max_context=64, max_window_tokens=32))
    kernel_paths(monkeypatch)
    chosen = counted(monkeypatch, route_triton, "norm_logits")
    ours = engine.generate(batch, params)
    assert chosen
    monkeypatch.setattr(SparseMoE, "_router_chooses", lambda *a: None)
    assert engine.generate(batch, params) == ours


def test_bad_choices_are_clear_errors():
    module = grouped_experts(8, 32, 16)
    logits = logits_of(8, seed=1)

    def call(x=window(1, 32), logits=logits, top_k=2, **kw):
        return fused_experts(x, None, None, *dense(module),
                             choice=RouterChoice(logits, top_k, True), **kw)

    with pytest.raises(ValueError, match="windows of 1 to 2 tokens only, not of 3 tokens"):
        call(window(3, 32))
    with pytest.raises(ValueError, match=r"logits must be float32 \[2, 8\]"):
        call(window(2, 32))
    with pytest.raises(ValueError, match=r"logits must be float32 \[1, 8\]"):
        call(logits=logits[:, :4])
    with pytest.raises(ValueError, match=r"logits must be float32 \[1, 8\]"):
        call(logits=logits.double())
    with pytest.raises(ValueError, match="top-k of 1 to 10, not 9 of 8 experts"):
        call(top_k=9)
    with pytest.raises(ValueError, match="layer's own weights"):
        call(rows=torch.arange(8))
    with pytest.raises(ValueError, match="norm_logits takes 1 to 4 tokens, not 5"):
        route_triton.norm_logits(window(5, 32), window(5, 32), norm_of(RMSNorm, 32,
                                 torch.float32, 1), torch.zeros(8, 32))


def _compile(arch: int) -> list[int]:
    """The choosing gate and up kernels (dense bf16 of Qwen3-30B-A3B's shape, ranks;
    Q4_K of 512 experts, rounds), the down kernels that walk their pairs, and
    `norm_logits`' kernel (hidden 2048 at one and four tokens, 8192 at one: one router
    row a program), as launched on a GPU of compute capability `arch`: their shared
    memory."""
    gate_up, down, launch = moe_triton.kernel_constants(2, 2048, 768, torch.bfloat16)
    rows, down_rows = moe_triton.quantized_row_constants(("Q4_K", "Q4_K", "Q6_K"), 2048)

    def choosing(num_experts: int, top_k: int) -> dict:
        sizes = route_triton._sizes(num_experts, top_k)
        return dict(CACHED=False, CHOOSE=True, TOP_K=top_k, BLOCK_E=sizes["BLOCK_E"],
                    BLOCK_TOP=sizes["BLOCK_K"], RANKED=sizes["RANKED"], RENORMALISE=True)

    def types(name: str) -> str:
        return ("*u8" if name in ("gate_ptr", "up_ptr") else
                "*i32" if name in ("counts_ptr", "starts_ptr") else
                "*i64" if name in ("listed_ptr", "order_ptr", "rows_ptr") else
                "*fp32" if name == "logits_ptr" else
                "*bf16" if name.endswith("_ptr") else "i32")

    def dense_types(name: str) -> str:
        return "*bf16" if name in ("gate_ptr", "up_ptr") else types(name)

    kernels = [
        compile_kernel(moe_triton._gate_up, arch, gate_up | choosing(128, 8) | dict(
            ASKS=8 if arch >= 90 else 0, ASK_VALUES=8192), dense_types,
                       launch),
        compile_kernel(moe_triton._gate_up_q_rows, arch, rows | choosing(512, 10), types,
                       dict(num_warps=1)),
        compile_kernel(moe_triton._down, arch, down | dict(CACHED=False, PAIRWISE=True),
                       lambda name: "*fp32" if name == "out_ptr" else dense_types(name),
                       launch),
        compile_kernel(moe_triton._down_q_rows, arch,
                       down_rows | dict(CACHED=False, PAIRWISE=True),
                       lambda name: "*u8" if name == "down_ptr" else
                       "*fp32" if name == "out_ptr" else types(name), dict(num_warps=1))]
    for tokens, hidden in ((1, 2048), (4, 2048), (1, 8192)):
        kernels.append(compile_kernel(
            route_triton._norm_logits, arch,
            dict(T_PAD=tokens, BLOCK_H=hidden, ONE_PLUS=False,
                 EXPERTS=min(route_triton.NORM_LOGIT_EXPERTS,
                             route_triton.NORM_LOGIT_VALUES // hidden)),
            lambda name: "*fp32" if name == "logits_ptr" else
            "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps" else "i32",
            dict(num_warps=8)))
    return [k.metadata.shared for k in kernels]


def test_the_kernels_compile_for_rtx3090_and_h200(tmp_path):
    code = "from test_moe_chosen import _compile\nprint(*_compile(arch))"
    assert len(offline_compiled(code, tmp_path)) == 2 * 7
