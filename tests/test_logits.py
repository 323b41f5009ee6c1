"""Fidelity against the reference implementation: Strata's logits equal transformers'
for the embedded GGUF and for tiny random llama, qwen3 and qwen3_moe checkpoints, and
greedy continuations are identical token for token."""

from __future__ import annotations

import pytest
import torch

from conftest import prompts
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.sampling.params import SamplingParams

# fp32 on CPU: the two implementations order their sums differently, so logits agree to
# rounding, not bit for bit. Relative to the largest logit, 1e-4 is far below any gap
# that would change a greedy token in these tests.
RTOL = 1e-4

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= RTOL * scale, f"max |diff| {err:.3g} vs scale {scale:.3g}"


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with the reference model and its own KV cache (no logits
    processors, end-of-sequence ignored)."""
    out, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = model(step, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_tiny_models_match_transformers(tiny_models, kind):
    folder, model = tiny_models[kind]
    engine = Engine(EngineConfig(model=str(folder), max_context=256))
    for ids in prompts(3, model.config.vocab_size, seed=7, low=5, high=60):
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        assert_logits_close(engine.score(ids), ref)
        assert engine.generate([ids], GREEDY)[0] == reference_greedy(model, ids, 32)


@pytest.fixture(scope="module")
def gguf_reference(gguf_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


def test_default_gguf_matches_transformers(gguf_path, default_checkpoint, gguf_reference):
    engine = Engine(EngineConfig(model=str(gguf_path), max_context=512), default_checkpoint)
    tok = engine.checkpoint.load_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about rivers."}])
    ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        ref = gguf_reference(torch.tensor([ids])).logits[0]
    assert_logits_close(engine.score(ids), ref)
    assert engine.generate([ids], GREEDY)[0] == reference_greedy(gguf_reference, ids, 32)
