"""strata/layers/gemv_triton.py (dense projections of 1-4 token windows as one Triton GEMV;
in triton's interpreter here, see conftest.py) against F.linear: row lengths that do and
do not fill its column steps, biases, strided inputs; the shapes it takes by default;
whole engines give the same tokens with it; it compiles for SM86 and SM90 without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_TYPES, build_tiny, compile_kernel, offline_compiled, prompts

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.layers.linear import Linear, ParamSpec
from strata.sampling.params import SamplingParams

pytest.importorskip("triton")


def operands(tokens: int, rows: int, cols: int, dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # x a view with a row stride past its length (as a slice of a wider activation)
    x = torch.randn(tokens, cols + 8, generator=g)[:, :cols].to(dtype)
    w = (torch.randn(rows, cols, generator=g) / cols ** 0.5).to(dtype)
    b = torch.randn(rows, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(37, 576), (64, 2048), (9, 4500), (130, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_gemv_equals_the_matmul(dtype, rows, cols, bias):
    """4500 columns: three steps of 2048 (or 36 of 128), the last masked; 37, 9 and 130
    rows: a program's rows past the weight's end; every window size of the GEMV (1-4) and
    some of the GEMM (5, 16, 37, 64: tiles of 16, 16, 64, 64 tokens), the GEMM's columns
    in the splits its shape gets and in 3 (70 columns: two splits without a step)."""
    from strata.layers import gemv_triton
    for tokens, splits in ((1, None), (2, None), (3, None), (4, None), (5, None), (5, 3),
                           (16, 3), (37, None), (64, 3)):
        x, w, b = operands(tokens, rows, cols, dtype, bias, seed=tokens)
        ours = gemv_triton.gemv(x, w, b, splits=splits)
        assert ours.shape == (tokens, rows) and ours.dtype == dtype
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        # float32 sums rounded once to the dtype: within a step or two of it (triton's
        # interpreter truncates float32 to bf16 where a GPU rounds to nearest)
        step = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        torch.testing.assert_close(ours.double(), exact, rtol=step, atol=step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_gemv_equals_silu_mul_then_the_matmul(dtype):
    """A gated MLP's down projection: x is [T, 2K], gate and up, multiplied as
    silu(gate) * up, rounded where fused.silu_mul rounds."""
    from strata.layers import gemv_triton
    from strata.layers.fused import silu_mul
    for tokens, splits in ((1, None), (3, None), (9, 1), (9, 4), (16, 5)):
        gate_up, w, _ = operands(tokens, 24, 2 * 1536, dtype, False, seed=tokens)
        w = w[:, :1536].contiguous()
        ours = gemv_triton.gemv(gate_up, w, gated=True, splits=splits)
        ref = F.linear(silu_mul(gate_up).double(), w.double())
        step = 1e-5 if dtype == torch.float32 else 3.2e-2  # bf16: roundings twice truncated
        torch.testing.assert_close(ours.double(), ref, rtol=step, atol=step)


def test_split_gemm_sets_its_counters_back():
    """A split GEMM's last program per row tile adds the partials up in split order and
    sets the tile's counter back to 0, so a CUDA graph's next replay counts from 0: the
    same y, bit for bit, with every counter 0 after each launch. Only a gated input's
    walk is split by default (the default model's down projection: 6 splits)."""
    from strata.layers import gemv_triton
    from strata.layers.counters import arrival_counters
    from strata.layers.fused import silu_mul
    assert gemv_triton.gemm_splits(576, 1536, gated=True) == 6
    assert gemv_triton.gemm_splits(576, 1536) == 1      # a plain walk: never split
    assert gemv_triton.gemm_splits(4096, 1536, gated=True) == 1  # 256 row tiles
    assert gemv_triton.gemm_splits(40, 200, gated=True) == 1     # two steps of columns
    gate_up, w, _ = operands(6, 40, 2 * 1536, torch.float32, False, seed=3)
    w = w[:, :1536].contiguous()
    assert gemv_triton.gemm_splits(40, 1536, gated=True) == 6
    counters = arrival_counters(gate_up.device)
    first = gemv_triton.gemv(gate_up, w, gated=True)
    assert not counters.any()
    assert torch.equal(gemv_triton.gemv(gate_up, w, gated=True), first)
    assert not counters.any()
    torch.testing.assert_close(first, F.linear(silu_mul(gate_up), w), rtol=1e-5, atol=1e-5)


def test_it_refuses_what_it_cannot_compute():
    from strata.layers import gemv_triton
    x, w, _ = operands(65, 8, 64, torch.float32, False)
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        gemv_triton.gemv(x, w)
    with pytest.raises(ValueError, match="weight's dtype"):
        gemv_triton.gemv(x[:2], w.to(torch.bfloat16))
    assert not gemv_triton.fits(x[:2].to(torch.int32), w.to(torch.int32))


@pytest.mark.parametrize("tokens,rows,cols,takes", [
    (1, 5120, 2048, True),     # a 30B MoE's qkv
    (2, 2048, 4096, True),     # its o_proj
    (1, 151936, 2048, True),   # its lm_head
    (1, 49152, 576, False),    # the default model's lm_head: cuBLAS was faster
    (2, 960, 576, True),       # the default model's qkv ...
    (4, 960, 576, True),       # ... with drafts too: a small weight
    (36, 3072, 576, True),     # ... 4 slots with 8 drafts each: the GEMM
    (16, 576, 1536, False),    # ... but for rows longer than the sweep's (its down_proj,
                               # which takes the GEMM gated: below)
    (4, 5120, 2048, False),    # 4 tokens of a large weight: cuBLAS
    (16, 5120, 2048, False),
    (65, 960, 576, False),     # past MAX_TOKENS
])
def test_it_takes_the_shapes_where_it_was_faster(tokens, rows, cols, takes):
    from strata.layers import gemv_triton
    x = torch.empty(tokens, cols, dtype=torch.bfloat16, device="meta")
    w = torch.empty(rows, cols, dtype=torch.bfloat16, device="meta")
    assert gemv_triton.takes(x, w) == takes
    assert not gemv_triton.takes(x.float(), w.float())  # float32: cuBLAS by default
    gate_up = torch.empty(tokens, 2 * cols, dtype=torch.bfloat16, device="meta")
    # a gated input: the GEMV's 1-4 tokens as a plain one's; the GEMM's 5-16 (split) on
    # weights of up to 2^21 values, rows of any length
    gated = takes and tokens <= 4 or 4 < tokens <= 16 and rows * cols <= 1 << 21
    assert gemv_triton.takes(gate_up, w, gated=True) == gated


def test_linear_runs_it_where_its_path_says(monkeypatch):
    from strata.layers import gemv_triton
    linear = Linear(64, 24, True, ParamSpec())
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 64))
        linear.bias.copy_(torch.randn(24))
    x = torch.randn(3, 64)
    ref = F.linear(x, linear.weight, linear.bias)
    called = []
    real = gemv_triton.gemv
    monkeypatch.setattr(gemv_triton, "gemv", lambda *a: called.append(a[0].shape[0]) or real(*a))
    torch.testing.assert_close(linear(x), ref)  # "auto" on CPU tensors: F.linear
    monkeypatch.setattr(Linear, "path", "triton")
    torch.testing.assert_close(linear(x), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(torch.randn(70, 64)).shape, (70, 24))  # a prompt: F.linear
    assert called == [3]


