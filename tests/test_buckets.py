"""Window buckets and padding (the CUDA-graph path's logic, checked on the CPU): windows
padded to buckets give the tokens and logits of unpadded windows, with and without drafts,
in one stage or split."""

import pytest
import torch

from conftest import prompts
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.sampling.params import SamplingParams
from strata.stage.buckets import WindowShape, bucket_sizes, pad_window, pick_bucket
from strata.stage.graphs import GraphCall, StageGraphs
from strata.stage.staging import tensor_fields
from test_pipeline import repetitive_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("largest", [1, 5, 64, 256, 300])
def test_bucket_sizes_cover_every_window_with_little_waste(largest):
    sizes = bucket_sizes(largest)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == largest
    for n in range(1, largest + 1):
        bucket = pick_bucket(n, sizes)
        assert n <= bucket <= max(4, n + n // 4 + 1)  # at most about a quarter wasted
    assert pick_bucket(largest + 1, sizes) is None


def one_window(engine: Engine):
    """The first window the engine's scheduler builds for its waiting requests."""
    for p in repetitive_prompts(320)[:3]:
        engine.add_request(p, GREEDY)
    return engine.scheduler.schedule()


def test_pad_window_adds_one_entry_on_the_padding_block(tiny_models):
    engine = Engine(EngineConfig(model=str(tiny_models["llama"][0]), parallel=4, spec=0))
    window = one_window(engine)
    header = window.header
    shape = WindowShape(num_entries=5, table_width=10, padding_block=99)
    padded = pad_window(header, header.num_tokens + 7, shape)
    real = header.num_tokens
    assert padded.batch.query_lens == [*header.query_lens, 7] + [0] * (4 - len(header.slots))
    assert torch.equal(padded.batch.positions[:real], header.positions)
    assert (padded.batch.positions[real:] == 0).all()
    assert torch.equal(padded.batch.slot_mapping[:real], header.slot_mapping)
    assert (padded.batch.slot_mapping[real:] // header.block_size == 99).all()
    tables = padded.batch.block_tables
    width = header.block_tables.shape[1]
    assert tables.shape == (5, 10) and torch.equal(tables[:len(header.slots), :width],
                                                   header.block_tables)
    assert (tables[:len(header.slots), width:] == 99).all()
    assert (tables[len(header.slots):] == 99).all()
    assert torch.equal(padded.logits_idx[:padded.num_logits], header.logits_idx())
    assert padded.token_ids.shape == (real + 7,)
    with pytest.raises(ValueError, match="does not fit"):
        pad_window(header, real - 1, shape)
    # A large bucket computes at most max_logits rows: the window's, then row 0.
    rows = len(header.logits_idx())
    capped = WindowShape(num_entries=5, table_width=10, padding_block=99, max_logits=rows + 1)
    padded = pad_window(header, real + 7, capped)
    assert padded.logits_idx.tolist() == [*header.logits_idx().tolist(), 0]
    with pytest.raises(ValueError, match="logits rows does not fit"):
        pad_window(header, real + 7, WindowShape(5, 10, 99, max_logits=rows - 1))


def padded_everywhere(engine: Engine, sizes: list[int],
                      max_logits: int = 256) -> dict[str, int]:
    """Every stage of the engine pads its windows to these buckets (eagerly: no graphs on
    the CPU). Returns counts of windows padded and run eagerly, updated as the engine runs."""
    counts = {"padded": 0, "eager": 0}
    for stage in engine.runner.stages:
        graphs = StageGraphs(stage, sizes,
                             WindowShape(engine.config.parallel + 1,
                                         stage.cache_size.blocks_per_slot,
                                         stage.cache_size.padding_block, max_logits,
                                         state=stage.keeps_state),
                             stage.arch.config.hidden_size, graphs=False)
        graphs.capture()
        stage.graphs = graphs
        prepare = stage.prepare

        def counted(header, prepare=prepare, first=stage.index == 0):
            meta = prepare(header)
            if first and not isinstance(meta, GraphCall):
                counts["eager"] += 1
            elif first and meta.tokens > meta.num_tokens:
                counts["padded"] += 1
            return meta

        stage.prepare = counted
    return counts


@pytest.mark.parametrize("split", [(), (1,)])
def test_a_window_written_into_its_bucket_equals_its_padded_tensors(tiny_models, split):
    """A graphed window's metadata is written straight into its bucket's staging arrays
    (StageGraphs._write, the backend's write_host): the same values as the padded window's
    tensors (pad_window, prepare_host, the carried rows, greedy_table), on every stage of a
    split, for windows with drafts and tokens carried from the window ahead."""
    from strata.sampling.verifier import greedy_table

    config = dict(model=str(tiny_models["llama"][0]), parallel=4, layer_split=split,
                  max_window_tokens=32, spec=8, schedule_ahead="on")
    running = Engine(EngineConfig(**config))
    headers = []
    prepare = running.runner.stages[0].prepare
    running.runner.stages[0].prepare = lambda h: headers.append(h) or prepare(h)
    running.generate(repetitive_prompts(320), GREEDY)
    engine = Engine(EngineConfig(**config, attention_backend="triton"))
    padded_everywhere(engine, [2, 5, 11, 24], max_logits=24)
    checked = {"windows": 0, "carry": 0, "drafts": 0}
    for stage in engine.runner.stages:
        graphs, module = stage.graphs, stage.module
        for header in headers:
            with torch.inference_mode():  # as the runner prepares
                call = graphs.prepare(header)
            if call is None:
                continue
            padded = pad_window(header, call.tokens, graphs.shape)
            want = [padded.batch.positions, padded.logits_idx,
                    *tensor_fields(stage.backend.prepare_host(padded.batch))]
            if module.first:
                spare = [0] * (call.tokens - len(header.carry_rows))
                want += [padded.token_ids, torch.tensor([header.carry_rows + spare,
                                                         header.carry_from + spare])]
            if module.last:
                verify = [] if header.logits_all else header.verify
                target, entry, start = greedy_table(verify, graphs.shape.logit_rows(
                    call.tokens), graphs.shape.num_entries)
                want += [torch.tensor([target, entry]), torch.tensor(start)]
            views = graphs.captured[call.tokens].staging.views
            assert len(views) == len(want)
            for view, value in zip(views, want):
                assert torch.equal(view, value.to(view.dtype))
            checked["windows"] += 1
            checked["carry"] += header.carry and module.first
            checked["drafts"] += any(e.draft for e in header.verify) and module.last
    assert checked["windows"] > 20 and checked["carry"] > 0 and checked["drafts"] > 0, checked


@pytest.mark.parametrize("split,spec,backend", [((), 0, "reference"), ((), 8, "reference"),
                                               ((2,), 8, "reference"), ((2,), 8, "triton")])
def test_padded_windows_give_the_same_tokens_and_logits(tiny_models, split, spec, backend):
    """With `triton` (its kernel interpreted on the CPU) each window's metadata is copied
    into its bucket's static buffers, as before a graph replay, and the bucket's greedy
    decisions stand in for the Verifier's."""
    folder = str(tiny_models["llama"][0])
    config = dict(model=folder, parallel=4, layer_split=split, max_window_tokens=32)
    plain = Engine(EngineConfig(**config, spec=0, attention_backend="reference"))
    padded = Engine(EngineConfig(**config, spec=spec, attention_backend=backend,
                                 schedule_ahead="on"))
    # Coarse buckets, so that most windows are padded; prompt windows of 25..32 run eagerly,
    # and so do windows of more than 9 logits rows (the score's, drafted ones), but for
    # triton's drafted windows of up to 24 rows (decided in their bucket).
    counts = padded_everywhere(padded, [2, 5, 11, 24], max_logits=24 if spec and backend ==
                               "triton" else 9)
    launch, decided = padded.runner.last.launch, {"bucket": 0, "drafted": 0}

    def spied(header, logits, hidden, greedy=None):
        if greedy is not None:  # the bucket's greedy decisions: used for these windows
            decided["bucket"] += 1
            decided["drafted"] += any(e.draft for e in header.verify)
        return launch(header, logits, hidden, greedy)

    padded.runner.last.launch = spied
    ids = prompts(1, 320, seed=3, low=20, high=21)[0]
    torch.testing.assert_close(padded.score(ids), plain.score(ids), rtol=1e-5, atol=1e-5)
    assert (padded.generate(repetitive_prompts(320), GREEDY)
            == plain.generate(repetitive_prompts(320), GREEDY))
    assert counts["padded"] > 10 and counts["eager"] > 0
    if spec:
        assert padded.draft_stats.accepted > 0
    if backend == "triton":  # static buffers: each bucket decides greedy windows itself
        assert decided["bucket"] > 10 and decided["drafted"] > 0


def test_graph_and_backend_settings_say_what_they_need(tiny_models):
    from strata.attention.backend import resolve_backend
    from strata.errors import StrataError

    folder = str(tiny_models["llama"][0])
    with pytest.raises(StrataError, match="--cuda-graphs on: CUDA graphs need a CUDA device"):
        Engine(EngineConfig(model=folder, cuda_graphs="on"))
    with pytest.raises(StrataError, match="--cuda-graphs sometimes is not one of auto, on, off"):
        EngineConfig(cuda_graphs="sometimes")
    with pytest.raises(StrataError, match="--compile maybe is not one of on, off"):
        EngineConfig(compile="maybe")
    engine = Engine(EngineConfig(model=folder))  # auto: the reference backend, no graphs
    assert [s.backend.name for s in engine.runner.stages] == ["reference"]
    assert engine.runner.stages[0].graphs is None
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"


def test_moe_stages_capture_the_windows_their_fused_path_runs(tiny_models, monkeypatch):
    """A MoE stage lets graphs capture windows of up to FUSED_MAX_TOKENS tokens where its
    fused path runs (CUDA with triton), and none where it does not; dense stages have no
    limit."""
    from strata.layers.moe import FUSED_MAX_TOKENS, GroupedExperts
    from strata.stage.stage import graph_token_limit

    moe = Engine(EngineConfig(model=str(tiny_models["qwen3_moe"][0]), spec=0, max_context=64))
    dense = Engine(EngineConfig(model=str(tiny_models["llama"][0]), spec=0, max_context=64))
    assert graph_token_limit(dense.runner.stages[0]) is None
    assert graph_token_limit(moe.runner.stages[0]) == 0  # the CPU: no fused path
    monkeypatch.setattr(GroupedExperts, "_fused_runs", staticmethod(lambda t: True))
    assert graph_token_limit(moe.runner.stages[0]) == FUSED_MAX_TOKENS == 32
