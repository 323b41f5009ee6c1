"""EngineCore, the server's engine loop work (also what the engine process runs): its
Outputs add up to the engine's own greedy output, an aborted request gets nothing more, a
request that cannot run gets a 400 Output, everything it says pickles (it crosses the
engine process's pipe), and Metrics shows a CoreStats (a restarted engine counts afresh).
"""

from __future__ import annotations

import gc
import pickle

import pytest

from strata.config import EngineConfig
from strata.errors import StrataError
from strata.llm import LLM
from strata.request import Request
from strata.sampling.params import SamplingParams
from strata.server.engine_core import CoreStats, EngineCore
from strata.server.metrics import Metrics
from server_utils import metric_text


def test_outputs_add_up_to_the_engines_own_and_an_abort_ends_them(gguf_path,
                                                                  default_checkpoint):
    llm = LLM(EngineConfig(model=str(gguf_path), parallel=3, max_context=512),
              default_checkpoint)
    core = EngineCore(llm)
    assert gc.get_freeze_count() > 0  # the loaded engine is out of the collector's passes
    prompts = [llm.encode_prompt(text) for text in ("Count to ten.", "Name three colors.",
                                                    "Say hello.")]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    expected = llm.engine.generate(prompts[:2], params)
    requests = [Request(ids, params, llm.eos_token_ids) for ids in prompts]
    for request in requests:
        assert core.add(request) is None
    got = {r.request_id: [] for r in requests}
    ends, logprobs = {}, {r.request_id: 0 for r in requests}
    steps = 0
    while core.has_work:
        outputs = pickle.loads(pickle.dumps(core.step()))
        steps += 1
        for out in outputs:
            assert out.request_id not in ends, "an Output after the request's end"
            got[out.request_id] += out.token_ids
            logprobs[out.request_id] += len(out.logprobs)
            if out.finish_reason is not None:
                ends[out.request_id] = (out.finish_reason, out.drafts)
        if steps == 2:
            core.abort(requests[2].request_id)
            aborted_at = len(got[requests[2].request_id])
            assert aborted_at >= 1
    for request, tokens in zip(requests, expected):
        assert got[request.request_id] == tokens
        assert logprobs[request.request_id] == len(tokens)
        assert ends[request.request_id][0] == "length"
        assert ends[request.request_id][1]["drafted"] >= 0
    assert len(got[requests[2].request_id]) == aborted_at
    assert requests[2].request_id not in ends

    too_long = Request(list(range(600)), params, llm.eos_token_ids)
    rejected = core.add(too_long)
    assert rejected.error_status == 400 and "--max-context" in rejected.error
    stats = pickle.loads(pickle.dumps(core.stats()))
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert stats.running == 0 and stats.waiting == 0
    assert stats.step_seconds and len(stats.step_seconds) == steps
    assert core.stats().step_seconds == []  # only the steps since the last CoreStats
    assert core.info.max_context == 512 and core.info.eos_token_ids == llm.eos_token_ids
    core.close()
    assert gc.get_freeze_count() == 0


def test_metrics_show_core_stats_and_a_restarted_engine_counts_afresh():
    metrics = Metrics()
    metrics.observe_core(CoreStats(prompt_tokens=30, scheduler_seconds=2.0, running=2,
                                   step_seconds=[0.001, 0.003]))
    metrics.observe_core(CoreStats(prompt_tokens=50, scheduler_seconds=3.0, running=1))
    metrics.observe_core(CoreStats(prompt_tokens=10, scheduler_seconds=0.5))  # restarted
    text = metrics.render().decode()
    assert metric_text(text, "strata_prompt_tokens_total") == 60
    assert metric_text(text, "strata_scheduler_busy_seconds_total") == 3.5
    metrics.new_engine()  # a restart the server saw: counts that grew past the last ones
    metrics.observe_core(CoreStats(prompt_tokens=70, scheduler_seconds=4.0))
    text = metrics.render().decode()
    assert metric_text(text, "strata_prompt_tokens_total") == 130
    assert metric_text(text, "strata_scheduler_busy_seconds_total") == 7.5
    assert metric_text(text, "strata_window_seconds_count") == 2
    assert metric_text(text, "strata_slots_used") == 0


def test_engine_process_auto_means_a_cuda_first_stage():
    from strata.server.config import ServerConfig

    cpu, cuda = EngineConfig(devices=("cpu",)), EngineConfig(devices=("cuda:0",))
    split = EngineConfig(devices=("cuda:0", "cuda:1"), layer_split=(15,))
    auto = ServerConfig()
    assert auto.engine_process == "auto"
    assert not auto.runs_engine_process(cpu)
    assert auto.runs_engine_process(cuda) and auto.runs_engine_process(split)
    assert ServerConfig(engine_process="on").runs_engine_process(cpu)
    assert not ServerConfig(engine_process="off").runs_engine_process(cuda)
    with pytest.raises(StrataError, match="--engine-process must be auto, on or off"):
        ServerConfig(engine_process="yes")