def test_engines_give_the_same_tokens_with_it(tmp_path, monkeypatch):
    """A tiny llama with q/k/v biases (PyTorch attention), two requests at a time
    with up to 3 drafts: windows of 1-8 tokens go through the kernels (every projection,
    the MLP's down projection gated, and the lm_head), prompts do not."""
    from strata.layers import gemv_triton
    folder = tmp_path / "llama"
    model = build_tiny("llama", folder, attention_bias=True, num_hidden_layers=2)
    batch = prompts(2, model.config.vocab_size, seed=7, low=5, high=30)
    batch[0] = batch[0][:5] * 4  # repeats: the lookup proposer drafts
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(folder), attention_backend="reference", parallel=2,
                                 spec=3, max_context=96, max_window_tokens=48))
    monkeypatch.setattr(Linear, "path", "torch")
    ref = engine.generate(batch, params)
    called = []
    real = gemv_triton.gemv
    monkeypatch.setattr(gemv_triton, "gemv", lambda x, w, b=None, gated=False: called.append(
        "gated" if gated else "gemm" if x.shape[0] > 4 else b is not None) or real(x, w, b, gated))
    monkeypatch.setattr(Linear, "path", "triton")
    assert engine.generate(batch, params) == ref
    # biased q/k/v, unbiased o, gate_up and lm_head, the gated down projection; windows
    # of 5-8 tokens
    assert set(called) == {True, False, "gated", "gemm"}


