"""MTP drafts: Strata's first MTP draft equals transformers' MTP candidate on tiny random
glm4_moe and deepseek_v3 checkpoints with an MTP layer, and greedy output with MTP drafts
(chained, any split, in one process or in stage processes with pipelined groups, one or
eight requests) equals greedy output without drafts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import prompts
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.sampling.params import SamplingParams
from test_models_glm_deepseek import build

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def sharded(folder) -> None:
    """Make the two safetensors files one sharded checkpoint with an index, the layout in
    which transformers' MtpModel finds MTP weights."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model-mtp.safetensors").rename(folder / "model-00002-of-00002.safetensors")
    weight_map = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            weight_map.update({k: f.name for k in handle.keys()})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    out = {}
    for kind in ("glm4_moe", "deepseek_v3"):
        folder = tmp_path_factory.mktemp(f"mtp_{kind}")
        model, _ = build(kind, folder)
        sharded(folder)
        out[kind] = folder
    return out


def transformers_candidates(folder, ids: list[int], monkeypatch) -> list[list[int]]:
    import transformers
    from transformers.generation import candidate_generator

    config = json.loads((folder / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    # Those classes find MTP weights by a fixed layer number (that of the real checkpoint).
    monkeypatch.setattr(cls, "_keys_to_ignore_on_load_unexpected",
                        [rf"model\.layers\.{config['num_hidden_layers']}\..*"])
    model = cls.from_pretrained(str(folder), dtype=torch.float32)
    seen = []
    original = candidate_generator.MTPCandidateGenerator.get_candidates

    def spy(self, input_ids, *args, **kwargs):
        out = original(self, input_ids, *args, **kwargs)
        seen.append(out[0][0, input_ids.shape[1]:].tolist())
        return out

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", spy)
    model.eval().generate(torch.tensor([ids]), use_mtp=True, max_new_tokens=3, do_sample=False)
    return [c for c in seen if c]


@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3"])
def test_first_mtp_draft_equals_transformers_candidate(mtp_models, kind, monkeypatch):
    folder = mtp_models[kind]
    for ids in prompts(3, 320, seed=4, low=6, high=30):
        expected = transformers_candidates(folder, ids, monkeypatch)[0][0]
        engine = Engine(EngineConfig(model=str(folder), spec=1, spec_type=("mtp",),
                                     spec_min_p=0.0, max_context=128))
        request = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4))
        engine.step()  # the prompt's window: first token, then the MTP layer drafts
        draft = next(p for p in engine.scheduler.drafts.proposers
                     if p.on_last_stage).propose(request.request_id, 1)
        assert draft.tokens == [expected]
        assert 0 < draft.scores[0] <= 1


@pytest.mark.parametrize("split,devices", [((), ("cpu",)), ((2,), ("cpu",)),
                                           ((2,), ("cpu", "cpu"))])  # the last: 2 processes
def test_greedy_identical_with_chained_mtp_drafts(mtp_models, split, devices):
    folder = mtp_models["glm4_moe"]
    batch = prompts(8, 320, seed=9, low=3, high=40)
    plain = Engine(EngineConfig(model=str(folder), spec=0, parallel=8, max_context=128))
    expected = plain.generate(batch, GREEDY)
    engine = Engine(EngineConfig(model=str(folder), spec=3, spec_type=("mtp",), spec_min_p=0.0,
                                 spec_token_cost=0.0, parallel=8, max_window_tokens=32,
                                 layer_split=split, devices=devices, max_context=128,
                                 stage_threads=1))
    try:
        assert engine.scheduler.num_groups == len(devices)  # auto: 2 groups for 2 processes
        assert engine.generate(batch, GREEDY) == expected
        stats = engine.draft_stats.by_proposer["mtp"]
        assert stats.drafted > stats.windows  # chains of more than one draft were sent
        assert engine.generate(batch[:1], GREEDY) == expected[:1]
    finally:
        engine.close()


def test_mtp_is_offered_only_where_the_model_has_it(mtp_models, tiny_models):
    from strata.errors import StrataError

    with pytest.raises(StrataError, match="--spec-type mtp"):
        Engine(EngineConfig(model=str(tiny_models["llama"][0]), spec_type=("mtp",)))
    engine = Engine(EngineConfig(model=str(mtp_models["glm4_moe"]), max_context=64))
    assert [p.name for p in engine.scheduler.drafts.proposers] == ["suffix", "lookup", "mtp"]


@pytest.mark.parametrize("devices,host", [(("cpu",), False), (("cpu",), True),
                                          (("cpu", "cpu"), False)])  # the last: 2 processes
def test_prefix_reuse_keeps_the_same_mtp_drafts(mtp_models, devices, host):
    """A prompt that starts with a finished request's blocks reuses them (`host`: after
    they went to host RAM and back); its first window runs the last cached token again
    (its KV not written) so the MTP layer has that token's hidden state: the drafts, and
    so the counts, are those of computing it all."""
    folder = mtp_models["glm4_moe"]
    first, more, other = prompts(3, 320, seed=4, low=30, high=31)
    second = first + more[:6]

    def run(prefix_cache: str):
        evict = dict(kv_tokens=128, conversation_cache_mib=1) if host else {}
        engine = Engine(EngineConfig(model=str(folder), spec=3, spec_type=("mtp",),
                                     spec_min_p=0.0, spec_token_cost=0.0, parallel=1,
                                     block_size=4, max_context=128, prefix_cache=prefix_cache,
                                     layer_split=(2,) if len(devices) > 1 else (),
                                     devices=devices, stage_threads=1, **evict))
        try:
            engine.generate([first], GREEDY)
            if host:  # another prompt that needs the whole pool: the first one's blocks go
                engine.generate([other * 3 + other[:26]], SamplingParams(max_tokens=1))
            request = engine.add_request(second, GREEDY)
            engine.step()  # the prompt's window: the MTP layer's keys at positions 1..36
            mtp_keys = None
            if len(devices) == 1:
                table = engine.scheduler.slots[0].block_table
                rows = torch.tensor(table.rows(1, len(second)))
                mtp_keys = engine.runner.stages[-1].mtp_cache.key[rows].clone()
            while engine.has_work:
                engine.step()
        finally:
            engine.close()
        stats = request.draft_stats
        restored = engine.scheduler.pool.host.restored_blocks if host and \
            prefix_cache == "on" else 0
        return (request.output_ids, (stats.drafted, stats.accepted), request.num_cached_tokens,
                mtp_keys, restored)

    on, off = run("on"), run("off")
    assert on[:2] == off[:2] and on[1][0] > 0
    if host:
        assert on[4] > 0  # blocks copied back from host RAM (the rest still on the device)
    assert on[2] == 27 and off[2] == 0  # 7 blocks, less the token run again
    if on[3] is not None:  # every MTP key is there, the one after the cached blocks too
        assert torch.allclose(on[3], off[3], atol=1e-5)
