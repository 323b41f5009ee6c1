"""Windows built ahead (`--schedule-ahead`): while a decoding group's window computes, its
next window is built and launched with its input tokens carried over on the device. The
scheduler's counts stay exact, and the tokens are the same as one window at a time."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import Oracle, prompts
from strata.config import EngineConfig
from strata.drafting.draft import Draft
from strata.drafting.policy import DraftPolicy
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


class DraftsFor:
    """A proposer that drafts [50, 51] (both certain) for the requests it is given."""
    name, on_last_stage = "fixed", False

    def __init__(self, *requests: Request):
        self.ids = {r.request_id for r in requests}

    def start(self, rid, prompt): pass
    def extend(self, rid, tokens, stage_drafts=None): pass
    def finish(self, rid): pass

    def propose(self, rid, max_tokens):
        return Draft([50, 51][:max_tokens], [1.0, 1.0][:max_tokens], self.name) \
            if rid in self.ids else None


def test_a_slot_drafts_after_its_guessed_token_and_sits_out_the_window_after():
    """Slot 0 drafts: a window built ahead of its window in flight carries its token in
    flight, then the drafts after its proposer's guess of that token (not the guess);
    the window built ahead of that one carries slots 1 and 2 only (their tokens from the
    device); the one after that takes slot 0 back, with its token known by then and new
    drafts, beside slots 1 and 2 carried."""
    a, b, c = make(3, max_tokens=20), make(5, max_tokens=20), make(4, max_tokens=20)
    sched = Scheduler(num_slots=3, max_context=64, max_window_tokens=32, block_size=4,
                      drafts=DraftPolicy([DraftsFor(a)], token_cost=0.05), ahead=True,
                      window_cost=0.4)  # a draft after the guess: 0.95 > 0.4
    for r in (a, b, c):
        sched.add(r)
    prompts = sched.schedule()
    assert prompts.header.query_lens == [3, 5, 4]
    guessed = sched.schedule_ahead()  # slot 0 guesses 50 for its token in flight
    assert guessed.header.slots == [0, 1, 2] and guessed.header.query_lens == [2, 1, 1]
    assert guessed.header.num_drafts == [1, 0, 0] and guessed.drafts[0].tokens == [51]
    assert guessed.header.token_ids.tolist() == [0, 51, 0, 0]
    assert guessed.header.carry_rows == [0, 2, 3] and guessed.header.carry_from == [0, 1, 2]
    assert guessed.header.positions.tolist() == [3, 4, 5, 4]
    assert guessed.header.sample_rows.tolist() == [0, 1, 2, 3]
    assert [e.draft for e in guessed.header.verify] == [[51], [], []]
    assert sched.schedule_ahead() is None  # two windows in flight already
    sched.commit(prompts, [[50], [8], [9]])  # the guess was right
    around = sched.schedule_ahead()  # slot 0's drafts are in flight: it sits this one out
    assert around.header.slots == [1, 2] and around.header.carry_from == [1, 2]
    assert around.header.positions.tolist() == [6, 5]
    sched.commit(guessed, [[51, 12], [10], [11]])  # slot 0 accepts its draft
    back = sched.schedule_ahead()
    assert back.header.slots == [0, 1, 2] and back.header.token_ids.tolist()[:3] == [12, 50, 51]
    assert back.header.carry_rows == [3, 4] and back.header.carry_from == [0, 1]
    assert back.header.positions.tolist() == [5, 6, 7, 7, 6]
    sched.commit(around, [[13], [14]])
    sched.commit(back, [[50, 17], [18], [19]])  # slot 0 accepts one draft
    assert a.output_ids == [50, 51, 12, 50, 17]
    assert b.output_ids == [8, 10, 13, 18] and c.output_ids == [9, 11, 14, 19]
    assert [s.num_computed for s in sched.slots] == [7, 8, 7] and not sched.in_flight


@pytest.mark.parametrize("passes", [False, True])
def test_a_drafted_slot_goes_on_as_a_hedge(passes):
    """With `hedge`, slot 0 does not sit out the window built ahead of its drafted one: it
    goes on there as if its draft failed, one token on from its last known one, that token
    from the device (what its window in flight decides for it). If the draft fails, that
    entry is the slot's next step; if it passes, the entry is void: its result is dropped
    at commit, and the window built next takes the slot with its tokens known."""
    a, b, c = make(3, max_tokens=20), make(5, max_tokens=20), make(4, max_tokens=20)
    sched = Scheduler(num_slots=3, max_context=64, max_window_tokens=32, block_size=4,
                      drafts=DraftPolicy([DraftsFor(a)], token_cost=0.05), ahead=True,
                      window_cost=0.4, hedge=True)
    for r in (a, b, c):
        sched.add(r)
    prompts = sched.schedule()
    guessed = sched.schedule_ahead()  # slot 0: its token in flight, then the draft [51]
    sched.commit(prompts, [[50], [8], [9]])
    hedged = sched.schedule_ahead()
    assert hedged.header.slots == [0, 1, 2] and hedged.header.query_lens == [1, 1, 1]
    assert hedged.hedges == [True, False, False] and hedged.header.num_drafts == [0, 0, 0]
    assert hedged.header.positions.tolist() == [4, 6, 5]  # slot 0: one on from 50 at 3
    assert hedged.header.carry_rows == [0, 1, 2] and hedged.header.carry_from == [0, 1, 2]
    assert hedged.header.carry_first == [51, -1, -1]  # its draft in flight
    if passes:
        sched.commit(guessed, [[51, 12], [10], [11]])  # its draft passes: the hedge is void
        back = sched.schedule_ahead()  # slot 0 again, its token (12) known here
        assert back.header.slots == [0, 1, 2] and back.header.starts[0] == 5
        assert back.header.token_ids.tolist()[:3] == [12, 50, 51]
        sched.commit(hedged, [[99], [13], [14]])  # 99: the void entry's, dropped
        assert (sched.hedges_taken, sched.hedges_void) == (0, 1)
        sched.commit(back, [[50, 17], [18], [19]])
        assert a.output_ids == [50, 51, 12, 50, 17]
        assert [s.num_computed for s in sched.slots] == [7, 8, 7]
    else:
        sched.commit(guessed, [[12], [10], [11]])  # its draft fails: 12 at position 4
        sched.commit(hedged, [[13], [14], [15]])  # ...and the hedge computed it: 13 next
        assert (sched.hedges_taken, sched.hedges_void) == (1, 0)
        assert a.output_ids == [50, 12, 13]
        assert [s.num_computed for s in sched.slots] == [5, 7, 6]
    assert b.output_ids == ([8, 10, 13, 18] if passes else [8, 10, 14]) and not sched.in_flight


def test_no_window_ahead_where_every_slot_would_draft_on_a_guess():
    """With no other slot to carry on, nothing is built ahead of a drafted window, nor of
    one whose slots would all draft on a guess: the next window drafts on their real
    tokens, and no slot waits for it."""
    a = make(3, max_tokens=20)
    sched = Scheduler(num_slots=1, max_context=64, max_window_tokens=32, block_size=4,
                      drafts=DraftPolicy([DraftsFor(a)], token_cost=0.05), ahead=True,
                      window_cost=0.4)
    sched.add(a)
    prompt = sched.schedule()
    assert sched.schedule_ahead() is None and sched.slots[0].draft is None
    sched.commit(prompt, [[7]])
    drafted = sched.schedule()
    assert drafted.header.num_drafts == [2] and sched.schedule_ahead() is None


def run(engine: Engine, batch: list[list[int]], params: list[SamplingParams],
        eos: frozenset[int], ahead: list | None = None) -> tuple[list[list[int]], int]:
    """Output ids, and how many windows carried their tokens over (their headers in
    `ahead`)."""
    carried = 0
    submit = engine.runner.submit

    def counting(window):
        nonlocal carried
        carried += window.header.carry
        if ahead is not None and window.header.carry:
            ahead.append(window.header)
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


@pytest.mark.parametrize("buckets,hedge", [(False, "on"), (True, "on"), (False, "off")])
def test_drafts_and_windows_ahead_take_turns(tiny_models, buckets, hedge):
    """Two of four requests draft (their greedy continuation, some tokens wrong): slots
    draft where a draft is worth the window they sit out, the others go on in windows
    built ahead, and every greedy token is as without drafts. Windows built ahead carry
    slots back with drafts after their known token beside carried ones, and carried slots
    with drafts after a guess of their token. `buckets`: windows padded to graph buckets
    with static buffers (triton, interpreted), whose first stage puts the carried tokens
    in place itself. `hedge`: drafted slots go on as hedges beside carried ones (void ones
    among them), or sit those windows out."""
    folder, model = tiny_models["llama"]
    batch = prompts(4, model.config.vocab_size, seed=11, low=6, high=14)
    greedy = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    config = EngineConfig(model=str(folder), parallel=4, max_context=160, spec=8,
                          schedule_ahead="on", spec_hedge=hedge)
    plain, _ = run(Engine(dataclasses.replace(config, spec=0, schedule_ahead="off")), batch,
                   greedy, frozenset())
    engine = Engine(dataclasses.replace(config, attention_backend="triton") if buckets
                    else config)
    engine.scheduler.drafts.proposers = [Oracle(batch[:2], plain[:2], seed=11)]
    scattered = []
    if buckets:
        from test_buckets import padded_everywhere
        padded_everywhere(engine, [1, 2, 4, 8, 16, 24], max_logits=24)
        graphs = engine.runner.stages[0].graphs
        replay = graphs.replay

        def spied(x, call):
            if call.num_carried and not call.carried_in_order:
                scattered.append(call)
            return replay(x, call)

        graphs.replay = spied
    ahead = []
    drafted, carried = run(engine, batch, greedy, frozenset(), ahead)
    assert drafted == plain
    stats = engine.draft_stats
    assert carried > 0 and stats.accepted > 0 and stats.drafted > stats.accepted
    known, guessed = drafts_ahead(ahead)
    assert known > 0 and guessed > 0
    taken, void = engine.scheduler.hedges_taken, engine.scheduler.hedges_void
    assert (taken > 0 and void > 0) if hedge == "on" else taken == void == 0
    assert len(scattered) > 0 or not buckets  # carried tokens put in place among others


def test_void_hedges_rewrite_what_their_window_wrote(tiny_models):
    """Three of four requests draft for 80 tokens: many hedges are void (a draft before
    them passed), and each wrote its position's KV again. It must write the token that is
    there (the accepted draft), not the one decided after the accepted drafts: every
    greedy token is as without drafts (taking the latter changes tokens here)."""
    folder, model = tiny_models["llama"]
    batch = prompts(4, model.config.vocab_size, seed=11, low=6, high=14)
    greedy = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)] * 4
    config = EngineConfig(model=str(folder), parallel=4, max_context=200, spec=8,
                          schedule_ahead="on", spec_hedge="on")
    plain, _ = run(Engine(dataclasses.replace(config, spec=0, schedule_ahead="off")), batch,
                   greedy, frozenset())
    engine = Engine(config)
    engine.scheduler.drafts.proposers = [Oracle(batch[:3], plain[:3], seed=11)]
    drafted, _ = run(engine, batch, greedy, frozenset())
    assert drafted == plain
    assert engine.scheduler.hedges_taken > 5 and engine.scheduler.hedges_void > 20


def test_seeded_sampling_is_the_same_with_hedges(tiny_models):
    """Seeded sampling with drafts: a hedge draws its token with the generator of its
    position, as the window after a slot's sat-out one would, so the tokens are the same
    with hedges and without."""
    folder, model = tiny_models["llama"]
    batch = prompts(4, model.config.vocab_size, seed=12, low=6, high=14)
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=50, ignore_eos=True)
              for i in range(4)]
    config = EngineConfig(model=str(folder), parallel=4, max_context=200, spec=8,
                          schedule_ahead="on")
    plain, _ = run(Engine(dataclasses.replace(config, spec=0, schedule_ahead="off")), batch,
                   seeded, frozenset())
    outputs, void = [], []
    for hedge in ("on", "off"):
        engine = Engine(dataclasses.replace(config, spec_hedge=hedge))
        engine.scheduler.drafts.proposers = [Oracle(batch[:3], plain[:3], seed=12)]
        outputs.append(run(engine, batch, seeded, frozenset())[0])
        void.append(engine.scheduler.hedges_void + engine.scheduler.hedges_taken)
    assert outputs[0] == outputs[1] and void[0] > 10 and void[1] == 0


def drafts_ahead(headers: list) -> tuple[int, int]:
    """Entries with drafts in windows built ahead: after a token known on the host, and
    after a carried token (drafted on a guess of it)."""
    known = guessed = 0
    for h in headers:
        firsts = [sum(h.query_lens[:e]) for e in range(len(h.slots))]
        for first, drafts in zip(firsts, h.num_drafts):
            if drafts:
                guessed += first in h.carry_rows
                known += first not in h.carry_rows
    return known, guessed


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
    # A draft guessing the token in flight (known=1): only its later tokens are gain, and
    # only they are sent.
    after = policy.draft(request, 8, window_cost=0.2, known=1)  # 0.2 + 0.05
    assert after.tokens == [2, 3] and after.scores == [0.25, 0.1] and after.after_guess
    assert policy.draft(request, 8, window_cost=0.3, known=1) is None
    assert policy.draft(request, 1, known=1) is None  # nothing after the guess


def test_a_draft_on_a_guess_counts_only_what_follows_it():
    """A carried slot drafts in the window built ahead on a draft whose first token
    guesses its token in flight: the policy is asked to count only the tokens after it,
    against the one window the slot sits out after, with room for one token fewer (the
    one in flight)."""
    from strata.drafting.policy import DraftPolicy

    class Quiet:
        name, on_last_stage = "quiet", False

        def start(self, request_id, prompt): pass
        def extend(self, request_id, tokens, stage_drafts=None): pass
        def finish(self, request_id): pass

    asked = []

    class Recording(DraftPolicy):
        def draft(self, request, room, window_cost=0.0, known=0, window_tokens=1, slots=1):
            asked.append((window_cost, known, room))
            return None

    sched = Scheduler(num_slots=2, max_context=32, max_window_tokens=16, block_size=4,
                      drafts=Recording([Quiet()], 0.05), ahead=True, window_cost=1.5)
    sched.add(make(3, max_tokens=8))
    sched.add(make(4, max_tokens=20))
    prompt = sched.schedule()
    sched.commit(prompt, [[7], [7]])
    asked.clear()
    decoding = sched.schedule()
    assert decoding.header.query_lens == [1, 1] and asked == [(1.5, 0, 6), (1.5, 0, 14)]
    asked.clear()
    ahead = sched.schedule_ahead()
    assert ahead is not None and ahead.header.carry_rows == [0, 1]
    # the guess and 5 drafts: 1 output, 1 in flight, 5 accepted and one more make 8;
    # the second: the guess and 15 drafts fill the 16-token budget
    assert asked == [(1.5, 1, 6), (1.5, 1, 15)]


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