def _compile(arch: int, dtype, tokens: int, cols: int) -> int:
    from strata.layers import gemv_triton

    def types(name: str) -> str:
        if name in ("partial_ptr", "count_ptr"):
            return "*fp32" if name == "partial_ptr" else "*i32"
        return "*" + TRITON_TYPES[dtype] if name.endswith("_ptr") else "i32"

    if tokens > gemv_triton.ROW_TOKENS:
        kernel = compile_kernel(gemv_triton._gemm, arch, dict(
            BLOCK_M=max(16, triton_next_power_of_2(tokens)), BLOCK_N=gemv_triton.GEMM_ROWS,
            BLOCK_K=gemv_triton.GEMM_COLS, HAS_BIAS=True, GATED=cols == 576, DOT_FP32=False,
            SPLIT=tokens == 36), types, dict(num_warps=4, num_stages=3))
    else:
        kernel = compile_kernel(gemv_triton._gemv, arch, dict(
            TOKENS=tokens, T_PAD=triton_next_power_of_2(tokens), HAS_BIAS=True,
            GATED=cols == 576, EARLY=tokens == 1, **gemv_triton.constants(cols)), types,
            dict(num_warps=4, num_stages=3))
    return kernel.metadata.shared


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_the_kernel_compiles_for_rtx3090_and_h200(tmp_path):
    code = ("import torch; from test_gemv_triton import _compile\n"
            "print(*[_compile(arch, t, n, c) for t in (torch.bfloat16, torch.float16)"
            " for n in (1, 4, 36, 64) for c in (576, 4096)])")
    assert len(offline_compiled(code, tmp_path)) == 32


def test_layer_kernels_choose_the_paths_of_a_cuda_stages_process(monkeypatch):
    """--layer-kernels torch sends a CUDA stage's norms and projections to PyTorch, triton
    back to "auto"; a CPU stage leaves them as they are."""
    from strata.layers import l2_prefetch, pdl
    from strata.layers.norm import RMSNorm
    from strata.stage.stage import choose_kernels
    for name, cls in (("path", Linear), ("path", RMSNorm), ("enabled", pdl),
                      ("enabled", l2_prefetch)):
        monkeypatch.setattr(cls, name, getattr(cls, name))
    choose_kernels(torch.device("cuda"), False, "torch", False)
    assert Linear.path == RMSNorm.path == "torch" and not pdl.enabled
    assert not l2_prefetch.enabled
    choose_kernels(torch.device("cpu"), True, "triton", True)
    assert Linear.path == RMSNorm.path == "torch" and not pdl.enabled
    assert not l2_prefetch.enabled
    choose_kernels(torch.device("cuda"), True, "triton", True)
    assert Linear.path == RMSNorm.path == "auto" and pdl.enabled and l2_prefetch.enabled
