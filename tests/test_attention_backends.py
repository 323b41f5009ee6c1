"""The attention backend seam: the reference backend (gather-then-SDPA) against a second,
deliberately naive backend (one token at a time, keys read through the block table) on
the same windows — outputs and cache writes agree — and whole engines on either backend
(GQA, MLA, MTP drafts) give the same tokens."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import prompts

from strata.attention import AttentionBatch, get_backend, register_backend
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.kvcache.block_pool import cache_rows
from strata.kvcache.cache import PagedKVCache
from strata.kvcache.spec import PagedKVSpec
from strata.sampling.params import SamplingParams


class LoopBackend:
    """Each token attends to the rows of positions 0..its own through its entry's block
    table, one token at a time: slow and obviously right."""

    name = "loop"

    def prepare(self, batch: AttentionBatch, device: torch.device) -> dict:
        entry = torch.repeat_interleave(torch.arange(len(batch.query_lens)),
                                        torch.tensor(batch.query_lens))
        rows = [cache_rows(batch.block_tables[e], torch.arange(int(p) + 1), batch.block_size)
                for e, p in zip(entry.tolist(), batch.positions.tolist())]
        return {"write": batch.slot_mapping.to(device), "read": [r.to(device) for r in rows]}

    def forward(self, q, k, v, cache: PagedKVCache, meta: dict, scale=None):
        cache.key[meta["write"]] = k.to(cache.key.dtype)
        cache.value[meta["write"]] = v.to(cache.value.dtype)
        heads, dim = q.shape[1], q.shape[2]
        scale = dim ** -0.5 if scale is None else scale
        out = torch.empty_like(q)
        for t, rows in enumerate(meta["read"]):
            keys, values = cache.key[rows].to(q.dtype), cache.value[rows].to(q.dtype)
            group = heads // keys.shape[1]                                    # GQA
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            weights = torch.einsum("hd,khd->hk", q[t], keys).mul(scale).softmax(-1)
            out[t] = torch.einsum("hk,khd->hd", weights, values)
        return out


register_backend(LoopBackend.name, LoopBackend)


def random_window(rng: random.Random, block_size: int, num_blocks: int):
    """A window of 1-4 entries, each a run at some offset of its own sequence (a prompt
    chunk, or a last token plus drafts), with its blocks scattered over the pool."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    lens, positions, tables = [], [], []
    for _ in range(rng.randint(1, 4)):
        start, count = rng.randint(0, 40), rng.randint(1, 9)
        blocks = [free.pop() for _ in range(-(-(start + count) // block_size))]
        lens.append(count)
        positions.append(torch.arange(start, start + count))
        tables.append(blocks)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    positions_t = torch.cat(positions)
    entry = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    rows = torch.stack([cache_rows(table[e], p[None], block_size)[0]
                        for e, p in zip(entry.tolist(), positions_t)])
    return AttentionBatch(lens, positions_t, rows, table, block_size)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_reference_equals_a_naive_backend_on_the_same_windows(heads, kv_heads):
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    block_size, num_blocks, dim = 4, 96, 8
    spec = PagedKVSpec(kv_heads, dim)
    for case in range(40):
        batch = random_window(rng, block_size, num_blocks)
        caches = []
        history = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
        for _ in range(2):  # earlier positions already in the cache, the same in both
            cache = PagedKVCache(spec, num_blocks * block_size, torch.float32, "cpu")
            cache.key.copy_(history)
            cache.value.copy_(history.flip(0))
            caches.append(cache)
        tokens = len(batch.positions)
        q = torch.randn(tokens, heads, dim, generator=gen)
        k, v = torch.randn(2, tokens, kv_heads, dim, generator=gen)
        scale = None if case % 2 else 0.3
        outs = [backend.forward(q, k, v, cache, backend.prepare(batch, torch.device("cpu")),
                                scale)
                for backend, cache in zip([get_backend("reference"), LoopBackend()], caches)]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        assert torch.equal(caches[0].key, caches[1].key)
        assert torch.equal(caches[0].value, caches[1].value)
        assert torch.equal(caches[0].key[batch.slot_mapping], k)  # the window's rows written


def engines(folder, **kw):
    return [Engine(EngineConfig(model=str(folder), attention_backend=name, **kw))
            for name in ("reference", "loop")]


def test_engines_on_either_backend_give_the_same_tokens(tiny_models):
    folder, model = tiny_models["llama"]
    batch = prompts(4, model.config.vocab_size, seed=11, low=5, high=30)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference, loop = engines(folder, parallel=4, max_context=128, max_window_tokens=16)
    torch.testing.assert_close(loop.score(batch[0]), reference.score(batch[0]),
                               rtol=1e-5, atol=1e-5)
    assert loop.generate(batch, params) == reference.generate(batch, params)


def test_mla_and_mtp_go_through_the_backend(tmp_path):
    from test_models_glm_deepseek import build  # a tiny DeepSeek-V3 with its MTP layer

    build("deepseek_v3", tmp_path)
    calls: dict[int, int] = {}  # id(cache) -> attention calls on it

    class Counting(LoopBackend):
        def forward(self, q, k, v, cache, meta, scale=None):
            calls[id(cache)] = calls.get(id(cache), 0) + 1
            return super().forward(q, k, v, cache, meta, scale)

    register_backend("counting-loop", Counting)
    config = dict(model=str(tmp_path), spec=2, spec_type=("mtp",), spec_min_p=0.0,
                  spec_token_cost=0.0, max_context=128)
    reference = Engine(EngineConfig(**config))
    counting = Engine(EngineConfig(**config, attention_backend="counting-loop"))
    ids = prompts(2, 320, seed=5, low=8, high=20)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert counting.generate(ids, params) == reference.generate(ids, params)
    assert counting.scheduler.drafts.stats.by_proposer["mtp"].drafted > 0
    stage = counting.runner.stages[0]
    assert all(calls.get(id(cache), 0) > 0 for cache in stage.caches)  # every MLA layer
    assert calls.get(id(stage.mtp_cache), 0) > 0                       # the MTP layer


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(StrataError, match="--attention-backend nope does not exist; "
                                          "available: .*reference"):
        EngineConfig(attention_backend="nope")
