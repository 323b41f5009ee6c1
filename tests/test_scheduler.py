"""The scheduler counts: block pool and tables, admission, chunked prefill beside decode
tokens, commit, abort. Uses no model."""

from __future__ import annotations

import pytest
import torch

from strata.engine.request import Request
from strata.kvcache.block_pool import BlockPool, BlockTable
from strata.sampling.params import SamplingParams
from strata.scheduler.scheduler import Scheduler


def test_block_table_rows_follow_blocks():
    pool = BlockPool(num_blocks=8, block_size=4)
    a, b = BlockTable(pool), BlockTable(pool)
    a.ensure(3)
    b.ensure(5)
    a.ensure(9)
    assert a.blocks == [0, 3, 4] and b.blocks == [1, 2]
    assert a.rows(2, 7).tolist() == [2, 3, 12, 13, 14]
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
    assert w1.query_lens == [8] and w1.samples == [False]
    assert w1.positions.tolist() == list(range(8))
    sched.commit(w1, [])
    sched.add(short)
    w2 = sched.schedule()  # both are prompts: slot order
    assert w2.query_lens == [8] and w2.requests == [long]
    sched.commit(w2, [])
    w3 = sched.schedule()  # two prompt chunks, in slot order
    assert w3.requests == [long, short] and w3.query_lens == [4, 2]
    assert w3.samples == [True, True]
    sched.commit(w3, [9, 7])
    assert short.output_ids == [7] and long.output_ids == [9]
    sched.add(make(30))
    w4 = sched.schedule()  # both decoding: one token each at their next positions; no slot left
    assert w4.query_lens == [1, 1]
    assert w4.positions.tolist() == [20, 2]
    assert w4.token_ids.tolist() == [9, 7]


def test_requests_wait_for_a_free_slot_and_finish_frees_it():
    sched = Scheduler(num_slots=1, max_context=32, max_window_tokens=16, block_size=4)
    first, second = make(3, max_tokens=1), make(3, max_tokens=1)
    sched.add(first)
    sched.add(second)
    window = sched.schedule()
    assert window.requests == [first]
    sched.commit(window, [5])
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
    sched.commit(window, [4, 6])
    assert a.output_ids == [] and b.output_ids == [6]


def test_context_limit_finishes_with_length():
    sched = Scheduler(num_slots=1, max_context=6, max_window_tokens=16, block_size=4)
    request = Request([1, 2, 3, 4], SamplingParams(temperature=0))
    sched.add(request)
    for token in (8, 9):
        sched.commit(sched.schedule(), [token])
    assert request.finished and request.finish_reason == "length"
    assert request.num_tokens == 6


def test_slot_mapping_is_position_rows():
    sched = Scheduler(num_slots=2, max_context=32, max_window_tokens=64, block_size=4)
    a, b = make(6), make(5)
    sched.add(a)
    sched.add(b)
    w = sched.schedule()
    expected = torch.cat([sched.slots[0].block_table.rows(0, 6), sched.slots[1].block_table.rows(0, 5)])
    assert torch.equal(w.slot_mapping, expected)
    assert set(w.slot_mapping[:6].tolist()).isdisjoint(w.slot_mapping[6:].tolist())


def test_decoding_slot_goes_before_an_earlier_slots_prompt():
    sched = Scheduler(num_slots=2, max_context=64, max_window_tokens=4, block_size=4)
    a, b = make(2, max_tokens=1), make(2, max_tokens=5)
    sched.add(a)
    sched.add(b)
    sched.commit(sched.schedule(), [3, 4])
    assert a.finished and not b.finished
    c = make(20)
    sched.add(c)  # takes slot 0, freed by a
    window = sched.schedule()
    assert window.slots == [1, 0] and window.requests == [b, c]
    assert window.query_lens == [1, 3] and window.samples == [True, False]
