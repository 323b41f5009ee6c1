"""Prefetch one layer ahead (--expert-prefetch, strata/experts/prefetch.py): the policy
lends free slots to a window and takes back what it filled or left; on a CPU stand-in for
the device, a layer's prediction copies the next layer's predicted misses into lent slots
(most predicted first, as many as there are), points their rows there, and the next
window counts them resident and the prediction's recall, the output unchanged; slots lent
to windows whose counts arrive late all come back; the select and copy kernels (triton's
interpreter) do what the PyTorch steps do; whole models give the same greedy output with
prefetch on and off; and `strata calibrate --experts-in-ram on` measures --pcie-frac and
--expert-prefetch into the profile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_expert_cache import GREEDY, dense_layers, moe_expected, used  # noqa: F401
from test_moe_triton import window

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.experts.cache import ExpertCaches
from strata.experts.policy import DRAINING, FREE, LENT, ExpertCachePolicy


def freed(policy: ExpertCachePolicy, n: int) -> list[int]:
    """Evict n experts and let their slots drain: n free slots."""
    policy.observe(np.zeros((policy.num_layers, policy.num_experts)), policy.resident.copy())
    slots = policy.reserve(n)
    policy.drained(slots)
    return slots


def test_the_policy_lends_free_slots_and_takes_back_what_the_window_left():
    policy = ExpertCachePolicy(1, 8, 4)
    policy.uploaded([a.key for a in policy.fill()])  # experts 0..3
    assert policy.lend(2) == []  # nothing free
    free = freed(policy, 3)
    lent = policy.lend(2)
    assert len(lent) == 2 and (policy.owner[lent] == LENT).all()
    admissions = policy.admit(np.array([5, 7]))  # the free slot, then a victim's
    assert [a.victim for a in admissions] == [-1, 3]
    assert not {a.slot for a in admissions} & set(lent)  # lent slots are not given out
    assert policy.lend(1) == []
    assert policy.prefetched(6, lent[0])  # filled by the window: readable at once
    assert policy.resident[0, 6] and policy.slot[0, 6] == lent[0]
    policy.returned([lent[1]])  # left empty: free
    assert policy.owner[lent[1]] == FREE
    (again,) = policy.lend(1)
    assert not policy.prefetched(5, again)  # it holds a slot already: drain this one
    assert policy.owner[again] == DRAINING and policy.slot[0, 5] != again
    with pytest.raises(ValueError, match="not lent"):
        policy.prefetched(7, free[0])


def test_a_layer_prefetches_the_next_layers_predicted_misses_into_lent_slots():
    plain, layers = dense_layers(2), dense_layers(2)
    predictions = []  # what the fake router of layer 1 predicts, per call

    def predict(x):
        return predictions.pop(0)

    caches = ExpertCaches(layers, torch.device("cpu"), ("share", 0.5), prefetch=2,
                          predictors=[None, predict])
    (cache,) = caches.caches
    assert layers[0].offload.ahead is not None and layers[1].offload.ahead is None
    assert cache.prefetch.layers.tolist() == [False, True]  # layer 1 is predicted
    assert cache.policy.resident[1].tolist() == [True] * 4 + [False] * 4
    freed(cache.policy, 3)
    cache.before_window()
    assert len(cache.prefetch.lent) == 3
    x = window(2, 32)
    weights = torch.full((2, 2), 0.5)
    # layer 1 predicted to use 6 (twice), 5 and 2 (resident): 6 and 5 are the misses
    predictions.append(torch.tensor([[6, 5], [6, 2]]))
    routed = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[6, 7], [2, 6]])]
    for a, b, experts in zip(plain, layers, routed):
        assert torch.equal(a(x, experts, weights), b(x, experts, weights))
    record = cache.prefetch.record[1]
    assert record[0].tolist() == [6, 5]
    for expert, slot in zip(*record.tolist()):
        assert slot in cache.prefetch.lent
        assert cache.rows[1, expert] == slot  # the device's rows table points there
        assert torch.equal(cache.pool[slot], cache.hosts[1][expert])
    cache.after_window()
    cache.before_window()  # observes the window: its prefetches become the cache's
    assert cache.policy.resident[1, 6] and cache.rows_host[1, 6] == cache.policy.slot[1, 6]
    assert torch.equal(cache.rows, torch.from_numpy(cache.rows_host))
    stats = cache.stats
    assert (stats.prefetched, stats.prefetch_used) == (2, 1)  # 5 was not read
    # layer 1 read 2, 6, 7: 2 and 6 were predicted
    assert (stats.predicted_hits, stats.predicted_reads) == (2, 3)
    assert stats.recall == pytest.approx(2 / 3)
    assert (stats.hits, stats.misses) == (2, 4)  # layer 0's 0-2 were evicted; 6 hit
    assert "prefetch recall 67%" in stats.summary(1)


def test_lent_slots_come_back_when_counts_arrive_late():
    """Windows whose counts are not yet on the host (the device is behind): a full ring
    makes after_window observe them itself; every lent slot is taken over or freed."""
    layers = dense_layers(2, experts=16)  # experts 0-7 of each layer cached
    caches = ExpertCaches(layers, torch.device("cpu"), ("share", 0.5), prefetch=1,
                          predictors=[None, lambda x: torch.tensor([[9, 10], [11, 12]])])
    (cache,) = caches.caches
    late = True
    cache._done = lambda event: not late  # the windows' copies are not done yet
    for step in range(8):
        freed(cache.policy, 2)  # two lent to a window that fills one at most
        cache.before_window()
        layers[0](window(2, 32), torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), 0.5))
        layers[1](window(2, 32), torch.tensor([[9, 10], [2, 3]]), torch.full((2, 2), 0.5))
        late = step < 4  # window 5 starts with four unobserved, then finds the ring full
        cache.after_window()
    cache.before_window()
    assert not cache._counts
    lent = np.flatnonzero(cache.policy.owner == LENT).tolist()
    assert lent == sorted(cache.prefetch.lent)  # only those of the next window
    assert cache.stats.prefetched > 0
    held = cache.policy.slot[cache.policy.slot >= 0]
    assert len(set(held.tolist())) == len(held)  # no slot held twice


def test_the_most_predicted_misses_take_the_slots_there_are():
    for free, record in ((1, [[7, -1], [0, -1]]), (0, [[-1, -1], [-1, -1]])):
        layers = dense_layers(2)
        caches = ExpertCaches(layers, torch.device("cpu"), ("share", 0.5), prefetch=2,
                              predictors=[None, lambda x: torch.tensor([[4, 3], [7, 7]])])
        (cache,) = caches.caches
        slots = freed(cache.policy, free)
        cache.before_window()
        assert cache.prefetch.lent == slots
        layers[0](window(2, 32), torch.tensor([[0, 1], [0, 1]]), torch.full((2, 2), 0.5))
        if free:
            record[1][0] = slots[0]
        assert cache.prefetch.record[1].tolist() == record
        assert cache.prefetch.predicted[1, [3, 4, 7]].tolist() == [1, 1, 2]


def test_with_prefetch_off_nothing_is_predicted():
    off = dense_layers(2)
    caches = ExpertCaches(off, torch.device("cpu"), ("share", 0.5), prefetch=0,
                          predictors=[None, lambda x: torch.tensor([[6, 7]])])
    assert caches.caches[0].prefetch is None and off[0].offload.ahead is None
    with pytest.raises(StrataError, match="--expert-prefetch"):
        EngineConfig(expert_prefetch=-1)


def test_the_select_kernel_chooses_as_the_torch_steps_do():
    pytest.importorskip("triton")
    from strata.experts.prefetch import select_torch
    from strata.experts.prefetch_triton import select
    gen = torch.Generator().manual_seed(0)
    for experts, per_layer, lent, taken in ((8, 3, 5, 0), (16, 4, 2, 0), (40, 6, 9, 3),
                                            (5, 8, 8, 0), (64, 4, 0, 0)):
        predicted = torch.randint(0, 3, (experts,), generator=gen, dtype=torch.int32)
        home = torch.arange(experts) + 1000
        rows = torch.where(torch.rand(experts, generator=gen) < 0.5, home,
                           torch.randperm(experts, generator=gen))
        capacity = max(lent, 1) + 2
        lend = torch.full((1 + capacity,), -1)
        lend[0] = taken
        lend[1:1 + lent] = torch.randperm(50, generator=gen)[:lent] + 100
        outs = []
        for fn in (select, select_torch):
            state = [t.clone() for t in (rows, lend)]
            record = torch.zeros(2, per_layer, dtype=torch.int64)
            source = torch.zeros(per_layer, dtype=torch.int64)
            fn(predicted, state[0], home, state[1], record, source)
            outs.append((record, source, *state))
        for ours, ref in zip(*outs):
            assert torch.equal(ours, ref), (experts, per_layer, lent, outs)
        record, source, rows_after, lend_after = outs[1]
        took = record[1] >= 0
        assert took.sum() == min(lent - min(taken, lent), int(
            ((predicted > 0) & (rows == home)).sum()), per_layer) or lent <= taken
        assert (rows_after[record[0, took]] == record[1, took]).all()
        assert int(lend_after[0]) == taken + int(took.sum())


@pytest.mark.parametrize("host_first", [True, False], ids=["host-before-pool", "after"])
def test_the_copy_kernel_moves_host_rows_into_slots_by_address(host_first):
    pytest.importorskip("triton")
    from strata.experts.prefetch_triton import copy_rows
    row = 3000  # not a multiple of the kernel's block
    buffer = torch.zeros(20 * row, dtype=torch.bfloat16)
    host, pool = (buffer[:8 * row], buffer[12 * row:]) if host_first else \
        (buffer[12 * row:], buffer[:8 * row])
    host = host.view(8, row)
    pool = pool.view(8, row)
    host.copy_(torch.randn(8, row))
    offset = (host.data_ptr() - pool.data_ptr()) // (row * buffer.element_size())
    source = torch.tensor([5, 2, 7]) + offset
    copy_rows(pool, source, torch.tensor([1, -1, 6]))
    assert torch.equal(pool[1], host[5]) and torch.equal(pool[6], host[7])
    assert pool[[0, 2, 3, 4, 5, 7]].eq(0).all()  # -1: skipped


def test_greedy_output_with_and_without_prefetch_is_the_same(moe_expected):  # noqa: F811
    folder, prompts, expected = moe_expected
    # the tiny model's MoE layers are 0, 2 and 3: split after 3 layers, stage 0 has two
    for prefetch, devices in ((8, ("cpu",)), (0, ("cpu",)), (2, ("cpu", "cpu"))):
        engine = Engine(EngineConfig(model=str(folder), parallel=4, spec=6, max_context=256,
                                     experts_in_ram="on", expert_cache="25%",
                                     expert_prefetch=prefetch, devices=devices,
                                     layer_split=(3,) if len(devices) == 2 else ()))
        try:
            assert engine.generate(prompts, GREEDY) == expected
            stats = engine.expert_stats
            if prefetch:
                assert stats[0].prefetched > 0 and stats[0].recall is not None, stats
            else:
                assert stats[0].prefetched == 0 and stats[0].recall is None
        finally:
            engine.close()


def test_calibrate_measures_the_expert_cache_settings(tmp_path, gguf_tokenizer_reference,
                                                      capsys):
    """With --experts-in-ram, calibrate runs each (--pcie-frac, --expert-prefetch)
    candidate and writes the fastest into the profile, whose settings serve takes."""
    from conftest import build_tiny

    from strata.calibrate.experts import CANDIDATES
    from strata.calibrate.profile import load_profile
    from strata.cli import build_parser, engine_config, main
    from strata.tokenizer import Tokenizer
    folder = tmp_path / "moe"
    gguf_tokenizer_reference.save_pretrained(folder)
    build_tiny("qwen3_moe", folder, vocab_size=Tokenizer.from_hf_folder(folder).vocab_size,
               max_position_embeddings=4096)
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--model", str(folder), "--devices", "cpu", "--experts-in-ram",
                 "on", "--expert-cache", "25%", "--out", str(out), "--max-tokens", "8",
                 "--users", "2", "--repeats", "1", "--context", "32",
                 "--workloads", "code"]) == 0
    printed = capsys.readouterr().out
    assert "expert cache (2 requests at once, measured" in printed
    assert printed.count("| chosen |") == 1
    settings = load_profile(str(out), "--profile").settings
    assert (settings["pcie_frac"], settings["expert_prefetch"]) in CANDIDATES
    config = engine_config(build_parser(settings).parse_args(["serve"]))
    assert (config.pcie_frac, config.expert_prefetch) == (settings["pcie_frac"],
                                                          settings["expert_prefetch"])
