"""A model split into 1, 2 or 3 stages computes the same logits and the same greedy
tokens: a stage is only a layer range, and the split changes no arithmetic."""

from __future__ import annotations

import pytest
import torch
from conftest import prompts

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.sampling.params import SamplingParams

SPLITS = [(), (2,), (1, 3)]


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_split_gives_identical_logits(tiny_models, kind):
    folder, model = tiny_models[kind]
    ids = prompts(1, model.config.vocab_size, seed=3, low=30, high=31)[0]
    results = []
    for split in SPLITS:
        engine = Engine(EngineConfig(model=str(folder), layer_split=split, max_context=128))
        assert len(engine.runner.stages) == len(split) + 1
        results.append((engine.score(ids), engine.generate([ids], SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True))[0]))
    for logits, tokens in results[1:]:
        torch.testing.assert_close(logits, results[0][0], rtol=0, atol=1e-5)
        assert tokens == results[0][1]


def test_default_gguf_split(gguf_path, default_checkpoint):
    ids = list(range(100, 140))
    one = Engine(EngineConfig(model=str(gguf_path), max_context=128), default_checkpoint)
    three = Engine(EngineConfig(model=str(gguf_path), layer_split=(10, 20), max_context=128),
                   default_checkpoint)
    torch.testing.assert_close(three.score(ids), one.score(ids), rtol=0, atol=1e-4)


def test_each_stage_holds_only_its_layers(tiny_models):
    folder, _ = tiny_models["llama"]
    engine = Engine(EngineConfig(model=str(folder), layer_split=(1, 3), max_context=64))
    names = [set(dict(s.module.named_parameters())) for s in engine.runner.stages]
    assert "model.embed_tokens.weight" in names[0]
    assert not any("embed_tokens" in n or "lm_head" in n for n in names[1])
    assert "lm_head.weight" in names[2] and "model.norm.weight" in names[2]
    layers = [{int(n.split(".")[2]) for n in ns if n.startswith("model.layers.")} for ns in names]
    assert layers == [{0}, {1, 2}, {3}]
    assert [len(s.caches) for s in engine.runner.stages] == [1, 2, 1]


@pytest.mark.parametrize("split", [(0,), (4,), (2, 2), (3, 1), (9,)])
def test_invalid_split_is_a_clear_error(tiny_models, split):
    folder, _ = tiny_models["llama"]
    with pytest.raises(StrataError, match="--layer-split"):
        Engine(EngineConfig(model=str(folder), layer_split=split))
