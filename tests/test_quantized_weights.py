"""--quantized-weights: the default GGUF's projections kept in their Q4_1/Q8_0 blocks on the
CPU (the PyTorch reference dequantizes per window, as the Triton kernels do inside theirs
on CUDA) give the same greedy tokens as weights dequantized at load, with and without
drafts; the setting resolves per stage."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
from conftest import prompts

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.sampling.params import SamplingParams
from strata.quant import FORMATS, reference
from strata.weights.checkpoint import open_checkpoint
from strata.weights.experts import STACKED, stacked_experts
from strata.weights.hf_checkpoint import HFCheckpoint
from strata.weights.random_checkpoint import RandomCheckpoint
from strata.weights.tensor import StoredTensor

PROMPTS = [[1, 504, 3457, 282, 4649, 314], [1, 2683, 16909, 30]]


def test_default_model_kept_quantized_gives_the_same_tokens(gguf_path, default_checkpoint,
                                                            caplog):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    config = EngineConfig(model=str(gguf_path), spec=0, max_context=128, parallel=2,
                          quantized_weights="off")
    dense = Engine(config, default_checkpoint).generate(PROMPTS, greedy)
    caplog.set_level("INFO", logger="strata.engine")
    blocks = open_checkpoint(str(gguf_path))  # NOTE: the shared fixture's are dequantized
    quantized = Engine(EngineConfig(**{**config.__dict__, "quantized_weights": "on"}), blocks)
    module = quantized.runner.stages[0].module
    kept = {getattr(p, "qtype", None) for p in module.parameters() if p.dtype == torch.uint8}
    assert kept == {"Q4_1", "Q8_0"}  # the projections, and lm_head tied to the embedding
    assert module.model.embed_tokens.weight.dtype == torch.float32
    assert "121 weights (120 Q4_1, 1 Q8_0) stay quantized" in caplog.text  # q, k, v as one
    assert quantized.runner.stages[0].weights.quantized == {"Q4_1": 120, "Q8_0": 1}
    assert quantized.generate(PROMPTS, greedy) == dense
    drafted = Engine(EngineConfig(**{**config.__dict__, "quantized_weights": "on", "spec": 4,
                                     "spec_type": ("lookup",)}), blocks)
    assert drafted.generate(PROMPTS, greedy) == dense
    assert drafted.draft_stats.drafted > 0


def test_the_setting_resolves_per_stage(monkeypatch):
    assert not EngineConfig().keeps_quantized(0)  # off by default, on every device
    assert not EngineConfig(devices=("cuda:0",)).keeps_quantized(0)
    assert EngineConfig(quantized_weights="on").keeps_quantized(0)
    assert EngineConfig(devices=("cuda:0", "cuda:1"), layer_split=(4,),
                        quantized_weights="on").keeps_quantized(1)
    with pytest.raises(StrataError, match="--quantized-weights"):
        EngineConfig(quantized_weights="sometimes")
    import strata.quant
    monkeypatch.setattr(strata.quant, "triton_available", lambda: False)
    assert EngineConfig(quantized_weights="on").keeps_quantized(0)  # the CPU: the reference
    with pytest.raises(StrataError, match="needs the triton package on CUDA stages"):
        EngineConfig(devices=("cuda:0",), quantized_weights="on").keeps_quantized(0)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_random_quantized_checkpoints_spread_like_the_dense_ones(qtype):
    checkpoint = RandomCheckpoint(f"qwen3-30b-a3b:{qtype.lower()}")
    blocks = checkpoint.blocks("model.layers.0.self_attn.o_proj.weight", (64, 512),
                               torch.device("cpu"))
    assert blocks.dtype == torch.uint8 and blocks.shape == (64, FORMATS[qtype].row_bytes(512))
    values = reference.dequantize(blocks, qtype)
    assert values.isfinite().all() and 0.005 < values.std() < 0.08
    assert values.mean().abs() < 0.02
    again = checkpoint.blocks("model.layers.0.self_attn.o_proj.weight", (64, 512),
                              torch.device("cpu"))
    assert torch.equal(blocks, again)  # the same model in every process
    assert checkpoint.blocks("x", (64, 576 + FORMATS[qtype].block_values // 2),
                             torch.device("cpu")) is None  # rows not whole blocks: dense
    experts = checkpoint.blocks("model.layers.0.mlp.experts.down_proj", (3, 8, 512),
                                torch.device("cpu"))  # stacked experts
    assert experts.shape == (3, 8, FORMATS[qtype].row_bytes(512))
    assert reference.dequantize(experts[2], qtype).isfinite().all()
    assert checkpoint.blocks("model.layers.0.mlp.gate.weight", (128, 512),
                             torch.device("cpu")) is None  # routers stay dense, as in GGUFs


def test_a_random_quantized_model_runs_with_its_projections_in_blocks():
    engine = Engine(EngineConfig(model="random:smollm2-135m:q8_0", quantized_weights="on",
                                 spec=0, max_context=64))
    kept = [p for p in engine.runner.stages[0].module.parameters() if p.dtype == torch.uint8]
    assert len(kept) == 121 and {p.qtype for p in kept} == {"Q8_0"}
    [out] = engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4,
                                                           ignore_eos=True))
    assert len(out) == 4
    with pytest.raises(StrataError, match="q3_k is not a block format"):
        RandomCheckpoint("smollm2-135m:q3_k")


class Quantizing:
    """A Hugging Face checkpoint whose projections and stacked experts read as Q8_0
    blocks, as a GGUF file stores them (its other tensors as they are)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def has(self, name):
        return name.endswith(STACKED) or self.inner.has(name)

    def read(self, name):
        if name.endswith(STACKED):
            dense = stacked_experts(name, self.inner, self.inner.config.num_experts).data
        else:
            dense = self.inner.read(name).data
            if not (name.endswith("proj.weight") and dense.dim() == 2):
                return StoredTensor.of(dense)
        raw = gguf.quants.quantize(dense.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
        return StoredTensor(tuple(dense.shape), "Q8_0", raw)


def test_moe_experts_kept_quantized_give_the_same_tokens(tiny_models):
    """Tiny qwen3_moe with every projection and its stacked experts as Q8_0 blocks: kept
    in them (the grouped path dequantizes each routed expert per window on the CPU) the
    greedy tokens equal those of the same blocks dequantized at load, with drafts too."""
    folder, model = tiny_models["qwen3_moe"]
    checkpoint = Quantizing(HFCheckpoint(folder))
    batch = prompts(3, model.config.vocab_size, seed=3, low=4, high=30)
    batch = [p * 2 for p in batch]  # repeats: so that lookup drafts are made
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    config = EngineConfig(model=str(folder), spec=0, max_context=128, parallel=3,
                          quantized_weights="off")
    dense = Engine(config, checkpoint).generate(batch, greedy)
    kept = Engine(dataclasses.replace(config, quantized_weights="on"), checkpoint)
    experts = kept.runner.stages[0].module.model.layers["0"].mlp.experts
    assert experts.gate_proj.dtype == torch.uint8 and experts.down_proj.qtype == "Q8_0"
    assert experts.gate_proj.shape == (8, 32, FORMATS["Q8_0"].row_bytes(64))
    assert kept.generate(batch, greedy) == dense
    drafted = Engine(dataclasses.replace(config, quantized_weights="on", spec=4,
                                         spec_type=("lookup",)), checkpoint)
    assert drafted.generate(batch, greedy) == dense and drafted.draft_stats.drafted > 0


def test_experts_of_mixed_kinds_take_the_grouped_path():
    """A file may keep gate and up in a supported block format but down in one that is
    dequantized at load: such experts are not fusable, and the grouped path multiplies each
    projection as it is kept."""
    from strata.layers.moe import GroupedExperts

    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(64, 32, 4)
    dense = {n: torch.randn(4, *getattr(experts, n).shape[1:], generator=g) * 0.1
             for n in ("gate_proj", "up_proj", "down_proj")}
    for n, w in dense.items():
        setattr(experts, n, torch.nn.Parameter(w, requires_grad=False))
    assert experts.fusable
    x = torch.randn(5, 64, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]])
    weights = torch.full((5, 2), 0.5)
    expected = experts(x, ids, weights)
    for n in ("gate_proj", "up_proj"):
        raw = gguf.quants.quantize(dense[n].numpy(), gguf.GGMLQuantizationType.Q8_0)
        blocks = torch.nn.Parameter(torch.from_numpy(raw), requires_grad=False)
        blocks.qtype = "Q8_0"
        setattr(experts, n, blocks)
        dense[n] = reference.dequantize(blocks.reshape(-1, raw.shape[-1]), "Q8_0").view(
            dense[n].shape)
    assert not experts.fusable and experts.capture_limit == 0
    plain = GroupedExperts(64, 32, 4)
    for n, w in dense.items():
        setattr(plain, n, torch.nn.Parameter(w, requires_grad=False))
    torch.testing.assert_close(experts(x, ids, weights), plain(x, ids, weights))
    torch.testing.assert_close(experts(x, ids, weights), expected, atol=2e-2, rtol=0)
