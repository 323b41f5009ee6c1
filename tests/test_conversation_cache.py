"""The conversation cache (--conversation-cache-mib): finished requests' blocks, evicted
from the device pool, are copied to host RAM when a remembered conversation holds them,
and a later turn copies them back instead of computing them — byte for byte, with the
same output (greedy with drafts; one process and stage processes)."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.kvcache.block_pool import BlockPool
from strata.kvcache.host import HostCache
from strata.kvcache.prefix import prompt_keys
from strata.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


# -- the bookkeeping --------------------------------------------------------------------------
def keys(tokens: list[int], n: int) -> list[bytes]:
    return list(prompt_keys(tokens, 4, n))


def test_a_later_turn_replaces_the_conversation_it_continues():
    host = HostCache(num_blocks=8, max_conversations=2)
    turn1 = keys(list(range(8)), 2)
    turn2 = keys(list(range(16)), 4)  # the same first two blocks, then two more
    host.remember(turn1)
    host.remember(turn2)
    assert len(host.conversations) == 1 and list(host.conversations.values()) == [turn2]
    other = keys([9] * 8, 2)
    host.remember(other)
    host.remember(keys([7] * 8, 2))  # a third conversation: the least recently used goes
    assert turn2[0] not in host.holders and other[0] in host.holders


def test_blocks_spill_only_for_remembered_conversations_and_make_room_lru():
    host = HostCache(num_blocks=2, max_conversations=4)
    a, b = keys([1] * 8, 2), keys([2] * 8, 2)
    assert host.spill(a[0]) is None  # nobody remembers it
    host.remember(a)
    host.remember(b)
    first, second = host.spill(a[0]), host.spill(a[1])
    assert {first, second} == {0, 1} and host.spill(a[0]) is None  # there already
    host.touch(a[1])  # a was reused: b is the least recently used now
    assert host.spill(b[0]) is None  # room only by forgetting b itself: not copied
    assert host.lookup(a[0]) == first and list(host.conversations.values()) == [b, a]
    host.touch(b[0])  # now a is: it makes room
    assert host.spill(b[0]) in (0, 1) and host.lookup(a[0]) is None
    assert list(host.conversations.values()) == [b]


def test_a_host_block_read_by_a_pending_restore_is_not_handed_out():
    host = HostCache(num_blocks=1, max_conversations=1)
    a, b = keys([1] * 4, 1), keys([2] * 4, 1)
    host.remember(a)
    spot = host.spill(a[0])
    assert host.restore(a[0]) == spot
    host.remember(b)  # forgets a, whose block is still to be read
    assert host.spill(b[0]) is None
    host.settle()     # the restore is in a window now
    assert host.spill(b[0]) == spot


def test_the_pool_copies_evicted_blocks_out_and_back_in_order():
    pool = BlockPool(2, 4, prefix_cache=True, host=HostCache(4, 4))
    tokens = list(range(8))
    a_keys = keys(tokens, 2)
    blocks = pool.allocate(2)
    for block, key in zip(blocks, a_keys):
        pool.prefix.register(block, key)
    pool.host.remember(a_keys)
    pool.release(blocks)             # finished: cached and idle on the device
    fresh = pool.allocate(2)         # another request needs both: they are copied out
    assert sorted(fresh) == sorted(blocks) and len(pool.spills) == 2
    spills, restores = pool.take_moves()
    assert sorted(d for d, _ in spills) == sorted(fresh) and not restores
    hits = pool.cached_prefix(tokens + [99], 2)
    assert [b for _, b in hits] == [None, None]  # in host RAM only
    pool.release(fresh)
    taken = pool.take(hits)
    _, restores = pool.take_moves()
    assert [d for _, d in restores] == taken
    assert {h for h, _ in restores} == {h for _, h in spills}
    assert [pool.prefix.lookup(k) for k in a_keys] == taken


def test_flags_are_checked():
    with pytest.raises(StrataError, match="--conversation-cache-mib"):
        EngineConfig(conversation_cache_mib=-1)
    with pytest.raises(StrataError, match="--conversation-cache-slots"):
        EngineConfig(conversation_cache_slots=0)


# -- the engine -------------------------------------------------------------------------------
def engine(folder, **kw) -> Engine:
    return Engine(EngineConfig(model=str(folder), parallel=2, block_size=4, spec=6,
                               max_context=64, kv_tokens=64, stage_threads=1, **kw))


def agent_turns(vocab: int) -> tuple[list[int], list[list[int]]]:
    """A first turn with repeats (drafts pass and fail) and two unrelated requests that
    need the whole pool between turns."""
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, vocab, (6,), generator=g).tolist()
    others = [torch.randint(0, vocab, (40,), generator=g).tolist() for _ in range(2)]
    return base * 4, others


def kv_rows(e: Engine, blocks: list[int]) -> list[torch.Tensor]:
    size = e.scheduler.pool.block_size
    rows = torch.tensor([b * size + i for b in blocks for i in range(size)])
    return [torch.cat([c.key[rows], c.value[rows]]).clone()
            for stage in e.runner.stages for c in stage.caches]


def conversation(e: Engine, vocab: int, check_bytes: bool = False) -> list[list[int]]:
    first, others = agent_turns(vocab)
    out = e.generate([first], GREEDY)
    pool = e.scheduler.pool
    blocks = [pool.prefix.lookup(k) for k in keys(first + out[0], 6)] if check_bytes else []
    before = kv_rows(e, blocks) if check_bytes else None
    out += e.generate(others, GREEDY)  # the pool is full: the first turn's blocks leave
    second = first + out[0] + [3, 4, 5]
    request = e.add_request(second, GREEDY)
    e.step()
    if check_bytes:
        restored = e.scheduler.slots[0].block_table.blocks[:6]
        for a, b in zip(before, kv_rows(e, restored)):
            assert torch.equal(a, b)  # copied back byte for byte
    while e.has_work:
        e.step()
    return out + [request.output_ids, [request.num_cached_tokens]]


def test_a_later_turn_reads_its_blocks_back_from_host_ram(tiny_models):
    folder = tiny_models["llama"][0]
    reference = conversation(engine(folder, prefix_cache="off"), 320)
    without = conversation(engine(folder), 320)
    e = engine(folder, conversation_cache_mib=1)
    got = conversation(e, 320, check_bytes=True)
    assert got[:-1] == reference[:-1] == without[:-1]
    assert without[-1][0] == 0          # the device pool lost the first turn's blocks
    assert got[-1][0] >= 24             # they came back from host RAM
    assert e.scheduler.pool.host.restored_blocks >= 6
    assert e.draft_stats.accepted > 0


def test_stage_processes_copy_blocks_on_every_stage(tiny_models):
    folder = tiny_models["llama"][0]
    reference = conversation(engine(folder, prefix_cache="off"), 320)
    e = engine(folder, conversation_cache_mib=1, layer_split=(2,), devices=("cpu", "cpu"))
    try:
        got = conversation(e, 320)
    finally:
        e.close()
    assert got[:-1] == reference[:-1] and got[-1][0] >= 24


def test_a_stream_of_conversations_keeps_to_the_bounds(tiny_models):
    """Ten agents' two turns each, three at a time, through a device pool of three blocks
    and a host cache of one MiB for three conversations: every answer is what computing it
    gives, and the host cache never holds more than its blocks or conversations."""
    folder = tiny_models["llama"][0]
    g = torch.Generator().manual_seed(9)
    firsts = [torch.randint(0, 320, (70,), generator=g).tolist() for _ in range(10)]
    settings = dict(model=str(folder), parallel=1, block_size=64, max_context=192,
                    kv_tokens=192, spec=6, stage_threads=1)
    reference = Engine(EngineConfig(prefix_cache="off", **settings))
    e = Engine(EngineConfig(conversation_cache_mib=1, conversation_cache_slots=3, **settings))
    host, stage = e.scheduler.pool.host, e.runner.stages[0]
    assert stage.host_blocks.nbytes <= 2**20 and host.num_blocks == 16
    answers: dict[int, list[int]] = {}
    order = [(i, turn) for batch in (range(0, 3), range(3, 6), range(6, 9), range(9, 10))
             for turn in (1, 2) for i in batch]
    for i, turn in order:  # three conversations' first turns, then their second turns
        prompt = firsts[i] if turn == 1 else firsts[i] + answers[i] + [7, 8, 9]
        got, want = e.generate([prompt], GREEDY)[0], reference.generate([prompt], GREEDY)[0]
        assert got == want
        answers[i] = got
        assert len(host) <= host.num_blocks and len(host.conversations) <= 3
    assert host.restored_blocks > 0
