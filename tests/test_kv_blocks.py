"""KV blocks on demand (--kv-tokens): a pool smaller than every slot's --max-context.
Blocks are given as sequences grow; a request waits to be admitted until its tokens fit;
when a running window finds the pool short, the newest request's drafts go first, then
its prompt chunk shrinks, then the newest running request of a group with no window in
flight is preempted and computes its tokens again later. Output is what a pool that never
runs short gives (greedy with drafts, seeded sampling; one process and stage processes),
and a window in flight never loses a block it writes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.request import Request
from strata.sampling.params import SamplingParams
from strata.scheduler.scheduler import Scheduler


def token_at(position: int) -> int:
    """The fake model: the token sampled after `position` tokens depends on that alone, so
    a request computed again gives the same output."""
    return 1 + (position * 7) % 50


def make(prompt: int, max_tokens: int, first: int = 1) -> Request:
    return Request(list(range(first, first + prompt)),
                   SamplingParams(temperature=0, max_tokens=max_tokens))


def check_blocks(sched: Scheduler, in_flight: list) -> None:
    """Each block is held by as many slots as hold it in their tables; a window in flight
    writes only blocks its slots still hold."""
    pool, holders = sched.pool, {}
    for slot in sched.slots:
        for block in slot.block_table.blocks:
            holders[block] = holders.get(block, 0) + 1
    assert all(pool.refs[b] == n for b, n in holders.items())
    assert pool.num_used == len(holders) + (0 if pool.prefix is None else
                                            len(pool.prefix) - len(pool.prefix.idle)
                                            - sum(pool.prefix.registered(b) for b in holders))
    for window in in_flight:  # its requests (unless aborted) keep their slots and blocks
        for index, request, rows in zip(window.header.slots, window.requests, rows_of(window)):
            slot = sched.slots[index]
            if not request.finished:
                assert slot.request is request
                assert {r // pool.block_size for r in rows} <= set(slot.block_table.blocks)


def rows_of(window) -> list[list[int]]:
    rows, out, offset = window.header.slot_mapping.tolist(), [], 0
    for count in window.header.query_lens:
        out.append(rows[offset:offset + count])
        offset += count
    return out


def run(sched: Scheduler, requests: list[Request], depth: int = 1) -> None:
    """Drive the scheduler as the engine does, with up to `depth` windows in flight (one
    per group), committing the oldest with the fake model's tokens."""
    for request in requests:
        sched.add(request)
    in_flight = []
    for _ in range(10_000):
        if not sched.has_work:
            return
        while len(in_flight) < depth and (window := sched.schedule()) is not None:
            in_flight.append(window)
            check_blocks(sched, in_flight)
        assert in_flight, "work left but no window: the scheduler hangs"
        window = in_flight.pop(0)
        results = [[token_at(start + count)] for start, count, sample in zip(
            window.header.starts, window.header.query_lens, window.header.samples) if sample]
        sched.commit(window, results)
        check_blocks(sched, in_flight)
    raise AssertionError("the requests never finished")


def expected(request: Request) -> list[int]:
    n = request.num_prompt_tokens
    return [token_at(p) for p in range(n, n + request.params.max_tokens)]


def test_a_pool_below_one_requests_context_is_refused():
    with pytest.raises(StrataError, match="--kv-tokens 32 .* --max-context 64"):
        Scheduler(num_slots=2, max_context=64, max_window_tokens=8, block_size=4, kv_tokens=32)
    with pytest.raises(StrataError, match="--kv-tokens must be at least 1"):
        EngineConfig(kv_tokens=0)


def test_a_request_waits_until_its_prompt_fits():
    sched = Scheduler(num_slots=2, max_context=16, max_window_tokens=16, block_size=4,
                      kv_tokens=16)
    first, second = make(10, 3), make(10, 3, first=20)
    sched.add(first)
    sched.add(second)
    window = sched.schedule()
    assert window.requests == [first] and list(sched.waiting) == [second]
    sched.commit(window, [[token_at(10)]])
    run(sched, [])
    assert first.output_ids == expected(first) and second.output_ids == expected(second)
    assert sched.preemptions == 0 and sched.pool.num_free == sched.pool.num_blocks


def test_the_newest_running_request_is_preempted_and_resumes():
    sched = Scheduler(num_slots=2, max_context=16, max_window_tokens=16, block_size=4,
                      kv_tokens=16)
    older, newer = make(3, 12), make(3, 12, first=20)
    run(sched, [older, newer])
    assert older.num_preemptions == 0 and newer.num_preemptions >= 1
    assert older.output_ids == expected(older) and newer.output_ids == expected(newer)
    assert sched.preemptions == newer.num_preemptions
    assert sched.pool.num_free == sched.pool.num_blocks


