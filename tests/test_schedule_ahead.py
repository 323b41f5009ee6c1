"""Windows built ahead (`--schedule-ahead`): while a decoding group's window computes, its
next window is built and launched with its input tokens carried over on the device. The
scheduler's counts stay exact, and the tokens are the same as one window at a time."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import prompts
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.request import Request
from strata.sampling.params import SamplingParams
from strata.scheduler.scheduler import Scheduler


def make(n: int, max_tokens: int = 5, eos: frozenset[int] = frozenset()) -> Request:
    return Request(list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   eos)


def test_a_window_ahead_is_one_token_on_with_its_tokens_carried():
    sched = Scheduler(num_slots=2, max_context=32, max_window_tokens=16, block_size=4,
                      ahead=True)
    a, b = make(3), make(5)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    ahead = sched.schedule_ahead()
    assert not first.header.carry and ahead.header.carry
    assert ahead.header.starts == [3, 5] and ahead.header.positions.tolist() == [3, 5]
    assert ahead.header.query_lens == [1, 1] and ahead.header.samples == [True, True]
    assert [e.position for e in ahead.header.verify] == [4, 6]
    assert sched.in_flight == {0: 2} and sched.schedule_ahead() is None
    sched.commit(first, [[7], [8]])
    sched.commit(ahead, [[9], [10]])
    assert a.output_ids == [7, 9] and b.output_ids == [8, 10]
    assert [s.num_computed for s in sched.slots] == [4, 6] and not sched.in_flight
    again = sched.schedule()
    assert again.header.positions.tolist() == [4, 6]
    assert again.header.token_ids.tolist() == [9, 10]


@pytest.mark.parametrize("case", ["off", "prompt chunk", "last token", "request waiting"])
def test_no_window_ahead_where_the_next_one_is_not_known(case):
    sched = Scheduler(num_slots=2, max_context=32,
                      max_window_tokens=4 if case == "prompt chunk" else 16, block_size=4,
                      ahead=case != "off")
    sched.add(make(6, max_tokens=1 if case == "last token" else 5))
    first = sched.schedule()
    if case == "request waiting":  # a free slot in the group: the next window admits it
        sched.add(make(3))
    assert first is not None and sched.schedule_ahead() is None


def test_the_entry_ahead_of_a_finished_request_is_dropped():
    sched = Scheduler(num_slots=2, max_context=32, max_window_tokens=16, block_size=4,
                      ahead=True)
    a, b = make(3, eos=frozenset({7})), make(3)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    ahead = sched.schedule_ahead()
    sched.commit(first, [[7], [8]])  # a ends with its EOS; its entry ahead is void
    assert a.finished and sched.slots[0].free
    sched.commit(ahead, [[9], [10]])
    assert a.output_ids == [7] and b.output_ids == [8, 10]
    sched.abort(b.request_id)
    assert sched.pool.num_free == sched.pool.num_blocks


def run(engine: Engine, batch: list[list[int]], params: list[SamplingParams],
        eos: frozenset[int]) -> tuple[list[list[int]], int]:
    """Output ids, and how many windows carried their tokens over."""
    carried = 0
    submit = engine.runner.submit

    def counting(window):
        nonlocal carried
        carried += window.header.carry
        submit(window)

    engine.runner.submit = counting
    requests = [engine.add_request(p, s, eos_token_ids=eos) for p, s in zip(batch, params)]
    while engine.has_work:
        engine.step()
    return [r.output_ids for r in requests], carried


@pytest.mark.parametrize("groups", [1, 2])
def test_tokens_are_the_same_with_windows_ahead(tiny_models, groups):
    """Greedy and seeded sampling, requests that end early on an EOS, at max_tokens, and
    requests waiting for a slot: every token as with one window at a time."""
    folder, model = tiny_models["llama"]
    batch = prompts(6, model.config.vocab_size, seed=4, low=2, high=40)
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i) if i % 2 else
              SamplingParams(temperature=0.9, seed=i, max_tokens=30) for i in range(6)]
    config = EngineConfig(model=str(folder), parallel=4, batch_groups=groups,
                          max_window_tokens=24, max_context=128, spec=0, schedule_ahead="on")
    plain, _ = run(Engine(dataclasses.replace(config, schedule_ahead="off")), batch, params,
                   frozenset())
    eos = frozenset({plain[1][len(plain[1]) // 2]})  # one request (at least) ends early
    plain, none = run(Engine(dataclasses.replace(config, schedule_ahead="off")), batch, params,
                      eos)
    ahead, carried = run(Engine(config), batch, params, eos)
    assert ahead == plain and none == 0 and carried > 20
    assert any(len(out) < p.max_tokens for out, p in zip(plain, params))


def test_drafts_and_windows_ahead_take_turns(tiny_models):
    """Suffix drafts on repetitive prompts: slots draft where a draft is worth a window's
    overlap, go ahead where not, and every greedy token is as without drafts."""
    folder, model = tiny_models["llama"]
    base = prompts(4, model.config.vocab_size, seed=11, low=6, high=14)
    batch = [p * 3 + p[:3] for p in base[:2]] + base[2:]  # two repeat, two do not
    greedy = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    config = EngineConfig(model=str(folder), parallel=4, max_context=160,
                          spec_type=("suffix",), spec_suffix_global=0, schedule_ahead="on")
    plain, _ = run(Engine(dataclasses.replace(config, spec=0, schedule_ahead="off")), batch,
                   greedy, frozenset())
    engine = Engine(config)
    drafted, carried = run(engine, batch, greedy, frozenset())
    assert drafted == plain
    assert carried > 0 and engine.draft_stats.drafted > 0


def test_a_draft_must_be_worth_the_window():
    """The policy's window cost: a draft whose net gain does not exceed it is not sent."""
    from strata.drafting.draft import Draft
    from strata.drafting.policy import DraftPolicy

    class Fixed:
        name, on_last_stage = "fixed", False

        def propose(self, request_id, room):
            return Draft([1, 2, 3], [0.5, 0.25, 0.1], "fixed")

    policy = DraftPolicy([Fixed()], token_cost=0.05)
    request = make(3)
    assert policy.draft(request, 8).tokens == [1, 2, 3]  # gain 0.45 + 0.2 + 0.05
    assert policy.draft(request, 8, window_cost=0.6).tokens == [1, 2, 3]
    assert policy.draft(request, 8, window_cost=0.75) is None


def test_schedule_ahead_setting_resolves_and_checks():
    from strata.engine.engine import schedules_ahead
    from strata.errors import StrataError

    assert schedules_ahead(EngineConfig(devices=("cuda:0",)))  # auto: on CUDA
    assert not schedules_ahead(EngineConfig())                # auto: not on the CPU
    assert schedules_ahead(EngineConfig(schedule_ahead="on"))
    assert not schedules_ahead(EngineConfig(devices=("cuda:0",), schedule_ahead="off"))
    assert not schedules_ahead(EngineConfig(devices=("cpu", "cpu"), layer_split=(2,),
                                            schedule_ahead="on"))  # stage processes
    with pytest.raises(StrataError, match="--schedule-ahead sometimes is not one of"):
        EngineConfig(schedule_ahead="sometimes")
    with pytest.raises(StrataError, match="--spec-window-cost must be >= 0"):
        EngineConfig(spec_window_cost=-1)
