"""Routed experts in host RAM behind a VRAM cache (--experts-in-ram, strata/experts):
the policy's bookkeeping (admission, LRU and frequency-weighted eviction, a window's
union kept whole, uploads in flight neither read nor evicted); the cache's protocol on a
CPU stand-in for the device (bytes in their slots, rows pointing at slots or host rows,
counts observed at the residency a window ran with); the fused kernels reading hits from
the pool and misses from host rows (triton's interpreter) give the very same numbers as
without a cache, dense and quantized; and whole models: greedy output with a cache of a
quarter of the experts equals output with all of them on the device, with drafts, 1 and 4
requests at once, in one process and in two stage processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_moe_triton import grouped_experts, routing, window
from test_moe_triton_quant import keep_quantized, quantized_experts
from test_spec_lossless import copy_heavy_prompts

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.experts.cache import ExpertCache, ExpertCaches
from strata.experts.policy import ExpertCachePolicy
from strata.layers.moe import GroupedExperts
from strata.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def used(layers: int, experts: int, pairs: dict[tuple[int, int], int]) -> np.ndarray:
    out = np.zeros((layers, experts), dtype=np.int64)
    for (layer, expert), n in pairs.items():
        out[layer, expert] = n
    return out


# -- the policy ---------------------------------------------------------------------------

def test_fill_gives_each_layer_an_equal_share():
    policy = ExpertCachePolicy(3, 8, 6)
    admissions = policy.fill()
    assert sorted(a.slot for a in admissions) == list(range(6))
    policy.uploaded([a.key for a in admissions])
    assert policy.resident.sum(axis=1).tolist() == [2, 2, 2]
    assert policy.fill() == []  # no free slot left


def test_observe_counts_hits_and_misses_at_the_residency_the_window_ran_with():
    policy = ExpertCachePolicy(2, 4, 2)
    policy.uploaded([a.key for a in policy.fill()])  # experts 0 of layers 0 and 1
    then = policy.resident.copy()
    reads = policy.observe(used(2, 4, {(0, 0): 3, (0, 2): 1, (1, 3): 5}), then)
    assert (reads.hits, reads.misses) == (1, 2)
    assert reads.missed.tolist() == [7, 2]  # most used first: (1, 3), then (0, 2)


def test_lru_evicts_the_least_recently_used_never_the_last_windows_experts():
    policy = ExpertCachePolicy(1, 6, 2)
    policy.uploaded([a.key for a in policy.fill()])  # experts 0, 1
    policy.observe(used(1, 6, {(0, 0): 1}), policy.resident.copy())
    reads = policy.observe(used(1, 6, {(0, 1): 1, (0, 4): 1}), policy.resident.copy())
    admissions = policy.admit(reads.missed)
    assert [(a.key, a.victim) for a in admissions] == [(4, 0)]  # 1 was just used: kept
    assert not policy.resident[0, 4] and policy.slot[0, 4] == admissions[0].slot
    assert policy.slot[0, 0] == -1  # the victim holds nothing at once
    # a window using more experts than there are slots keeps what it used resident
    reads = policy.observe(used(1, 6, {(0, 1): 1, (0, 2): 1, (0, 3): 1}),
                           policy.resident.copy())
    assert policy.admit(reads.missed) == []  # 1 is used, 4 is uploading: no victim


def test_uploads_in_flight_are_neither_read_nor_evicted_and_limit_caps_admissions():
    policy = ExpertCachePolicy(1, 8, 3)
    policy.uploaded([a.key for a in policy.fill()])  # 0, 1, 2
    reads = policy.observe(used(1, 8, {(0, 5): 1, (0, 6): 1, (0, 7): 1}),
                           policy.resident.copy())
    admissions = policy.admit(reads.missed, limit=2)
    assert len(admissions) == 2
    keys = [a.key for a in admissions]
    assert not policy.resident[0, keys].any()
    reads = policy.observe(used(1, 8, {(0, 3): 1}), policy.resident.copy())
    third = policy.admit(reads.missed)
    assert [a.victim for a in third] not in ([k] for k in keys)
    assert all(a.victim not in keys for a in third)
    policy.uploaded(keys)
    assert policy.resident[0, keys].all()
    assert policy.admit(np.array([4]), limit=0) == []


def test_reserve_evicts_ahead_and_draining_slots_wait_until_drained():
    policy = ExpertCachePolicy(1, 8, 3)
    policy.uploaded([a.key for a in policy.fill()])  # 0, 1, 2
    policy.observe(used(1, 8, {(0, 0): 1}), policy.resident.copy())
    draining = policy.reserve(2)
    assert sorted(policy.owner[draining].tolist()) == [-2, -2]
    assert policy.resident[0].tolist()[:3] == [True, False, False]  # 0 was just used
    assert policy.reserve(2) == []  # two are on their way already
    assert policy.admit(np.array([5])) == []  # draining slots are not given out
    policy.drained(draining)
    (admission,) = policy.admit(np.array([5]))
    assert admission.victim == -1 and admission.slot in draining


def test_lfu_keeps_hot_experts_against_a_burst_of_cold_ones():
    for name, keeps_hot in (("lfu", True), ("lru", False)):
        policy = ExpertCachePolicy(1, 16, 2, name)
        policy.uploaded([a.key for a in policy.fill()])  # 0, 1: hot
        for _ in range(10):
            policy.observe(used(1, 16, {(0, 0): 4, (0, 1): 4}), policy.resident.copy())
        for cold in range(2, 8):  # one-off experts, one a window
            reads = policy.observe(used(1, 16, {(0, cold): 1}), policy.resident.copy())
            policy.uploaded([a.key for a in policy.admit(reads.missed)])
        assert bool(policy.resident[0, :2].all()) is keeps_hot, name


def test_a_bad_policy_or_size_is_a_clear_error():
    with pytest.raises(ValueError, match="lru, lfu"):
        ExpertCachePolicy(1, 4, 1, "fifo")
    with pytest.raises(StrataError, match="--expert-cache 120%"):
        EngineConfig(expert_cache="120%")
    with pytest.raises(StrataError, match="--expert-cache lots"):
        EngineConfig(expert_cache="lots")
    assert EngineConfig(expert_cache="25%").expert_cache_size() == ("share", 0.25)
    assert EngineConfig(expert_cache="1.5GiB").expert_cache_size() == ("bytes", 1.5 * 2**30)
    with pytest.raises(StrataError, match="--pcie-frac"):
        EngineConfig(pcie_frac=-1)


# -- the cache on a CPU stand-in for the device -------------------------------------------

def dense_layers(n: int, experts: int = 8, hidden: int = 32, inter: int = 16):
    return [grouped_experts(experts, hidden, inter, seed=i) for i in range(n)]


def quantized_layers(n: int, experts: int = 8, hidden: int = 64, inter: int = 32):
    layers = []
    for i in range(n):
        layers.append(keep_quantized(
            GroupedExperts(hidden, inter, experts, quantized=True),
            quantized_experts(("Q8_0", "Q4_0", "Q8_0"), experts, hidden, inter, seed=3 * i)))
    return layers


def originals(layers) -> list[list[torch.Tensor]]:
    return [[getattr(m, n).detach().clone() for n in ("gate_proj", "up_proj", "down_proj")]
            for m in layers]


def test_cache_bytes_rows_and_protocol():
    layers = dense_layers(3)
    before = originals(layers)
    cache = ExpertCache(layers, torch.device("cpu"), 6)
    for m, weights in zip(layers, before):  # the projections now view host rows
        assert m.offload is not None
        for name, w in zip(("gate_proj", "up_proj", "down_proj"), weights):
            assert torch.equal(getattr(m, name), w)

    def check_bytes():
        for layer, weights in enumerate(before):
            gathered = cache.gather(layer, list(range(8)))
            for part, w in enumerate(weights):
                assert torch.equal(gathered[part], w)
        resident = cache.policy.resident
        for layer in range(3):
            for expert in range(8):
                row = cache.rows_host[layer, expert]
                if resident[layer, expert]:
                    slot = cache.policy.slot[layer, expert]
                    assert row == slot and torch.equal(cache.pool[slot][:16 * 32],
                                                       before[layer][0][expert].reshape(-1))
                else:
                    assert row == cache.host_rows[layer, expert]
        assert torch.equal(cache.rows, torch.from_numpy(cache.rows_host))

    check_bytes()
    assert cache.policy.resident.sum() == 6
    # windows routing layer 0 to experts 5, 6 and 7 over and over: admitted, then hits
    for _ in range(4):
        cache.before_window()
        x = window(2, 32)
        experts = torch.tensor([[5, 6], [7, 5]])
        weights = torch.full((2, 2), 0.5)
        layers[0](x, experts, weights)
        cache.after_window()
        check_bytes()
    cache.before_window()
    assert cache.policy.resident[0, 5:].all()
    # window 1 misses; its misses are admitted when window 2 starts and read from their
    # slots once their upload is seen done, when window 3 starts
    stats = cache.stats
    assert stats.misses == 6 and stats.hits == 6
    assert stats.read_bytes == 6 * cache.expert_bytes
    assert stats.upload_bytes == 3 * cache.expert_bytes
    assert cache.take_stats()[:2] == [6, 6] and cache.take_stats()[:2] == [0, 0]


def test_a_miss_hits_from_the_next_window_when_a_slot_is_free():
    """Misses into free slots are read from VRAM by the very next window; into a
    victim's slot, from the one after. The reserve evicts ahead to keep slots free."""
    layers = dense_layers(2, experts=16)
    cache = ExpertCache(layers, torch.device("cpu"), 16)  # experts 0..7 of each layer
    x = window(2, 32)
    weights = torch.full((2, 2), 0.5)

    def step(experts) -> float:
        cache.before_window()
        layers[0](x, torch.tensor(experts), weights)
        cache.after_window()
        return cache.stats.misses

    step([[0, 1], [2, 3]])
    step([[8, 9], [0, 1]])    # 8, 9 miss
    step([[8, 9], [0, 1]])    # admitted into victims' slots; 2 more evicted ahead
    step([[10, 11], [0, 1]])  # 8, 9 in their slots; 10, 11 miss
    assert cache.policy.resident[0, [8, 9]].all()
    assert (cache.policy.owner == -1).sum() == 2  # the reserve, drained
    misses = step([[10, 11], [0, 1]])  # 10, 11 took the free slots: they hit
    cache.before_window()
    assert cache.stats.misses == misses
    assert cache.policy.resident[0, [10, 11]].all()


