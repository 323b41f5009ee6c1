"""strata/layers/moe_triton.py's `fused_experts_quantized` against its reference: each
expert's blocks dequantized by strata/quant/reference.py, then `GroupedExperts`' grouped
computation (its kernels run in triton's interpreter on the CPU, see conftest.py). Random
blocks of every format (finite f16 scales sized so that activations stay near 1) in fp32
and bf16: the 32-value formats at windows of 1, 5 and 32 tokens and top-k 8 and 2 of 8
experts; the K-quants (whose 256-value blocks make every tile cost seconds in the
interpreter) at 1, 5 and 32 tokens, top-k 2 of 4; gate, up and down of different formats
(Q4_K/Q4_K/Q6_K as UD-Q4_K_XL files mix them, and a 32-value gate with K-quant up and
down); 512 experts at top-k 10; an expert named more often than a tile has rows; experts
that no token routes to are never read; the kernels compile for SM86 and SM90 without a
GPU; and what it does not take is a clear ValueError."""

from __future__ import annotations


import pytest
import torch
from conftest import SM86_SHARED, TRITON_TYPES, compile_kernel, offline_compiled
from test_moe_triton import routing, window

pytest.importorskip("triton")

from strata.layers import moe_triton
from strata.layers.moe import GroupedExperts
from strata.layers.moe_triton import fused_experts_quantized
from strata.quant.formats import FORMATS
from strata.quant.reference import dequantize

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def random_experts(qtype: str, experts: int, rows: int, values: int,
                   seed: int = 0) -> tuple[torch.Tensor, str]:
    """(blocks [experts, rows, row bytes], qtype): random bytes whose f16 scale fields are
    finite, 0.5..1 times one unit chosen so that the dequantized weight's RMS is
    values ** -0.5 (a random row times a unit-variance x is then about 1)."""
    fmt = FORMATS[qtype]
    count = values // fmt.block_values
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts * rows, count, fmt.block_bytes), generator=g,
                           dtype=torch.uint8)
    fields = [torch.rand(experts * rows, count, generator=g) * 0.5 + 0.5 for _ in fmt.scales]

    def write(unit: float) -> None:
        for offset, field in zip(fmt.scales, fields):
            blocks[..., offset:offset + 2] = (field * unit).half().view(torch.uint8).view(
                experts * rows, count, 2)

    write(1.0)
    rms = dequantize(blocks.view(experts * rows, -1), qtype).pow(2).mean().sqrt().item()
    write(values ** -0.5 / rms)
    return blocks.view(experts, rows, -1), qtype


def quantized_experts(qtypes: tuple[str, str, str], num_experts: int, hidden: int,
                      inter: int, seed: int = 0):
    """(gate, up, down) pairs of the given formats for `num_experts` experts."""
    gate, up, down = qtypes
    return (random_experts(gate, num_experts, inter, hidden, seed),
            random_experts(up, num_experts, inter, hidden, seed + 1),
            random_experts(down, num_experts, hidden, inter, seed + 2))


def keep_quantized(experts: GroupedExperts, pairs) -> GroupedExperts:
    """`experts` (a GroupedExperts) with its gate, up and down projections replaced by
    the (blocks, qtype) `pairs`, as the loader leaves experts kept in GGUF blocks."""
    for name, (blocks, qtype) in zip(("gate_proj", "up_proj", "down_proj"), pairs):
        param = torch.nn.Parameter(blocks, requires_grad=False)
        param.qtype = qtype
        setattr(experts, name, param)
    return experts


def reference(x, experts, weights, gate, up, down) -> torch.Tensor:
    """GroupedExperts' grouped computation over the experts dequantized (reference.py)."""
    num_experts, inter = gate[0].shape[:2]
    module = GroupedExperts(x.shape[1], inter, num_experts)
    with torch.no_grad():
        for param, (blocks, qtype) in ((module.gate_proj, gate), (module.up_proj, up),
                                       (module.down_proj, down)):
            param.copy_(dequantize(blocks.reshape(-1, blocks.shape[2]), qtype).view(
                param.shape))
    module = module.to(x.dtype)
    module.path = "grouped"
    return module(x, experts, weights)


