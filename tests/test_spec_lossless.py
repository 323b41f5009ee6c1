"""Speculative decoding is lossless: greedy output with drafts is identical to greedy
output without them, for one request and for eight at once, on tiny random dense and
MoE models, and on the default model answering with long stretches of a source file."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
from strata.bench.workloads import edit_prompt


def copy_heavy_prompts(n: int, vocab: int) -> list[list[int]]:
    """Random text that repeats itself, so that drafts from the prompt can be right."""
    g = torch.Generator().manual_seed(21)
    out = []
    for i in range(n):
        body = torch.randint(0, vocab, (12 + 3 * i,), generator=g).tolist()
        out.append(body + body + body[: 4 + i])
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_greedy_identical_with_and_without_drafts(tiny_models, kind):
    folder, model = tiny_models[kind]
    prompts = copy_heavy_prompts(8, model.config.vocab_size)
    plain = Engine(EngineConfig(model=str(folder), parallel=8, spec=0, max_context=256))
    expected = plain.generate(prompts, GREEDY)
    assert plain.draft_stats.drafted == 0
    for spec_type in (("suffix",), ("lookup",), ()):
        engine = Engine(EngineConfig(model=str(folder), parallel=8, spec=6, spec_type=spec_type,
                                     max_context=256))
        assert engine.generate(prompts, GREEDY) == expected, spec_type
        assert engine.draft_stats.accepted > 0, f"{spec_type}: no draft was ever accepted"
        assert engine.draft_stats.accepted < engine.draft_stats.drafted, "no draft was rejected"
        solo = engine.generate(prompts[:1], GREEDY)
        assert solo == expected[:1]


def test_default_model_copy_heavy_answer_is_identical_with_drafts(gguf_path, default_checkpoint):
    from strata.llm import LLM

    # NOTE: SmolLM2-135M does not apply the rename faithfully (transformers gives the same
    # text); it does answer with long stretches copied from the file, which is what drafts
    # are for and what this test needs.
    prompt = edit_prompt("small")
    params = SamplingParams(temperature=0, max_tokens=150)
    plain = LLM(EngineConfig(model=str(gguf_path), spec=0, max_context=2048), default_checkpoint)
    ids = plain.encode_prompt(prompt)
    expected = plain.generate([ids], params)[0]
    assert "def find_part(self" in expected.text  # copied from the file
    drafting = LLM(EngineConfig(model=str(gguf_path), spec=8, max_context=2048),
                   default_checkpoint)
    got = drafting.generate([ids], params)[0]
    assert got.token_ids == expected.token_ids
    assert got.drafts.accepted > 50, got.drafts.summary()  # a third of the answer