@pytest.mark.parametrize("kind", ["dense", "quantized"])
@pytest.mark.parametrize("path", ["grouped", "fused"])
def test_cached_experts_compute_exactly_what_resident_ones_do(kind, path):
    """Hits from the pool, misses from host rows (by address, in the fused kernels): the
    same numbers, bit for bit, as the same path without a cache."""
    if path == "fused":
        pytest.importorskip("triton")
    make, hidden = (dense_layers, 32) if kind == "dense" else (quantized_layers, 64)
    plain, cached = make(2), make(2)
    cache = ExpertCache(cached, torch.device("cpu"), 5)
    assert 0 < cache.policy.resident.sum() < 16
    for m in (*plain, *cached):
        m.path = path
    for tokens, top_k in ((1, 3), (4, 2), (9, 4)):
        x = window(tokens, hidden, seed=tokens)
        experts, weights = routing(tokens, top_k, 8, seed=tokens + top_k)
        for a, b in zip(plain, cached):
            assert torch.equal(a(x, experts, weights), b(x, experts, weights))
    usage = cache.usage.sum(dim=1).tolist()
    assert usage == [1 * 3 + 4 * 2 + 9 * 4] * 2  # every pair counted, both paths


@pytest.mark.parametrize("host_first", [True, False], ids=["host-before-pool", "after"])
def test_the_kernels_read_host_rows_on_either_side_of_the_pool(host_first):
    """Rows relative to the pool, negative where host memory lies before it: every
    format's fused kernels (the decode row kernels too) read the same bytes."""
    pytest.importorskip("triton")
    from strata.layers.moe_triton import fused_experts, fused_experts_quantized
    for layer in (dense_layers(1)[0], quantized_layers(1)[0]):
        weights = [getattr(layer, n).detach() for n in ("gate_proj", "up_proj", "down_proj")]
        flat = [w.reshape(8, -1) for w in weights]
        row = sum(f.shape[1] for f in flat)
        buffer = torch.zeros(20 * row, dtype=flat[0].dtype)
        host, pool = (buffer[:8 * row], buffer[12 * row:]) if host_first else \
            (buffer[12 * row:], buffer[:8 * row])
        host.view(8, row).copy_(torch.cat(flat, dim=1))
        offset = (host.data_ptr() - pool.data_ptr()) // (row * buffer.element_size())
        assert (offset < 0) == host_first
        pool.view(8, row)[1] = host.view(8, row)[5]  # expert 5 resident in slot 1
        rows = torch.arange(8) + offset
        rows[5] = 1
        views, start = [], 0
        for w, f in zip(weights, flat):
            views.append(pool.view(8, row)[:, start:start + f.shape[1]].view(w.shape))
            start += f.shape[1]
        hidden = weights[0].shape[2] if weights[0].dtype != torch.uint8 else 64
        for tokens in (1, 4, 9):
            x = window(tokens, hidden, seed=tokens)
            experts, routed = routing(tokens, 3, 8, seed=tokens)
            if weights[0].dtype == torch.uint8:
                qtypes = [w.qtype for w in (layer.gate_proj, layer.up_proj, layer.down_proj)]
                ours = fused_experts_quantized(x, experts, routed, *zip(views, qtypes),
                                               rows=rows)
                ref = fused_experts_quantized(x, experts, routed, *zip(weights, qtypes))
            else:
                ours = fused_experts(x, experts, routed, *views, rows=rows)
                ref = fused_experts(x, experts, routed, *weights)
            assert torch.equal(ours, ref), (tokens, weights[0].dtype)