def assert_matches(y: torch.Tensor, ref: torch.Tensor):
    """y close to ref in ref's dtype's tolerance, relative to ref's largest magnitude."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    assert torch.isfinite(y).all()
    tol = TOL[ref.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


def check(qtypes, num_experts, hidden, inter, cases, dtype, seed: int = 0):
    """fused_experts_quantized equals the reference for each (tokens, top_k) of `cases`."""
    gate, up, down = quantized_experts(qtypes, num_experts, hidden, inter, seed)
    for tokens, top_k in cases:
        x = window(tokens, hidden, dtype, seed=tokens)
        experts, weights = routing(tokens, top_k, num_experts, dtype, seed=tokens + top_k)
        assert_matches(fused_experts_quantized(x, experts, weights, gate, up, down),
                       reference(x, experts, weights, gate, up, down))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_32_value_formats_equal_the_reference(qtype, dtype):
    """H = 64 (two blocks a row), I = 32 (one block: down's rows), 8 experts: one token
    at top-k 8 (summed on the CUDA cores), 5 tokens at top-k 2 and 32 at top-k 8
    (tl.dot: 16 and 32 rows a tile, every expert serving all 32 tokens)."""
    check((qtype,) * 3, 8, 64, 32, [(1, 8), (5, 2), (32, 8)], dtype)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qtype,tokens", [("Q4_K", 1), ("Q5_K", 5), ("Q6_K", 32)])
def test_k_quants_equal_the_reference(qtype, tokens, dtype):
    """H = I = 256 (one block a row; four column tiles of both kernels), top-k 2 of 4."""
    check((qtype,) * 3, 4, 256, 256, [(tokens, 2)], dtype, seed=tokens)


@torch.no_grad()
@pytest.mark.parametrize("qtypes,tokens,dtype", [
    (("Q4_K", "Q4_K", "Q6_K"), 3, torch.bfloat16),   # UD-Q4_K_XL's mix
    (("Q8_0", "Q5_K", "Q4_K"), 32, torch.float32),   # gate, up and down all different
])
def test_mixed_formats_equal_the_reference(qtypes, tokens, dtype):
    check(qtypes, 3, 256, 256, [(tokens, 2)], dtype, seed=7)


@torch.no_grad()
def test_decode_walks_gate_and_up_of_one_format_together():
    """Windows of up to ROW_TOKENS tokens: gate and up of one format walked in one loop,
    Q_UNROLL blocks a step (H = 512: two K-quant blocks a row, one step of two); down
    sums its blocks' products once after its walk. (Gate and up of two formats, each
    walked in turn: test_512_experts_at_top_k_10, 4 tokens.)"""
    qtypes = ("Q4_K", "Q4_K", "Q6_K")
    gate_up, _ = moe_triton.quantized_row_constants(qtypes, 512)
    assert gate_up["UNROLL"] == min(2, moe_triton.Q_UNROLL) == 2
    check(qtypes, 2, 512, 256, [(1, 1)], torch.bfloat16, seed=5)


@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 5])
def test_pairs_grouped_by_the_router_give_the_same_bits(tokens):
    """Given the pairs grouped already (`route`, as route_triton's route_window writes
    them), the row kernels (1 token) and the tl.dot ones (5) give what they give when
    they group the pairs themselves."""
    gate, up, down = quantized_experts(("Q4_K", "Q4_K", "Q6_K"), 8, 256, 256)
    x = window(tokens, 256, seed=tokens)
    experts, weights = routing(tokens, 3, 8, seed=tokens + 1)
    route = moe_triton._route(experts, 8)
    assert torch.equal(fused_experts_quantized(x, experts, weights, gate, up, down,
                                               route=route),
                       fused_experts_quantized(x, experts, weights, gate, up, down))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_512_experts_at_top_k_10(dtype):
    gate, up, down = quantized_experts(("Q8_0", "Q4_1", "Q4_0"), 512, 32, 32, seed=3)
    x = window(4, 32, dtype)
    experts, weights = routing(4, 10, 512, dtype, seed=3)
    experts[1, :3] = torch.tensor([511, 0, 256])  # both ends of the experts
    assert_matches(fused_experts_quantized(x, experts, weights, gate, up, down),
                   reference(x, experts, weights, gate, up, down))


@torch.no_grad()
@pytest.mark.parametrize("tokens,top_k", [(3, 8), (32, 3)])
def test_an_expert_named_more_often_than_a_tile_has_rows(tokens, top_k):
    """Given one expert 23 times in 3 tokens (a tile of 4 rows) or 95 times in 32 (32
    rows), its programs walk its pairs a tile at a time and the sum counts each pair."""
    gate, up, down = quantized_experts(("Q4_1", "Q8_0", "Q4_1"), 4, 64, 32, seed=4)
    x = window(tokens, 64)
    experts = torch.ones(tokens, top_k, dtype=torch.long)
    experts[0, 0] = 3
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(6))
    assert_matches(fused_experts_quantized(x, experts, weights, gate, up, down),
                   reference(x, experts, weights, gate, up, down))


@torch.no_grad()
def test_experts_that_no_token_routes_to_are_never_read():
    """NaN scales in every expert the window does not route to leave the output exactly
    as with clean blocks."""
    pairs = quantized_experts(("Q4_1", "Q4_0", "Q4_1"), 16, 64, 32, seed=5)
    x = window(3, 64)
    experts, weights = routing(3, 2, 16, seed=7)
    clean = fused_experts_quantized(x, experts, weights, *pairs)
    unused = torch.ones(16, dtype=torch.bool)
    unused[experts.reshape(-1)] = False
    assert unused.sum() >= 10
    nan = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    poisoned = []
    for blocks, qtype in pairs:
        blocks = blocks.clone()
        fmt = FORMATS[qtype]
        per_block = blocks.view(16, blocks.shape[1], -1, fmt.block_bytes)
        per_block[unused, :, :, 0:2] = nan
        poisoned.append((blocks, qtype))
    dirty = fused_experts_quantized(x, experts, weights, *poisoned)
    assert torch.isfinite(dirty).all()
    assert torch.equal(dirty, clean)
    assert_matches(clean, reference(x, experts, weights, *pairs))
    blocks, qtype = poisoned[0]  # the poison is there to be read
    assert dequantize(blocks[unused].reshape(-1, blocks.shape[2]), qtype).isnan().all()


def compile_offline(arch: int, qtypes: tuple[str, str, str], tokens: int, dtype,
                    hidden: int = 2048, inter: int = 768):
    """`_gate_up_q` and `_down_q` (their row versions up to ROW_TOKENS tokens) for a
    window of `tokens` tokens of `dtype` (Qwen3-30B-
    A3B's expert shape by default) as triton compiles them for an NVIDIA GPU of compute
    capability `arch` (no GPU needed), with the constants the launcher passes."""
    if tokens <= moe_triton.ROW_TOKENS:  # decode: the row kernels
        kernels = (moe_triton._gate_up_q_rows, moe_triton._down_q_rows)
        gate_up, down = moe_triton.quantized_row_constants(qtypes, hidden)
        gate_up |= moe_triton.UNCHOSEN
        down |= dict(PAIRWISE=False)
        launch = dict(num_warps=1)
    else:
        kernels = (moe_triton._gate_up_q, moe_triton._down_q)
        gate_up, down, launch = moe_triton.quantized_constants(tokens, dtype, qtypes, hidden,
                                                                  inter)

    def types(name: str) -> str:
        return ("*u8" if name in ("gate_ptr", "up_ptr", "down_ptr") else
                "*i32" if name in ("counts_ptr", "starts_ptr") else
                "*i64" if name in ("listed_ptr", "order_ptr", "rows_ptr") else
                "*fp32" if name in ("out_ptr", "logits_ptr") else
                "*" + TRITON_TYPES[dtype] if name.endswith("_ptr") else "i32")

    cached = dict(CACHED=tokens > 1)  # an expert cache's rows table (decode: none)
    return [compile_kernel(kernel, arch, constants | cached, types, launch)
            for kernel, constants in zip(kernels, (gate_up, down))]


COMPILED = [(("Q4_1", "Q4_1", "Q4_0"), 1, "bfloat16"),
            (("Q4_K", "Q4_K", "Q6_K"), 1, "bfloat16"),
            (("Q4_K", "Q5_K", "Q6_K"), 2, "bfloat16"),
            (("Q4_K", "Q5_K", "Q6_K"), 32, "bfloat16"),
            (("Q8_0", "Q4_K", "Q6_K"), 8, "float32")]


def test_the_kernels_compile_for_rtx3090_and_h200(tmp_path):
    """The interpreter runs what the GPU compiler may reject (types, layouts, shared
    memory): compile both kernels for decode windows (the row kernels) of 32-value formats
    and UD-Q4_K_XL's mix, and tl.dot windows of K-quants and mixed formats, for SM86 and SM90, without
    a GPU. In a fresh process, since the compiler cannot run where the interpreter is
    chosen."""
    code = ("import torch; from test_moe_triton_quant import COMPILED, compile_offline\n"
            "print(*[k.metadata.shared for q, t, d in COMPILED\n"
            "        for k in compile_offline(arch, q, t, getattr(torch, d))])")
    shared = offline_compiled(code, tmp_path)
    assert len(shared) == 2 * 2 * len(COMPILED)
    assert max(shared) <= SM86_SHARED


def test_bad_inputs_are_clear_errors():
    gate, up, down = quantized_experts(("Q4_0", "Q4_0", "Q4_0"), 4, 64, 32)
    x = torch.zeros(2, 64)
    experts, weights = routing(2, 2, 4)

    def call(x=x, experts=experts, weights=weights, gate=gate, up=up, down=down):
        return fused_experts_quantized(x, experts, weights, gate, up, down)

    for tokens in (0, 33):
        with pytest.raises(ValueError, match=f"fused_experts_quantized takes 1 to 32 "
                                             f"tokens, not {tokens}"):
            call(torch.zeros(tokens, 64), torch.zeros(tokens, 2, dtype=torch.long),
                 torch.zeros(tokens, 2))
    with pytest.raises(ValueError, match="x must be a 2-D float32, bfloat16 or float16"):
        call(x.double())
    with pytest.raises(ValueError, match=r"experts must be an int64 or int32 tensor \[2, "):
        call(experts=experts.float())
    with pytest.raises(ValueError, match="top-k of 1 to 10, not 11"):
        call(experts=torch.zeros(2, 11, dtype=torch.long), weights=torch.zeros(2, 11))
    with pytest.raises(ValueError, match="weights must be a floating tensor"):
        call(weights=weights[:, :1])
    with pytest.raises(ValueError, match=r"gate must be a pair \(blocks, qtype\), not Tensor"):
        call(gate=gate[0])
    with pytest.raises(ValueError, match=r"down must be a pair \(blocks, qtype\)"):
        call(down=(down[0], down[1], None))
    with pytest.raises(ValueError, match="up: unsupported quantization type 'Q2_K'; "
                                         "supported: Q8_0, .*Q6_K"):
        call(up=(up[0], "Q2_K"))
    with pytest.raises(ValueError, match="gate blocks must be a 3-D uint8 tensor"):
        call(gate=(gate[0].to(torch.int8), "Q4_0"))
    with pytest.raises(ValueError, match="gate blocks must be a 3-D uint8 tensor"):
        call(gate=(gate[0][0], "Q4_0"))
    with pytest.raises(ValueError, match=r"up \(Q4_0\): a row of 30 bytes is not a whole "
                                         "number of 18-byte blocks"):
        call(up=(up[0][..., :30], "Q4_0"))
    with pytest.raises(ValueError, match="down blocks must be contiguous along a row"):
        call(down=(down[0].transpose(1, 2).contiguous().transpose(1, 2), "Q4_0"))
    with pytest.raises(ValueError, match=r"x is on meta but gate on cpu"):
        call(x.to("meta"), experts.to("meta"), weights.to("meta"))
    with pytest.raises(ValueError, match="gate's rows hold 64 values but the hidden size "
                                         "is 96"):
        call(torch.zeros(2, 96), down=(torch.zeros(4, 96, 18, dtype=torch.uint8), "Q4_0"))
    # The K-quants' blocks hold 256 values: H = 64 and I = 32 are no whole blocks.
    with pytest.raises(ValueError, match="gate is Q4_K, whose blocks hold 256 values: the "
                                         r"hidden size \(64\) must be a multiple of 256"):
        call(gate=(torch.zeros(4, 32, 144, dtype=torch.uint8), "Q4_K"))
    with pytest.raises(ValueError, match="down is Q6_K, whose blocks hold 256 values: the "
                                         r"intermediate size \(32\) must be a multiple of "
                                         "256"):
        call(down=(torch.zeros(4, 64, 210, dtype=torch.uint8), "Q6_K"))
    with pytest.raises(ValueError, match=r"down's rows hold 64 values but the intermediate "
                                         "size is 32"):
        call(down=(torch.zeros(4, 64, 36, dtype=torch.uint8), "Q4_0"))
    with pytest.raises(ValueError, match=r"gate and up must hold \[experts, intermediate\] "
                                         r"rows alike, not \(4, 32\) and \(4, 16\)"):
        call(up=(up[0][:, :16], "Q4_0"))
    with pytest.raises(ValueError, match=r"down must hold \[4, 64\] rows, not \(3, 64\)"):
        call(down=(down[0][:3], "Q4_0"))
    with pytest.raises(ValueError, match="at least one expert"):
        call(gate=(gate[0][:, :0], "Q4_0"), up=(up[0][:, :0], "Q4_0"))
