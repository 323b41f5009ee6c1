"""The scheduler counts: block pool and tables, admission, chunked prefill beside decode
tokens, commit, abort. Uses no model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.kvcache.block_pool import BlockPool, BlockTable, cache_rows
from strata.request import Request
from strata.sampling.params import SamplingParams
from strata.scheduler.scheduler import Scheduler


def test_block_table_rows_follow_blocks():
    pool = BlockPool(num_blocks=8, block_size=4)
    a, b = BlockTable(pool), BlockTable(pool)
    a.ensure(3)
    b.ensure(5)
    a.ensure(9)
    assert a.blocks == [0, 3, 4] and b.blocks == [1, 2]
    assert a.rows(2, 7) == [2, 3, 12, 13, 14]
    assert pool.num_free == 3
    a.clear()
    assert pool.num_free == 6 and a.blocks == []
    with pytest.raises(RuntimeError):
        b.ensure(8 * 4 + 1)


def make(n: int, max_tokens: int = 3) -> Request:
    return Request(list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens))


def test_decode_first_then_prompt_chunks_within_budget():
    sched = Scheduler(num_slots=2, max_context=64, max_window_tokens=8, block_size=4)
    long, short = make(20), make(2)
    sched.add(long)
    w1 = sched.schedule()
    assert w1.header.query_lens == [8] and w1.header.samples == [False]
    assert w1.header.positions.tolist() == list(range(8))
    sched.commit(w1, [])
    sched.add(short)
    w2 = sched.schedule()  # both are prompts: slot order
    assert w2.header.query_lens == [8] and w2.requests == [long]
    sched.commit(w2, [])
    w3 = sched.schedule()  # two prompt chunks, in slot order
    assert w3.requests == [long, short] and w3.header.query_lens == [4, 2]
    assert w3.header.samples == [True, True]
    sched.commit(w3, [[9], [7]])
    assert short.output_ids == [7] and long.output_ids == [9]
    sched.add(make(30))
    w4 = sched.schedule()  # both decoding: one token each at their next positions; no slot left
    assert w4.header.query_lens == [1, 1]
    assert w4.header.positions.tolist() == [20, 2]
    assert w4.header.token_ids.tolist() == [9, 7]


def test_requests_wait_for_a_free_slot_and_finish_frees_it():
    sched = Scheduler(num_slots=1, max_context=32, max_window_tokens=16, block_size=4)
    first, second = make(3, max_tokens=1), make(3, max_tokens=1)
    sched.add(first)
    sched.add(second)
    window = sched.schedule()
    assert window.requests == [first]
    sched.commit(window, [[5]])
    assert first.finished and first.finish_reason == "length"
    assert sched.pool.num_free == sched.pool.num_blocks
    window = sched.schedule()
    assert window.requests == [second]


def test_abort_while_in_flight_drops_the_result():
    sched = Scheduler(num_slots=2, max_context=32, max_window_tokens=16, block_size=4)
    a, b = make(3), make(3)
    sched.add(a)
    sched.add(b)
    window = sched.schedule()
    assert sched.abort(a.request_id) is a and a.finish_reason == "abort"
    sched.commit(window, [[4], [6]])
    assert a.output_ids == [] and b.output_ids == [6]


def test_context_limit_finishes_with_length():
    sched = Scheduler(num_slots=1, max_context=6, max_window_tokens=16, block_size=4)
    request = Request([1, 2, 3, 4], SamplingParams(temperature=0))
    sched.add(request)
    for token in (8, 9):
        sched.commit(sched.schedule(), [[token]])
    assert request.finished and request.finish_reason == "length"
    assert request.num_tokens == 6


def test_slot_mapping_is_position_rows():
    sched = Scheduler(num_slots=2, max_context=32, max_window_tokens=64, block_size=4)
    a, b = make(6), make(5)
    sched.add(a)
    sched.add(b)
    w = sched.schedule()
    expected = sched.slots[0].block_table.rows(0, 6) + sched.slots[1].block_table.rows(0, 5)
    assert w.header.slot_mapping.tolist() == expected
    assert set(w.header.slot_mapping[:6].tolist()).isdisjoint(w.header.slot_mapping[6:].tolist())


def test_decoding_slot_goes_before_an_earlier_slots_prompt():
    sched = Scheduler(num_slots=2, max_context=64, max_window_tokens=4, block_size=4)
    a, b = make(2, max_tokens=1), make(2, max_tokens=5)
    sched.add(a)
    sched.add(b)
    sched.commit(sched.schedule(), [[3], [4]])
    assert a.finished and not b.finished
    c = make(20)
    sched.add(c)  # takes slot 0, freed by a
    window = sched.schedule()
    assert window.header.slots == [1, 0] and window.requests == [b, c]
    assert window.header.query_lens == [1, 3] and window.header.samples == [True, False]


class FixedProposer:
    """Proposes the same continuation every window; records its lifecycle calls."""
    name = "fixed"
    on_last_stage = False

    def __init__(self, tokens, max_draft=4):
        self.tokens, self.max_draft, self.calls = tokens, max_draft, []

    def start(self, rid, prompt):
        self.calls.append(("start", rid, list(prompt)))

    def extend(self, rid, tokens, stage_drafts=None):
        self.calls.append(("extend", rid, list(tokens)))

    def propose(self, rid, max_tokens):
        from strata.drafting.draft import Draft
        tokens = self.tokens[:min(max_tokens, self.max_draft)]
        return Draft(tokens, [0.9] * len(tokens), self.name)

    def finish(self, rid):
        self.calls.append(("finish", rid))


def drafting_scheduler(tokens, **kw):
    from strata.drafting.policy import DraftPolicy
    proposer = FixedProposer(tokens)
    policy = DraftPolicy([proposer], token_cost=0.05)
    return Scheduler(num_slots=2, max_context=64, max_window_tokens=32, block_size=4,
                     drafts=policy, **kw), proposer


def test_drafts_are_tokens_and_rejection_rolls_back_by_position():
    sched, proposer = drafting_scheduler([50, 51, 52, 53, 54])
    request = make(5, max_tokens=20)
    sched.add(request)
    w1 = sched.schedule()  # prompt: no drafts yet
    assert w1.drafts == [None] and w1.header.query_lens == [5]
    sched.commit(w1, [[40]])
    w2 = sched.schedule()  # last token 40 at position 5, then 4 drafts (capped by --spec 4)
    assert w2.header.token_ids.tolist() == [40, 50, 51, 52, 53]
    assert w2.header.positions.tolist() == [5, 6, 7, 8, 9]
    assert w2.header.sample_rows.tolist() == [0, 1, 2, 3, 4]
    sched.commit(w2, [[50, 51, 60]])  # two drafts accepted, then a correction
    assert request.output_ids == [40, 50, 51, 60]
    assert sched.slots[0].num_computed == 8  # positions 5,6,7 hold 40,50,51; 8,9 are stale
    w3 = sched.schedule()
    assert w3.header.positions.tolist()[0] == 8 and w3.header.token_ids.tolist()[0] == 60
    assert torch.equal(w3.header.slot_mapping[:2], w2.header.slot_mapping[3:5])  # overwrites stale rows
    assert request.draft_stats.accepted == 2 and request.draft_stats.drafted == 4
    assert ("extend", request.request_id, [50, 51, 60]) in proposer.calls


def test_drafts_respect_max_tokens_and_finish_frees_proposer_state():
    sched, proposer = drafting_scheduler([50, 51, 52, 53])
    request = make(3, max_tokens=3)
    sched.add(request)
    sched.commit(sched.schedule(), [[40]])
    w2 = sched.schedule()
    assert len(w2.drafts[0].tokens) == 1  # two more tokens allowed: one draft plus one
    sched.commit(w2, [[50, 51]])
    assert request.finished and request.output_ids == [40, 50, 51]
    assert proposer.calls[-1] == ("finish", request.request_id)
    assert sched.pool.num_free == sched.pool.num_blocks


def test_eos_inside_accepted_drafts_stops_there():
    sched, _ = drafting_scheduler([50, 2, 52])
    request = Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=10),
                      eos_token_ids=frozenset({2}))
    sched.add(request)
    sched.commit(sched.schedule(), [[40]])
    sched.commit(sched.schedule(), [[50, 2, 52, 53]])
    assert request.output_ids == [40, 50, 2] and request.finish_reason == "stop"


def test_groups_pipeline_one_window_each_and_admit_into_the_scheduled_group():
    sched = Scheduler(num_slots=4, max_context=32, max_window_tokens=16, block_size=4,
                      num_groups=2)
    assert [[s.index for s in g] for g in sched.groups] == [[0, 2], [1, 3]]
    a, b, c = make(3), make(3), make(3)
    for request in (a, b, c):
        sched.add(request)
    w0 = sched.schedule()  # group 0 admits a and b into its slots 0 and 2
    assert w0.header.group == 0 and w0.header.slots == [0, 2] and w0.requests == [a, b]
    w1 = sched.schedule()  # group 1 admits c
    assert w1.header.group == 1 and w1.header.slots == [1] and w1.requests == [c]
    assert sched.schedule() is None  # both groups in flight
    sched.commit(w1, [[7]])
    w1 = sched.schedule()  # only group 1 is idle: c decodes at position 3
    assert w1.header.group == 1 and w1.header.positions.tolist() == [3] and w1.header.token_ids.tolist() == [7]
    assert sched.schedule() is None
    sched.commit(w0, [[5], [6]])
    assert sched.schedule().requests == [a, b]
    assert sched.has_work


def test_window_header_carries_what_the_last_stage_needs():
    sched = Scheduler(num_slots=2, max_context=64, max_window_tokens=6, block_size=4)
    long, short = make(9), make(2)
    sched.add(long)
    sched.add(short)
    window = sched.schedule()
    assert window.header.query_lens == [6] and window.header.samples == [False]
    assert window.header.following == [7] and window.header.verify == []  # 7 follows the chunk
    sched.commit(window, [])
    header = sched.schedule().header  # the rest of long, then all of short: both sample
    assert header.query_lens == [3, 2] and header.following == [None, None]
    assert [(e.request_id, e.position, e.draft) for e in header.verify] == [
        (long.request_id, 9, []), (short.request_id, 2, [])]
    assert "requests" not in vars(header)  # requests never travel to the stages


@settings(max_examples=100, deadline=None)
@given(blocks=st.lists(st.integers(0, 500), min_size=1, max_size=12, unique=True),
       size=st.integers(1, 16), data=st.data())
def test_block_table_rows_follow_the_cache_rows_formula(blocks, size, data):
    """The scheduler's rows, block by block on the host, are `cache_rows`' formula."""
    table = BlockTable(BlockPool(600, size))
    table.blocks = blocks
    end = data.draw(st.integers(0, len(blocks) * size))
    start = data.draw(st.integers(0, end))
    expected = cache_rows(torch.tensor(blocks), torch.arange(start, end), size).tolist()
    assert table.rows(start, end) == expected
