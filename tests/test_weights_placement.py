"""Weights kept as their specs say: the LinearFactory makes projections in the stage's
weight format (a router may pin float32), the loader materialises each parameter of a
meta-device module on its device in its dtype, checks shapes against the config, and
GGUF tensors stay raw blocks with their type until a parameter asks for values. Stacked
projections (`qkv_proj`, `gate_up_proj`) are their checkpoint parts' rows one after the
other, each part read as before (GGUF row order included); a missing part is named."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY, build_tiny
from torch import nn

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.layers.linear import Linear, LinearFactory, WeightFormat, spec_of
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding
from strata.models.llama import unpermuted_rotary_rows
from strata.models.registry import get_architecture
from strata.quant import FORMATS
from strata.weights.checkpoint import open_checkpoint
from strata.weights.hf_checkpoint import HFCheckpoint
from strata.weights.loader import load_module, read_checked
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


class Wide(nn.Module):
    def __init__(self, linear: LinearFactory):
        super().__init__()
        self.proj = linear(64, 4, bias=True)
        self.router = linear(64, 3, dtype=torch.float32)
        self.fused = linear.stacked(64, {"gate_proj": 4, "up_proj": 2})
        self.mixed = linear.stacked(64, {"q_proj": 2, "k_proj": 2})


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_quantized_stage_keeps_projections_in_their_blocks(kind):
    """Projections stored in a supported format stay its raw blocks (stacked parts of one
    format too); a pinned router, biases and parts of different formats are dense; the
    projection computes with the dequantized weight."""
    w = {n: torch.randn(rows, 64, generator=GEN) for n, rows in
         (("proj", 4), ("gate_proj", 4), ("up_proj", 2), ("q_proj", 2), ("k_proj", 2))}
    tensors = {f"{n}.weight": quantized(v, kind) for n, v in w.items()}
    tensors["k_proj.weight"] = quantized(w["k_proj"], "Q8_0" if kind != "Q8_0" else "Q4_0")
    tensors |= {"proj.bias": StoredTensor.of(torch.randn(4, generator=GEN)),
                "router.weight": StoredTensor.of(torch.randn(3, 64, generator=GEN))}
    with torch.device("meta"):
        block = Wide(LinearFactory(WeightFormat(torch.float32, quantized=True)))
    stats = load_module(block, FakeCheckpoint(tensors), get_architecture(_llama_config()),
                        device=torch.device("cpu"), dtype=torch.float32)
    fmt = FORMATS[kind]
    assert block.proj.weight.dtype == torch.uint8 and block.proj.weight.qtype == kind
    assert block.proj.weight.shape == (4, fmt.row_bytes(64))
    assert block.fused.weight.dtype == torch.uint8 and block.fused.weight.shape[0] == 6
    assert block.mixed.weight.dtype == torch.float32  # q and k differ: dense
    assert block.router.weight.dtype == block.proj.bias.dtype == torch.float32
    assert stats.quantized == {kind: 2} and "2 weights" in stats.describe()
    x = torch.randn(3, 64, generator=GEN)
    dense = {n: t.dense(torch.float32) for n, t in tensors.items()}
    torch.testing.assert_close(block.proj(x), x @ dense["proj.weight"].T + dense["proj.bias"],
                               rtol=1e-4, atol=1e-4)
    fused = torch.cat([dense["gate_proj.weight"], dense["up_proj.weight"]])
    torch.testing.assert_close(block.fused(x), x @ fused.T, rtol=1e-4, atol=1e-4)
    with torch.device("meta"):
        plain = Wide(LinearFactory(WeightFormat(torch.float32)))
    stats = load_module(plain, FakeCheckpoint(tensors), get_architecture(_llama_config()),
                        device=torch.device("cpu"), dtype=torch.float32)
    assert {p.dtype for p in plain.parameters()} == {torch.float32} and not stats.quantized
    assert stats.describe().startswith("no weight stays quantized")


def test_engine_weights_follow_dtype(tiny_models):
    folder, _ = tiny_models["qwen3_moe"]
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        engine = Engine(EngineConfig(model=str(folder), dtype=name, spec=0, max_context=64))
        module = engine.runner.stages[0].module
        assert {p.dtype for p in module.parameters()} == {dtype}
        assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        assert all(isinstance(m.qkv_proj, Linear) for m in module.modules()
                   if hasattr(m, "qkv_proj"))


def _llama_config():
    from strata.models.config import ModelConfig
    return ModelConfig(architecture="llama", vocab_size=16, hidden_size=8,
                       intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                       head_dim=4)


def _load_layer(checkpoint, layer: int) -> nn.Module:
    """Decoder layer `layer` of `checkpoint`, loaded in float32 on the CPU."""
    c = checkpoint.config
    arch = get_architecture(c)
    with torch.device("meta"):
        module = arch.make_layer(layer, RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta))
    load_module(module, checkpoint, arch, device=torch.device("cpu"), dtype=torch.float32,
                checkpoint_name=lambda name: f"model.layers.{layer}.{name}")
    return module


def test_stacked_projections_are_their_parts_rows(tmp_path):
    model = build_tiny("llama", tmp_path, attention_bias=True)
    ours = _load_layer(HFCheckpoint(tmp_path), 1)
    ref = model.model.layers[1]
    attn, mlp = ref.self_attn, ref.mlp
    assert torch.equal(ours.self_attn.qkv_proj.weight, torch.cat(
        [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(ours.self_attn.qkv_proj.bias, torch.cat(
        [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert torch.equal(ours.mlp.gate_up_proj.weight,
                       torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert not hasattr(ours.self_attn, "q_proj") and not hasattr(ours.mlp, "up_proj")


def test_stacked_projections_of_the_default_gguf_keep_blocks_and_row_order(gguf_path):
    checkpoint = open_checkpoint(gguf_path)
    c = checkpoint.config
    ours = _load_layer(checkpoint, 2)

    def stored(name: str, order: torch.Tensor | None = None) -> torch.Tensor:
        values = checkpoint.read(f"model.layers.2.{name}.weight").dense(torch.float32)
        return values if order is None else values[order]

    # llama.cpp's converter permuted q and k rows; v, gate and up are as the model has them.
    assert torch.equal(ours.self_attn.qkv_proj.weight, torch.cat([
        stored("self_attn.q_proj", unpermuted_rotary_rows(c.num_heads, c.head_dim)),
        stored("self_attn.k_proj", unpermuted_rotary_rows(c.num_kv_heads, c.head_dim)),
        stored("self_attn.v_proj")]))
    assert torch.equal(ours.mlp.gate_up_proj.weight,
                       torch.cat([stored("mlp.gate_proj"), stored("mlp.up_proj")]))
    param = ours.mlp.gate_up_proj.weight
    raw = read_checked(get_architecture(c), checkpoint, "model.layers.2.mlp.gate_up_proj.weight",
                       param.shape, spec_of(param))
    assert raw.type == "Q4_1" and not raw.is_torch  # blocks concatenated, not dequantized


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


def _changed(folder, out, change: dict) -> HFCheckpoint:
    """A copy of the checkpoint in `folder` (one safetensors file) in `out`, with the
    tensors in `change` replaced, or removed where None."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = {**load_file(folder / "model.safetensors"), **change}
    out.mkdir()
    shutil.copy(folder / "config.json", out / "config.json")
    save_file({name: t for name, t in tensors.items() if t is not None},
              str(out / "model.safetensors"))
    return HFCheckpoint(out)