def test_layers_of_different_formats_get_a_cache_each():
    """A GGUF may keep some layers' experts in other formats (Q4_K_M: half the layers'
    down projections in Q6_K): one cache per kind, the VRAM shared out by bytes."""
    plain = [*dense_layers(1), *quantized_layers(2)]
    layers = [*dense_layers(1), *quantized_layers(2)]
    caches = ExpertCaches(layers, torch.device("cpu"), ("share", 0.5))
    assert len(caches.caches) == 2
    assert [c.total_experts for c in caches.caches] == [8, 16]
    assert [int(c.policy.resident.sum()) for c in caches.caches] == [4, 8]
    everything = sum(c.total_experts * c.expert_bytes for c in caches.caches)
    sizes = ExpertCaches([*dense_layers(1), *quantized_layers(2)], torch.device("cpu"),
                         ("bytes", everything / 2))  # half the bytes: half of each kind
    assert [c.pool.shape[0] for c in sizes.caches] == [4, 8]
    for a, b, hidden in zip(plain, layers, (32, 64, 64)):
        x = window(3, hidden)
        experts, weights = routing(3, 2, 8)
        assert torch.equal(a(x, experts, weights), b(x, experts, weights))
    with pytest.raises(ValueError, match="one kind"):
        ExpertCache([*dense_layers(1), *quantized_layers(1)], torch.device("cpu"), 2)