def test_an_aborted_preempted_request_is_forgotten():
    sched = Scheduler(num_slots=2, max_context=16, max_window_tokens=16, block_size=4,
                      kv_tokens=16)
    older, newer = make(3, 12), make(3, 12, first=20)
    sched.add(older)
    sched.add(newer)
    for _ in range(40):
        if newer.num_preemptions:
            break
        window = sched.schedule()
        sched.commit(window, [[token_at(s + c)] for s, c, sample in zip(
            window.header.starts, window.header.query_lens, window.header.samples) if sample])
    assert newer.num_preemptions and newer in sched.waiting
    assert sched.abort(newer.request_id) is newer and newer.finish_reason == "abort"
    run(sched, [])
    assert older.output_ids == expected(older)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 14)), min_size=1,
                        max_size=6),
       slots=st.integers(1, 4), groups=st.integers(1, 2), extra=st.integers(0, 12),
       window=st.integers(2, 16), prefix=st.booleans(), host=st.integers(0, 6),
       snapshots=st.integers(0, 3))
def test_every_request_finishes_as_with_room_to_spare(prompts, slots, groups, extra, window,
                                                      prefix, host, snapshots):
    groups = min(groups, slots)
    sched = Scheduler(num_slots=slots, max_context=40, max_window_tokens=window, block_size=4,
                      num_groups=groups, kv_tokens=40 + extra, prefix_cache=prefix,
                      host_blocks=host,  # the conversation cache's bookkeeping too
                      state_rows_per_slot=2 if snapshots else 0,  # and state snapshots'
                      state_snapshots=snapshots)
    requests = [make(p, t, first=1 + 3 * (i % 2)) for i, (p, t) in enumerate(prompts)]
    run(sched, requests, depth=groups)
    for request in requests:
        assert request.output_ids == expected(request)
    assert sched.pool.num_free == sched.pool.num_blocks


# -- the engine -------------------------------------------------------------------------------
def engine(folder, **kw) -> Engine:
    return Engine(EngineConfig(model=str(folder), parallel=4, block_size=4, spec=6,
                               max_context=64, stage_threads=1, **kw))


def texts(vocab: int) -> list[list[int]]:
    """Prompts with repeats (so drafts pass and fail), sharing a first block pairwise."""
    import torch
    g = torch.Generator().manual_seed(11)
    base = [torch.randint(0, vocab, (7,), generator=g).tolist() for _ in range(4)]
    return [b * 3 + [i + 1] for i, b in enumerate(base)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=30),
                                    SamplingParams(temperature=0.9, seed=5, max_tokens=30)],
                         ids=["greedy", "seeded"])
def test_preempted_requests_give_the_same_output(tiny_models, params):
    folder = tiny_models["llama"][0]
    prompts = texts(320)
    reference = engine(folder).generate(prompts, params)
    small = engine(folder, kv_tokens=96)
    assert small.generate(prompts, params) == reference
    assert small.scheduler.preemptions > 0
    assert small.scheduler.pool.num_blocks == 24
    if params.temperature == 0:
        assert small.draft_stats.accepted > 0


@pytest.mark.parametrize("settings", [
    dict(schedule_ahead="on"),  # windows built ahead wait for blocks
    dict(layer_split=(2,), devices=("cpu", "cpu"), batch_groups=2),  # groups in flight
], ids=["windows ahead", "stage processes"])
def test_preemption_with_windows_in_flight_gives_the_same_output(tiny_models, settings):
    folder = tiny_models["llama"][0]
    prompts = texts(320)
    params = SamplingParams(temperature=0, max_tokens=30)
    reference = engine(folder).generate(prompts, params)
    e = engine(folder, kv_tokens=96, **settings)
    try:
        assert e.generate(prompts, params) == reference
        assert e.scheduler.preemptions > 0
    finally:
        e.close()


# -- the server -------------------------------------------------------------------------------
def test_the_server_serves_more_long_requests_than_its_pool_holds(tiny_served_model, tmp_path):
    """Six long requests at once into a pool that holds fewer than two: they wait and are
    preempted, and each ends with the text it gives alone; the server stays up."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    from server_utils import running_server
    prompts = [f"Request {i}: " + "please count the words of this sentence. " * 30
               for i in range(6)]
    with running_server("--model", str(tiny_served_model), "--parallel", "4",
                        "--max-context", "512", "--kv-tokens", "512",
                        log=tmp_path / "serve.log") as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def complete(prompt: str):
            return client.completions.create(model=model, prompt=prompt, max_tokens=48,
                                             temperature=0).choices[0]

        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(complete, prompts))
        metrics = httpx.get(base + "/metrics").text
        alone = [complete(p) for p in prompts]
        assert httpx.get(base + "/health").status_code == 200
    assert [c.text for c in together] == [c.text for c in alone]
    assert all(c.finish_reason == "length" for c in together)
    preempted = [line for line in metrics.splitlines()
                 if line.startswith("strata_preemptions_total")]
    assert preempted and float(preempted[0].split()[-1]) > 0