def test_a_missing_or_misshapen_part_is_named(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    missing = _changed(folder, tmp_path / "a", {"model.layers.0.self_attn.v_proj.weight": None})
    with pytest.raises(StrataError, match=r"has no tensor 'model\.layers\.0\.self_attn\."
                                          r"v_proj\.weight'"):
        _load_layer(missing, 0)
    short = _changed(folder, tmp_path / "b", {"model.layers.0.mlp.up_proj.weight":
                                              torch.zeros(95, 64)})
    with pytest.raises(StrataError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has "
                                          r"shape \(95, 64\) but the model config implies "
                                          r"\(96, 64\)"):
        _load_layer(short, 0)


def test_random_checkpoint_fills_stacked_projections(tmp_path):
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"]}))
    engine = Engine(EngineConfig(model=f"random:{config}", spec=0, max_context=64))
    layer = engine.runner.stages[0].module.model.layers["0"]
    assert layer.self_attn.qkv_proj.weight.shape == (64 + 2 * 32, 64)
    assert layer.mlp.gate_up_proj.weight.std() > 0.01
    assert engine.score([1, 2, 3]).isfinite().all()


def test_random_weights_are_the_same_in_every_process():
    """A random-weight model is drawn from seeds per parameter name that do not depend on
    the process (Python's str hash does: PYTHONHASHSEED)."""
    import os
    import subprocess
    import sys
    code = ("import torch; from strata.weights.random_checkpoint import RandomCheckpoint; "
            "p = torch.empty(64); RandomCheckpoint('smollm2-135m').fill("
            "'model.layers.3.mlp.up_proj.weight', p); print(p.tolist())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1
