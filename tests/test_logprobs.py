"""logprobs, logit_bias and n: what the verifier adds per request.

logprobs are log_softmax of the model's raw logits at each emitted token's position,
accepted drafts included: checked against the logits of the whole sequence scored at once
(Engine.score, one process, no drafts). A logit bias moves greedy output, and greedy output
with a bias is the same with and without drafts."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.sampling.params import SamplingParams
from strata.sampling.verifier import Verifier, VerifyEntry

REPETITIVE = [[5, 6, 7, 8, 9] * 4 + [5, 6], [30, 31, 32, 30, 31, 32, 30, 31, 32, 30]]


@pytest.fixture(scope="module")
def folder(tiny_models):
    return str(tiny_models["llama"][0])


@pytest.fixture(scope="module")
def scorer(folder):
    return Engine(EngineConfig(model=folder, parallel=1, spec=0))


@pytest.mark.parametrize("spec", [0, 8])
def test_logprobs_are_log_softmax_of_the_reference_logits(folder, scorer, spec):
    engine = Engine(EngineConfig(model=folder, parallel=2, spec=spec))
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=5)
    requests = [engine.add_request(p, params) for p in REPETITIVE]
    while engine.has_work:
        engine.step()
    if spec:
        assert engine.draft_stats.accepted > 0  # accepted drafts carry logprobs too
    for prompt, request in zip(REPETITIVE, requests):
        out = request.output_ids
        assert len(request.logprobs) == len(out) == 20
        reference = torch.log_softmax(scorer.score(prompt + out[:-1]).float(), dim=-1)
        for j, (token, logprob, top) in enumerate(request.logprobs):
            row = reference[len(prompt) - 1 + j]
            assert token == out[j] == int(row.argmax())
            assert logprob == pytest.approx(row[token].item(), abs=1e-4)
            values, ids = row.topk(5)
            assert [t for t, _ in top] == ids.tolist()
            assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)


def test_logprobs_only_for_requests_that_ask(folder):
    engine = Engine(EngineConfig(model=folder, parallel=2, spec=0))
    asks = engine.add_request(REPETITIVE[0], SamplingParams(temperature=0, max_tokens=4,
                                                            logprobs=0))
    quiet = engine.add_request(REPETITIVE[1], SamplingParams(temperature=0, max_tokens=4))
    while engine.has_work:
        engine.step()
    assert [top for _, _, top in asks.logprobs] == [[]] * 4 and quiet.logprobs is None


def test_logit_bias_moves_greedy_output_and_stays_lossless_with_drafts(folder, scorer):
    plain = SamplingParams(temperature=0, max_tokens=16)
    first = scorer.generate([REPETITIVE[0]], plain)[0]
    banned = SamplingParams(temperature=0, max_tokens=16, logit_bias=((first[0], -100.0),))
    forced = SamplingParams(temperature=0, max_tokens=16, logit_bias=((77, 100.0),))
    outputs = {}
    for spec in (0, 8):
        engine = Engine(EngineConfig(model=folder, parallel=2, spec=spec))
        outputs[spec] = [engine.generate([REPETITIVE[0]], p)[0] for p in (banned, forced)]
    assert outputs[0] == outputs[8]
    assert first[0] not in outputs[0][0]
    assert outputs[0][1] == [77] * 16


def test_logit_bias_outside_the_vocabulary_fails_in_the_verifier():
    with pytest.raises(IndexError, match="vocabulary"):
        Verifier().verify(torch.zeros(1, 10), [VerifyEntry(
            SamplingParams(logit_bias=((10, 1.0),)), "r", [])])
