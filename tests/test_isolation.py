"""A failure that concerns one request fails that request only: its sampling on the last
stage (the window is verified again entry by entry), or its proposer on the scheduler's
side. The other requests in the same windows finish with the text they would have had
alone, and the engine goes on."""

from __future__ import annotations

import pytest

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.llm import LLM
from strata.sampling.params import SamplingParams

BAD_SEED = 666
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def folder(tiny_models):
    return str(tiny_models["llama"][0])


def greedy(seed=None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, seed=seed)


def reference(folder: str) -> list[list[int]]:
    engine = Engine(EngineConfig(model=folder, parallel=4, spec=0))
    return engine.generate(PROMPTS, greedy())


def run(engine: Engine, params: list[SamplingParams]):
    requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, params)]
    while engine.has_work:
        engine.step()
    return requests


def test_a_failing_sampling_entry_fails_its_request_only(folder, monkeypatch):
    expected = reference(folder)
    engine = Engine(EngineConfig(model=folder, parallel=4))  # drafts on: windows share entries
    verifier = engine.runner.last.verifier
    original = verifier.decide

    def decide(logits, entries):
        if any(e.params.seed == BAD_SEED for e in entries):
            raise ValueError("a value this sampler cannot use")
        return original(logits, entries)

    monkeypatch.setattr(verifier, "decide", decide)
    requests = run(engine, [greedy(), greedy(BAD_SEED), greedy()])
    bad = requests[1]
    assert bad.finish_reason == "error" and "sampling" in bad.error and "ValueError" in bad.error
    assert [r.output_ids for r in (requests[0], requests[2])] == [expected[0], expected[2]]
    assert engine.scheduler.num_running == 0 and not engine.has_work
    again = run(engine, [greedy()] * 3)  # the engine goes on
    assert [r.output_ids for r in again] == expected


def test_a_failing_proposer_fails_its_request_only(folder, monkeypatch):
    expected = reference(folder)
    engine = Engine(EngineConfig(model=folder, parallel=4, spec_type=("suffix",)))
    proposer = engine.scheduler.drafts.proposers[0]
    original = proposer.propose
    victim = {}

    def propose(request_id, max_tokens):
        if request_id == victim.get("id"):
            raise RuntimeError("proposer bug")
        return original(request_id, max_tokens)

    monkeypatch.setattr(proposer, "propose", propose)
    requests = [engine.add_request(p, greedy()) for p in PROMPTS]
    victim["id"] = requests[1].request_id
    while engine.has_work:
        engine.step()
    assert requests[1].finish_reason == "error" and "drafting" in requests[1].error
    assert [r.output_ids for r in (requests[0], requests[2])] == [expected[0], expected[2]]
    assert all(slot.free for slot in engine.scheduler.slots)


def test_a_failure_alone_in_its_window_is_reported(folder, monkeypatch):
    """The only request fails while drafting: step() reports it though no window ran."""
    engine = Engine(EngineConfig(model=folder, parallel=1, spec_type=("suffix",)))
    proposer = engine.scheduler.drafts.proposers[0]
    monkeypatch.setattr(proposer, "propose", lambda *a: 1 / 0)
    request = engine.add_request(PROMPTS[0], greedy())
    reported = []
    while engine.has_work:
        reported += engine.step()
    assert request in reported and request.finish_reason == "error"


def test_generate_reports_a_failed_request_as_one_line(gguf_path, monkeypatch):
    llm = LLM(EngineConfig(model=str(gguf_path), spec=0))
    monkeypatch.setattr(llm.engine.runner.last.verifier, "decide", lambda *a: 1 / 0)
    with pytest.raises(StrataError, match="sampling this request's next token failed"):
        list(llm.stream(llm.encode_prompt("Hi"), greedy()))


def test_a_failing_entry_on_a_stage_process_fails_its_request_only(folder):
    """The last stage is its own process: a logit bias outside the vocabulary (which the
    server refuses, but the engine API lets through) raises in its verifier. That request
    fails; the stage process and the other requests go on."""
    expected = reference(folder)
    engine = Engine(EngineConfig(model=folder, parallel=4, layer_split=(2,),
                                 devices=("cpu", "cpu"), stage_threads=1))
    try:
        outside = SamplingParams(temperature=0, max_tokens=24, logit_bias=((10 ** 6, 1.0),))
        requests = run(engine, [greedy(), outside, greedy()])
        assert requests[1].finish_reason == "error" and "IndexError" in requests[1].error
        assert [r.output_ids for r in (requests[0], requests[2])] == [expected[0], expected[2]]
        assert engine.runner.failure is None
        assert [r.output_ids for r in run(engine, [greedy()] * 3)] == expected
    finally:
        engine.close()
