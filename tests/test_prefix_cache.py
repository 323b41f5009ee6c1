"""The prefix cache: a request whose prompt starts with full blocks a live or finished
request computed reuses them, and its output is exactly what computing them gives
(greedy with drafts, sampled with a seed; sharing none, some or all blocks; in sequence and
while the first request runs; in one process and in stage processes). A shared block is
never written (the scheduler refuses such a window, and the cache's bytes are checked)."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.kvcache.block_pool import BlockPool
from strata.kvcache.prefix import prompt_keys
from strata.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)
SEEDED = SamplingParams(temperature=0.9, seed=3, max_tokens=24)


# -- the pool ---------------------------------------------------------------------------------
def test_keys_name_the_whole_prefix():
    a = list(prompt_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2))
    b = list(prompt_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, 2))
    assert a[0] != b[0] and a[1] != b[1]  # the same second block after another first one
    assert list(prompt_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 2)) == a


def test_shared_blocks_are_counted_and_idle_ones_go_last_recently_used_first():
    pool = BlockPool(4, 4, prefix_cache=True)
    a, b = pool.allocate(2)
    keys = list(prompt_keys(list(range(8)), 4, 2))
    pool.prefix.register(a, keys[0])
    pool.prefix.register(b, keys[1])
    pool.hold([a])                    # a second holder of block a
    pool.release([a, b])
    assert pool.refs[a] == 1 and pool.refs[b] == 0
    assert list(pool.prefix.idle) == [b] and pool.num_free == 3  # b stays cached
    pool.release([a])
    assert list(pool.prefix.idle) == [b, a]
    assert pool.allocate(2) and pool.num_free == 2  # the two never-used blocks first
    assert pool.allocate(1) == [b]                  # then the least recently dropped
    assert pool.prefix.lookup(keys[1]) is None and pool.prefix.lookup(keys[0]) == a
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(2)


# -- the engine -------------------------------------------------------------------------------
def prompts(vocab: int) -> dict[str, list[int]]:
    """A first prompt with repeats (so drafts pass and fail) and prompts that share all of
    its full blocks, some, or none."""
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, vocab, (9,), generator=g).tolist()
    first = base * 3 + base[:5]                                           # 32 tokens
    other = torch.randint(0, vocab, (30,), generator=g).tolist()
    return {"first": first, "all": first + [5, 6, 7], "same": list(first),
            "some": first[:13] + other[:10], "none": other}


def engine(folder, prefix_cache: str, **kw) -> Engine:
    return Engine(EngineConfig(model=str(folder), parallel=4, block_size=4, spec=6,
                               prefix_cache=prefix_cache, stage_threads=1, **kw))


def in_sequence(e: Engine, texts: dict[str, list[int]], params) -> dict:
    out = {}
    for name, ids in texts.items():
        request = e.add_request(ids, params)
        while e.has_work:
            e.step()
        out[name] = (request.output_ids, request.num_cached_tokens)
    return out


def in_stage_processes(folder, texts: dict[str, list[int]], **kw) -> dict:
    """in_sequence with the cache on, in two stage processes."""
    e = engine(folder, "on", layer_split=(2,), devices=("cpu", "cpu"), **kw)
    try:
        return in_sequence(e, texts, GREEDY)
    finally:
        e.close()


def kv_bytes(e: Engine, blocks: list[int]) -> list[torch.Tensor]:
    size = e.scheduler.pool.block_size
    rows = torch.tensor([b * size + i for b in blocks for i in range(size)])
    return [torch.cat([c.key[rows], c.value[rows]]).clone()
            for stage in e.runner.stages for c in stage.caches]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_reused_blocks_give_the_same_output_in_sequence(tiny_models, params):
    folder = tiny_models["llama"][0]
    texts = prompts(320)
    reference = {k: v[0] for k, v in in_sequence(engine(folder, "off"), texts, params).items()}
    e = engine(folder, "on")
    first = e.add_request(texts["first"], params)
    while e.has_work:
        e.step()
    shared = [b for b in e.scheduler.pool.prefix.key_of]  # registered by the first request
    before = kv_bytes(e, shared)
    runs = in_sequence(e, {k: v for k, v in texts.items() if k != "first"}, params)
    assert first.output_ids == reference["first"]
    assert {k: v[0] for k, v in runs.items()} == {k: reference[k] for k in runs}
    cached = {k: v[1] for k, v in runs.items()}
    assert cached["all"] >= 28 and cached["same"] == 28  # its last block keeps a token
    assert cached["some"] == 12 and cached["none"] == 0
    assert e.scheduler.cached_tokens == sum(cached.values())
    for a, b in zip(before, kv_bytes(e, shared)):  # no sharer wrote a shared block
        assert torch.equal(a, b)
    if params is GREEDY:
        assert e.draft_stats.accepted > 0 and e.draft_stats.drafted > e.draft_stats.accepted


def test_a_live_requests_blocks_are_shared_while_it_runs(tiny_models):
    folder = tiny_models["llama"][0]
    texts = prompts(320)
    reference = engine(folder, "off").generate([texts["first"], texts["all"]], GREEDY)
    e = engine(folder, "on")
    first = e.add_request(texts["first"], GREEDY)
    e.step()
    e.step()  # the prompt is in, its blocks registered, its output under way
    assert not first.finished and e.scheduler.pool.num_cached >= 7
    second = e.add_request(texts["all"], GREEDY)
    while e.has_work:
        e.step()
    assert [first.output_ids, second.output_ids] == reference
    assert second.num_cached_tokens >= 28


def test_stage_processes_reuse_blocks_with_the_same_output(tiny_models):
    folder = tiny_models["llama"][0]
    texts = prompts(320)
    reference = in_sequence(engine(folder, "off"), texts, GREEDY)
    runs = in_stage_processes(folder, texts)
    assert {k: v[0] for k, v in runs.items()} == {k: v[0] for k, v in reference.items()}
    assert runs["all"][1] >= 28 and runs["some"][1] == 12


def test_scoring_computes_every_position(tiny_models):
    folder = tiny_models["llama"][0]
    texts = prompts(320)
    e = engine(folder, "on")
    e.generate([texts["first"]], GREEDY)
    logits = e.score(texts["all"])
    assert logits.shape[0] == len(texts["all"])
    assert torch.allclose(logits, engine(folder, "off").score(texts["all"]), atol=1e-5)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from test_qwen3_next import build_qwen3_next
    folder = tmp_path_factory.mktemp("hybrid")
    build_qwen3_next(folder)
    return folder


def test_recurrent_models_reuse_blocks_with_a_state_snapshot(hybrid):
    """A hybrid model (Gated DeltaNet + attention) reuses a prefix only where a state
    snapshot follows its last block: the first prompt's end (its prompt window is cut at
    its last boundary) and its whole sequence's last boundary; the output is what
    computing it all gives."""
    texts = prompts(320)
    e0 = engine(hybrid, "off")
    first = e0.generate([texts["first"]], GREEDY)[0]
    texts["conversation"] = texts["first"] + first + [9, 8, 7]
    reference = in_sequence(engine(hybrid, "off"), texts, GREEDY)
    assert engine(hybrid, "on").scheduler.keeper.snapshots.capacity == 4  # --parallel
    e = engine(hybrid, "on", state_snapshots=16)  # two for each request
    runs = in_sequence(e, texts, GREEDY)
    assert {k: v[0] for k, v in runs.items()} == {k: v[0] for k, v in reference.items()}
    cached = {k: v[1] for k, v in runs.items()}
    assert cached["all"] == 28 and cached["same"] == 28  # the prompt's last boundary
    assert cached["conversation"] >= 52                   # the first's answer's too
    assert cached["some"] == 0 and cached["none"] == 0    # no state after 3 blocks
    assert e.draft_stats.accepted > 0


def test_recurrent_models_reuse_in_stage_processes_and_not_without_snapshots(hybrid, caplog):
    texts = prompts(320)
    texts = {"first": texts["first"], "all": texts["all"]}
    reference = in_sequence(engine(hybrid, "off"), texts, GREEDY)
    runs = in_stage_processes(hybrid, texts)
    assert {k: v[0] for k, v in runs.items()} == {k: v[0] for k, v in reference.items()}
    assert runs["all"][1] == 28
    with caplog.at_level("INFO", logger="strata.engine"):
        off = engine(hybrid, "on", state_snapshots=0)
    assert off.scheduler.pool.prefix is None and "--state-snapshots is 0" in caplog.text


def test_the_server_reports_cached_tokens(tiny_served_model, tmp_path):
    import httpx
    import openai

    from server_utils import running_server
    system = "You are a careful assistant. " * 20
    with running_server("--model", str(tiny_served_model), "--block-size", "8",
                        "--conversation-cache-mib", "1", log=tmp_path / "serve.log") as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        usages = []
        for question in ("Hi.", "Hello there."):
            reply = client.chat.completions.create(
                model=model, temperature=0, max_tokens=4,
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": question}])
            usages.append(reply.usage)
        stream = client.chat.completions.create(
            model=model, temperature=0, max_tokens=4, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "Yo."}])
        streamed = [c.usage for c in stream if c.usage is not None][-1]
        metrics = httpx.get(base + "/metrics").text
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens >= 100
    assert streamed.prompt_tokens_details.cached_tokens >= 100
    hits = [line for line in metrics.splitlines()
            if line.startswith("strata_prefix_cache_hit_tokens_total")]
    assert hits and float(hits[0].split()[-1]) >= 200
    assert "strata_kv_blocks_used " in metrics and "strata_preemptions_total 0.0" in metrics
    assert "strata_conversation_cache_restored_tokens_total 0.0" in metrics
