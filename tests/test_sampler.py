"""Sampling (a Verifier entry without drafts): greedy rows, per-row parameters in one
batch, seeds, and the truncations (top-k, top-p, min-p) keeping exactly the tokens they
should."""

from __future__ import annotations

import pytest
import torch

from strata.errors import StrataError
from strata.sampling.params import SamplingParams
from strata.sampling.sampler import processed_probs
from strata.sampling.verifier import Verifier, VerifyEntry

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def sample(logits: torch.Tensor, params: list[SamplingParams], positions=None) -> torch.Tensor:
    positions = positions or [0] * len(params)
    entries = [VerifyEntry(p, f"r{i}", [], position=t)
               for i, (p, t) in enumerate(zip(params, positions))]
    return torch.tensor([t for [t] in Verifier().verify(logits, entries)])


def draw(params: SamplingParams, n: int = 2000) -> torch.Tensor:
    return sample(LOGITS.repeat(n, 1), [params] * n)


def test_greedy_and_mixed_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    out = sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)])
    assert out.tolist() == [1, 0]


@pytest.mark.parametrize("params,support", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),
    (SamplingParams(top_p=0.76), {0, 1, 2}),
    (SamplingParams(min_p=0.2), {0, 1, 2}),
    (SamplingParams(), {0, 1, 2, 3, 4}),
])
def test_truncation_support(params, support):
    assert set(draw(params).tolist()) == support


def test_temperature_one_follows_the_distribution():
    counts = torch.bincount(draw(SamplingParams(), n=20000), minlength=5).float() / 20000
    assert torch.allclose(counts, LOGITS.exp()[0], atol=0.015)


def test_seed_reproduces_and_differs():
    def run(seed: int) -> list[int]:  # the tokens of positions 0..39 of a seeded request
        return sample(LOGITS.repeat(40, 1), [SamplingParams(seed=seed)] * 40, list(range(40))).tolist()
    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(temperature=float("inf")), dict(temperature=float("nan")),
    dict(top_p=0), dict(top_p=float("nan")), dict(top_k=-2), dict(top_k=2 ** 31),
    dict(top_k=10 ** 30), dict(min_p=2), dict(max_tokens=0), dict(max_tokens=2 ** 31),
    dict(seed=2 ** 63), dict(seed=-(2 ** 63) - 1), dict(logprobs=21), dict(logprobs=-1),
    dict(logit_bias=((3, 101.0),)), dict(logit_bias=((3, float("nan")),)),
    dict(logit_bias=((-1, 1.0),))])
def test_bad_params_are_clear_errors(kwargs):
    with pytest.raises(StrataError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-30, 1e-6, 1e-5, 1e-3])
def test_tiny_temperatures_are_finite_and_near_greedy(temperature):
    """Below 1e-5 a row is greedy (as vLLM); above, 1 / T stays finite: never NaN."""
    logits = torch.tensor([[0.0, 3.0, 2.999, -1.0]])
    params = SamplingParams(temperature=temperature)
    probs = processed_probs(logits, [params])
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
    assert sample(logits, [params]).tolist() == [1] or temperature >= 1e-3
    assert params.greedy == (temperature < 1e-5)


def test_top_k_larger_than_the_vocabulary_keeps_every_token():
    assert set(draw(SamplingParams(top_k=2 ** 31 - 1)).tolist()) == {0, 1, 2, 3, 4}
