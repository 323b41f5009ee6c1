"""Weights kept as their specs say: the LinearFactory makes projections in the stage's
weight format (a router may pin float32), the loader materialises each parameter of a
meta-device module on its device in its dtype, checks shapes against the config, and
GGUF tensors stay raw blocks with their type until a parameter asks for values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.layers.linear import Linear, LinearFactory, WeightFormat, spec_of
from strata.layers.norm import RMSNorm
from strata.models.registry import get_architecture
from strata.weights.loader import load_module
from strata.weights.tensor import StoredTensor

GEN = torch.Generator().manual_seed(0)


class FakeCheckpoint:
    format, path = "hf", "fake"

    def __init__(self, tensors: dict[str, StoredTensor]):
        self.tensors = tensors

    def has(self, name):
        return name in self.tensors

    def read(self, name):
        return self.tensors[name]


class Block(nn.Module):
    def __init__(self, linear: LinearFactory):
        super().__init__()
        self.proj = linear(8, 4, bias=True)
        self.router = linear(8, 3, dtype=torch.float32)
        self.norm = RMSNorm(8, 1e-5)


def quantized(values: torch.Tensor, kind: str) -> StoredTensor:
    raw = gguf.quants.quantize(values.numpy(), gguf.GGMLQuantizationType[kind])
    return StoredTensor(tuple(values.shape), kind, raw)


def test_factory_makes_projections_in_the_stage_format():
    bf16 = LinearFactory(WeightFormat(torch.bfloat16))
    assert isinstance(bf16(8, 4), Linear)
    assert spec_of(bf16(8, 4).weight).dtype == torch.bfloat16
    assert spec_of(bf16(8, 4, dtype=torch.float32).weight).dtype == torch.float32
    assert spec_of(LinearFactory()(8, 4).weight).dtype is None  # the stage's dtype
    stacked = bf16.stacked(8, {"gate_proj": 4, "up_proj": 4})
    assert stacked.weight.shape == (8, 8) and stacked.bias is None
    assert spec_of(stacked.weight).dtype == torch.bfloat16
    assert spec_of(stacked.weight).parts == (("gate_proj", 4), ("up_proj", 4))


@pytest.mark.parametrize("stage_dtype", [torch.bfloat16, torch.float32])
def test_each_parameter_is_placed_as_its_spec_says(stage_dtype):
    tensors = {"proj.weight": torch.randn(4, 8, generator=GEN),
               "proj.bias": torch.randn(4, generator=GEN),
               "router.weight": torch.randn(3, 8, generator=GEN),
               "norm.weight": torch.randn(8, generator=GEN)}
    with torch.device("meta"):
        block = Block(LinearFactory(WeightFormat(stage_dtype)))
    load_module(block, FakeCheckpoint({k: StoredTensor.of(v) for k, v in tensors.items()}),
                get_architecture(_llama_config()), device=torch.device("cpu"),
                dtype=stage_dtype)
    params = dict(block.named_parameters())
    assert {name: p.dtype for name, p in params.items()} == {
        "proj.weight": stage_dtype, "proj.bias": stage_dtype,
        "router.weight": torch.float32, "norm.weight": stage_dtype}
    assert all(p.device.type == "cpu" and not p.requires_grad for p in params.values())
    assert torch.equal(block.router.weight, tensors["router.weight"])  # not rounded to bf16
    assert torch.equal(block.proj.weight, tensors["proj.weight"].to(stage_dtype))
    assert spec_of(block.router.weight).dtype == torch.float32  # kept on the loaded parameter
    out = block.proj(torch.ones(2, 8, dtype=stage_dtype))
    assert out.shape == (2, 4)


def test_quantized_blocks_are_dequantized_only_for_the_parameter():
    values = torch.randn(4, 64, generator=GEN)
    stored = quantized(values, "Q8_0")
    assert stored.shape == (4, 64) and stored.type == "Q8_0" and not stored.is_torch
    assert stored.data.dtype == np.uint8 and stored.data.shape == (4, 68)  # 2 blocks of 34 B
    expected = torch.from_numpy(gguf.quants.dequantize(stored.data,
                                                       gguf.GGMLQuantizationType.Q8_0))
    assert torch.equal(stored.dense(torch.float32), expected)
    assert (stored.dense(torch.float32) - values).abs().max() < 0.05
    order = torch.tensor([2, 0, 3, 1])
    rows = stored.take_rows(order)  # raw rows reordered, still Q8_0
    assert rows.type == "Q8_0" and torch.equal(rows.dense(torch.float32), expected[order])
    with torch.device("meta"):
        block = Block(LinearFactory(WeightFormat(torch.float32)))
    tensors = {"proj.weight": quantized(torch.randn(4, 32, generator=GEN), "Q8_0"),
               "proj.bias": StoredTensor.of(torch.zeros(4)),
               "router.weight": StoredTensor.of(torch.zeros(3, 8)),
               "norm.weight": StoredTensor.of(torch.ones(8))}
    with pytest.raises(StrataError, match=r"'proj.weight' has shape \(4, 32\) but the model "
                                          r"config implies \(4, 8\)"):
        load_module(block, FakeCheckpoint(tensors), get_architecture(_llama_config()),
                    device=torch.device("cpu"), dtype=torch.float32)


def test_engine_weights_follow_dtype(tiny_models):
    folder, _ = tiny_models["qwen3_moe"]
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        engine = Engine(EngineConfig(model=str(folder), dtype=name, spec=0, max_context=64))
        module = engine.runner.stages[0].module
        assert {p.dtype for p in module.parameters()} == {dtype}
        assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        assert all(isinstance(m.q_proj, Linear) for m in module.modules()
                   if hasattr(m, "q_proj"))


def _llama_config():
    from strata.models.config import ModelConfig
    return ModelConfig(architecture="llama", vocab_size=16, hidden_size=8,
                       intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                       head_dim=4)


def test_rows_of_mixed_types_stack_as_values():
    q8, q4 = (quantized(torch.randn(rows, 32, generator=GEN), kind)
              for rows, kind in ((4, "Q8_0"), (2, "Q4_0")))
    stacked = StoredTensor.cat_rows([q8, q4])
    assert stacked.shape == (6, 32)
    assert torch.equal(stacked.dense(torch.float32),
                       torch.cat([q8.dense(torch.float32), q4.dense(torch.float32)]))
    same = StoredTensor.cat_rows([q8, q8])
    assert same.type == "Q8_0" and same.shape == (8, 32)
    assert torch.equal(same.dense(torch.float32), q8.dense(torch.float32).repeat(2, 1))
