"""Continuous batching: requests of different lengths that share windows (decode tokens
beside prompt chunks, requests waiting for a slot) produce exactly the greedy tokens
each produces alone."""

from __future__ import annotations

import pytest

from conftest import prompts
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.sampling.params import SamplingParams


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("parallel,window", [(8, 512), (3, 16)])
def test_batched_equals_solo(tiny_models, kind, parallel, window):
    folder, model = tiny_models[kind]
    batch = prompts(8, model.config.vocab_size, seed=11, low=2, high=70)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    solo_engine = Engine(EngineConfig(model=str(folder), max_context=128))
    solo = [solo_engine.generate([p], params)[0] for p in batch]
    engine = Engine(EngineConfig(model=str(folder), parallel=parallel, max_window_tokens=window,
                                 max_context=128))
    assert engine.generate(batch, params) == solo


def test_default_model_batched_equals_solo(gguf_path, default_checkpoint):
    batch = prompts(8, 49152, seed=5, low=4, high=50)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(gguf_path), parallel=8, max_window_tokens=64,
                                 max_context=128), default_checkpoint)
    solo = [engine.generate([p], params)[0] for p in batch]
    assert engine.generate(batch, params) == solo