def test_pool_contents_matter():
    """The check above can fail: a slot holding the wrong bytes changes the output."""
    layers = dense_layers(1)
    cache = ExpertCache(layers, torch.device("cpu"), 4)
    x = window(3, 32)
    experts = torch.tensor([[0, 1], [2, 3], [1, 0]])
    weights = torch.full((3, 2), 0.5)
    good = layers[0](x, experts, weights)
    cache.pool[0].mul_(2)
    assert not torch.equal(layers[0](x, experts, weights), good)


# -- whole models ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_expected(tiny_models):
    folder, model = tiny_models["qwen3_moe"]
    prompts = copy_heavy_prompts(4, model.config.vocab_size)
    engine = Engine(EngineConfig(model=str(folder), parallel=4, spec=0, max_context=256))
    return folder, prompts, engine.generate(prompts, GREEDY)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_greedy_output_with_a_quarter_of_the_experts_cached_equals_all_resident(
        moe_expected, policy):
    folder, prompts, expected = moe_expected
    for parallel, batch in ((1, prompts[:1]), (4, prompts)):
        engine = Engine(EngineConfig(model=str(folder), parallel=parallel, spec=6,
                                     max_context=256, experts_in_ram="on",
                                     expert_cache="25%", expert_cache_policy=policy))
        assert engine.generate(batch, GREEDY) == expected[:len(batch)]
        assert engine.draft_stats.accepted > 0
        stats = engine.expert_stats[0]
        assert stats.hits > 0 and stats.misses > 0, stats
        (cache,) = engine.runner.stages[0].experts.caches
        assert cache.policy.num_slots == round(0.25 * cache.total_experts)
        held = int((cache.policy.slot >= 0).sum())  # the rest free, evicted ahead
        assert cache.policy.num_slots - max(1, cache.policy.num_slots // 8) <= held
        if policy == "lru" and parallel == 1:
            assert stats.upload_bytes > 0  # the cache changed as it went


def test_an_auto_sized_cache_on_a_cpu_stage_holds_every_expert(moe_expected):
    folder, prompts, expected = moe_expected
    engine = Engine(EngineConfig(model=str(folder), parallel=1, spec=0, max_context=256,
                                 experts_in_ram="on", expert_cache="auto"))
    (cache,) = engine.runner.stages[0].experts.caches
    assert cache.policy.resident.all()
    assert engine.generate(prompts[:1], GREEDY) == expected[:1]
    assert engine.expert_stats[0].misses == 0


def test_greedy_output_in_two_stage_processes_with_experts_in_ram(moe_expected):
    folder, prompts, expected = moe_expected
    engine = Engine(EngineConfig(model=str(folder), parallel=4, spec=6, max_context=256,
                                 devices=("cpu", "cpu"), layer_split=(2,),
                                 experts_in_ram="on", expert_cache="25%"))
    try:
        assert engine.generate(prompts, GREEDY) == expected
        assert engine.generate(prompts[:1], GREEDY) == expected[:1]
        stats = engine.expert_stats
        assert all(s.hits + s.misses > 0 for s in stats), stats  # both stages report
        assert all(s.misses > 0 for s in stats)
    finally:
        engine.close()
