"""Per-layer cache specs: a layer that keeps per-slot state (a toy running mean, standing
in for tomorrow's recurrent layers) gets rows the scheduler allocates at admission,
indexes them by slot through the header, carries them across prompt chunks and windows,
and frees them at finish; its neighbours keep paged KV as before."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny, prompts
from torch import nn

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.kvcache.cache import SlotStateCache
from strata.kvcache.spec import PagedKVSpec, SlotStateSpec
from strata.layers.decoder import DecoderLayer
from strata.layers.forward_meta import ForwardMeta
from strata.layers.mlp import GatedMLP
from strata.models.llama import Llama
from strata.models.registry import register
from strata.request import Request
from strata.sampling.params import SamplingParams
from strata.scheduler.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


class RunningMean(nn.Module):
    """Token t's output is the mean of inputs 0..t of its sequence: the state is the
    running sum, one [hidden] float32 row per slot."""

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: SlotStateCache):
        (sums,) = cache.tensors                                     # [rows, hidden]
        out, state = torch.empty_like(x), meta.state
        for first, count, source, fresh in zip(
                *(t.tolist() for t in (state.entry_start, state.entry_len, state.entry_source,
                                       state.entry_fresh))):
            run = slice(first, first + count)
            before = torch.zeros_like(sums[0]) if fresh else sums[source]
            running = before + x[run].float().cumsum(0)              # [count, hidden]
            out[run] = (running / (meta.positions[run, None] + 1)).to(x.dtype)
            for i, row in enumerate(state.token_row[run].tolist()):  # the states the
                if row >= 0:                                         # verifier may keep
                    sums[row] = running[i]
        return out


@register
class ToyState(Llama):
    """Llama whose odd layers mix tokens with RunningMean instead of attention."""
    name = "toy_state"
    hf_names = ("ToyStateForCausalLM",)

    def make_layer(self, layer, rotary):
        if layer % 2 == 0:
            return super().make_layer(layer, rotary)
        c = self.config
        return DecoderLayer(c.hidden_size, c.rms_norm_eps, RunningMean(),
                            GatedMLP(c.hidden_size, c.intermediate_size, self.linear))

    def cache_spec(self, layer):
        if layer % 2 == 0:
            return super().cache_spec(layer)
        return SlotStateSpec(shapes=((self.config.hidden_size,),))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy_state")
    build_tiny("llama", folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["ToyStateForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_scheduler_gives_each_slot_its_own_rows_and_takes_them_back():
    sched = Scheduler(num_slots=3, max_context=32, max_window_tokens=32, block_size=4,
                      state_rows_per_slot=2)
    assert sched.cache_size.num_state_rows == 6 and sched.state_rows.num_free == 6
    requests = [Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1 + i))
                for i in range(3)]
    for r in requests:
        sched.add(r)
    window = sched.schedule()
    rows = window.header.state_rows.tolist()
    assert [len(r) for r in rows] == [2, 2, 2]
    assert len({row for pair in rows for row in pair}) == 6  # disjoint between slots
    assert rows == [sched.slots[i].state_rows for i in window.header.slots]
    sched.commit(window, [[7], [7], [7]])  # the first request is done: its rows are free
    assert requests[0].finished and sched.state_rows.num_free == 2
    later = Request([4, 5], SamplingParams(temperature=0, max_tokens=1))
    sched.add(later)
    window = sched.schedule()
    assert window.requests[-1] is later and window.header.state_rows[-1].tolist() == rows[0]


def test_models_without_state_get_no_rows():
    sched = Scheduler(num_slots=2, max_context=32, max_window_tokens=32, block_size=4)
    sched.add(Request([1, 2], SamplingParams(max_tokens=1)))
    assert sched.schedule().header.state_rows is None and sched.cache_size.num_state_rows == 0


def test_stages_allocate_each_layer_from_its_spec(toy):
    engine = Engine(EngineConfig(model=str(toy), spec=0, parallel=3, max_context=64,
                                 layer_split=(2,)))
    kinds = [[type(c).__name__ for c in stage.caches] for stage in engine.runner.stages]
    assert kinds == [["PagedKVCache", "SlotStateCache"], ["PagedKVCache", "SlotStateCache"]]
    state = engine.runner.stages[1].caches[1]
    # 2 rows per slot, a snapshot row per slot, and --state-snapshots (--parallel) kept
    assert state.tensors[0].shape == (12, 64) and state.tensors[0].dtype == torch.float32
    assert isinstance(engine.runner.stages[0].arch.cache_spec(0), PagedKVSpec)


def test_state_rows_follow_slots_across_chunks_windows_and_requests(toy):
    """Four sequences decoded together, their prompts in small chunks, equal each decoded
    alone in one chunk: state is per slot, carried across chunks and windows, and a row
    that served a finished request starts afresh for the next."""
    batch = prompts(6, 320, seed=4, low=10, high=40)
    alone = Engine(EngineConfig(model=str(toy), spec=0, parallel=1, max_context=128))
    expected = [alone.generate([ids], GREEDY)[0] for ids in batch]  # rows reused 6 times
    together = Engine(EngineConfig(model=str(toy), spec=0, parallel=4, max_context=128,
                                   max_window_tokens=7))
    assert together.generate(batch, GREEDY) == expected
    rows = together.scheduler.state_rows  # every row back, but the kept snapshots'
    assert rows.num_free + len(together.scheduler.keeper.snapshots) == rows.size == 16


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_drafts_roll_per_slot_state_back_by_choosing_a_row(toy, ahead):
    """With drafts, some rejected, every slot's state follows its accepted tokens: greedy
    output equals the no-draft run's; each slot holds 2 + --spec rows."""
    batch = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9, 9, 9], [3, 4, 3, 4, 3, 4, 3]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(toy), spec=0, parallel=3, max_context=128))
    want = plain.generate(batch, params)
    drafted = Engine(EngineConfig(model=str(toy), spec=3, parallel=3, max_context=128,
                                  schedule_ahead=ahead, spec_window_cost=0.0,
                                  spec_token_cost=0.0))
    assert drafted.scheduler.state_rows_per_slot == 5
    assert drafted.generate(batch, params) == want
    stats = drafted.draft_stats
    assert stats.accepted > 0
    if ahead == "off":  # windows built ahead draft less (a slot sits out to draft)
        assert stats.drafted > stats.accepted  # rejected drafts rolled back
