"""`strata calibrate`, its profile file and the pipeline simulator: the simulator's clock
and its CPU sharing, the split that balances stage times, load pricing's choices, the
simulator against real stage processes, and a calibrated profile that `strata serve
--profile` accepts (bad profiles get a clear error)."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from conftest import build_tiny
from server_utils import running_server
from strata.calibrate.check import compare
from strata.calibrate.choose import balanced_split
from strata.calibrate.command import CalibrateOptions
from strata.calibrate.profile import WIDTHS, CostProfile, load_profile
from strata.calibrate.simulate import Trace, simulate, synthetic_traces
from strata.cli import main
from strata.config import EngineConfig
from strata.drafting.draft import Draft
from strata.drafting.load_pricing import LoadPricing
from strata.drafting.policy import DraftPolicy
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.request import Request
from strata.sampling.params import SamplingParams


def flat(seconds: float, per_token: float = 0.0) -> tuple[float, ...]:
    return tuple(seconds + per_token * (w - 1) for w in WIDTHS)


def profile(layers: int = 8, layer: float = 1e-3, per_token: float = 0.0, **kw) -> CostProfile:
    return CostProfile(widths=WIDTHS, layers=(flat(layer, per_token),) * layers,
                       first=flat(0.0), last=flat(0.0), devices=("cuda:0",), **kw)


def gpus(n: int, **kw) -> EngineConfig:
    split = tuple(range(2, 2 * n, 2))
    return EngineConfig(devices=tuple(f"cuda:{i}" for i in range(n)), layer_split=split,
                        parallel=4, **kw)


# -- the profile file -------------------------------------------------------------------------
def test_a_profile_reads_back_what_was_written(tmp_path):
    p = profile(hop_seconds=2e-4, acceptance={"suffix": 0.7},
                settings={"layer_split": (4,), "batch_groups": 2},
                traces={"code": [[[1, 2], [3, 4]]]})
    path = tmp_path / "p.json"
    p.save(path)
    assert load_profile(path) == p
    assert p.stage_costs((4,))[0](1) == pytest.approx(4e-3)


@pytest.mark.parametrize("content,problem", [
    (None, "no such file"),
    ("{not json", "is not JSON"),
    ('{"layers": []}', "not a Strata profile"),
    ('{"strata_profile": 99}', "another version"),
    ('{"strata_profile": 1, "widths": [1, 2], "layers": [[1, 2]], "first": [0, 0], '
     '"last": [0]}', "'devices' is missing"),
    ('{"strata_profile": 1, "widths": [1, 2], "layers": [[1, 2]], "first": [0, 0], '
     '"last": [0], "devices": ["cpu"]}', "last needs 2 non-negative seconds"),
    ('{"strata_profile": 1, "widths": [1, 2], "layers": [[1, 2]], "first": [0, 0], '
     '"last": [0, 0], "devices": ["cpu"], "settings": {"warp_drive": 1}}',
     "'warp_drive' is not an engine setting"),
    ('{"strata_profile": 1, "widths": [1], "layers": [[1]], "first": [0], "last": [0], '
     '"devices": ["cpu"], "colour": "red"}', "unknown keys colour"),
    ('{"strata_profile": 1, "widths": [1], "layers": [[1]], "first": [0], "last": [0], '
     '"devices": ["cpu"], "settings": {"spec": -3}}', "settings: --spec"),
])
def test_a_bad_profile_names_the_problem_and_the_fix(tmp_path, capsys, content, problem):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(StrataError, match=problem) as e:
        load_profile(path)
    assert "strata calibrate" in str(e.value)
    assert main(["serve", "--profile", str(path)]) == 2  # one line, no traceback
    err = capsys.readouterr().err
    assert problem.split("'")[0] in err and "Traceback" not in err


def test_profile_settings_are_defaults_that_flags_override(tmp_path):
    from strata.cli import build_parser, engine_config
    settings = {"layer_split": (3,), "devices": ("cpu", "cpu"), "spec": 4}
    args = build_parser(settings).parse_args(["serve", "--spec", "6"])
    config = engine_config(args)
    assert config.layer_split == (3,) and config.devices == ("cpu", "cpu")
    assert config.spec == 6  # the flag given wins


# -- the simulator ------------------------------------------------------------------------------
def test_the_clock_adds_stage_hop_and_host_times():
    p = profile(hop_seconds=1e-3, host_window_seconds=2e-3)
    one = synthetic_traces(1, 5, 41)
    solo = simulate(p, gpus(2, spec=0), one)
    # every window: 2 stages of 4 ms, 3 hops of 1 ms, then 2 ms on the host
    assert solo.streams[0].decode_tok_s == pytest.approx(1 / 0.013)
    # two groups, each a window of one token in flight: the trips overlap
    pair = simulate(p, gpus(2, spec=0), synthetic_traces(2, 5, 41))
    assert pair.total_tok_s > 1.6 * solo.total_tok_s
    assert all(b > 0 for b in pair.stage_busy)


def test_cpu_stages_share_the_cores():
    base = dict(devices=("cpu",) * 4, layer_split=(2, 4, 6), parallel=4, spec=0,
                stage_threads=1)
    traces = synthetic_traces(4, 5, 60)
    many = simulate(profile(cpu_cores=4, stage_threads=1), EngineConfig(**base), traces)
    few = simulate(profile(cpu_cores=2, stage_threads=1), EngineConfig(**base), traces)
    assert few.total_tok_s == pytest.approx(many.total_tok_s / 2, rel=0.1)


def test_greedy_traces_accept_drafts_as_far_as_they_match():
    p = profile()
    traces = [Trace((1, 2, 3, 1, 2, 3), (1, 2, 3, 1, 2, 3, 1, 5, 6, 7, 8, 9, 10, 11, 12, 13))]
    config = EngineConfig(parallel=1, spec=4, spec_type=("lookup",), lookup_min=2)
    result = simulate(p, config, traces)
    assert result.streams[0].tokens == 16
    assert result.drafts.accepted > 0 and result.drafts.drafted > result.drafts.accepted


def test_the_split_balances_stage_times():
    heavy_last = CostProfile(widths=WIDTHS, layers=(flat(1e-3),) * 12, first=flat(0.0),
                             last=flat(4e-3), devices=("cpu",))
    split = balanced_split(heavy_last, 2)
    costs = [c(4) for c in heavy_last.stage_costs(split)]
    assert split == (8,)  # 8 layers, then 4 layers + the head (4 layers' worth)
    assert max(costs) == pytest.approx(8e-3)


# -- load pricing -------------------------------------------------------------------------------
class Fixed:
    on_last_stage = False

    def __init__(self, scores):
        self.name, self.scores = "fixed", scores

    def start(self, rid, prompt): pass
    def extend(self, rid, tokens, stage_drafts=None): pass
    def finish(self, rid): pass

    def propose(self, rid, max_tokens):
        n = min(max_tokens, len(self.scores))
        return Draft(list(range(100, 100 + n)), self.scores[:n], self.name)


def drafted(pricing: LoadPricing, acceptance: float, room: int = 16) -> int:
    policy = DraftPolicy([Fixed([acceptance ** (j + 1) for j in range(room)])], 0.05,
                         load=pricing)
    draft = policy.draft(Request([1, 2, 3], SamplingParams(temperature=0)), room)
    return len(draft.tokens) if draft else 0


def cpu_like(w: float) -> float:
    """A CPU stage: 10 ms, and 0.4 ms more per token."""
    return 10e-3 + 0.4e-3 * (w - 1)


def test_alone_a_group_drafts_what_its_acceptance_warrants():
    pricing = LoadPricing(2, [cpu_like, cpu_like])
    pricing.load(1)
    assert drafted(pricing, 0.98) == 16
    assert 3 <= drafted(pricing, 0.7) < 16
    assert drafted(pricing, 0.02) == 0  # 2% of a token for 4% more time


def test_with_every_stage_busy_low_acceptance_drafts_get_shorter():
    alone = LoadPricing(2, [cpu_like, cpu_like])
    alone.load(1)
    busy = LoadPricing(2, [cpu_like, cpu_like])
    busy.load(2)  # the other group's windows make 9 tokens of 9 (its drafts pass)
    busy.observe(group=1, tokens=9, stage_seconds=[], committed=9, now=0.0)
    assert drafted(busy, 0.7) < drafted(alone, 0.7)
    assert drafted(busy, 0.98) >= 12  # drafts worth their time still go


def test_slots_of_one_window_draft_together():
    """A window whose cost rises steeply with its first extra tokens: priced one slot at a
    time, each slot would pay for the steep start alone and none would draft."""
    def steep(w: float) -> float:
        return 10e-3 if w <= 4 else 30e-3 + 0.1e-3 * (w - 5)
    pricing = LoadPricing(1, [steep])
    policy = DraftPolicy([Fixed([0.95 ** (j + 1) for j in range(8)])], 0.05, load=pricing)
    requests = [Request([1, 2, i], SamplingParams(temperature=0)) for i in range(4)]
    drafts = policy.draft_window(requests, [8] * 4, 64, window_tokens=4)
    assert all(d is not None and len(d.tokens) >= 6 for d in drafts)
    assert policy.draft(requests[0], 8, window_tokens=4) is None  # alone: not worth it


def test_the_fits_learn_stage_costs_from_windows():
    pricing = LoadPricing(2)
    for tokens in (1, 5, 9, 1, 5, 9):
        pricing.observe(0, tokens, [1e-3 * tokens, 2e-3], committed=1, now=0.0)
    assert pricing.curves[0](17) == pytest.approx(17e-3)
    assert pricing.curves[1](17) == pytest.approx(2e-3)


GREEDY = SamplingParams(temperature=0, max_tokens=40)


def repetitive(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(4):
        p = torch.randint(0, vocab, (6 + i,), generator=g).tolist()
        out.append(p * (2 + i % 2) + p[:3 + i])
    return out


@pytest.mark.parametrize("devices,split,with_profile", [
    (("cpu",), (), False), (("cpu",), (2,), True), (("cpu", "cpu"), (2,), False)])
def test_load_pricing_keeps_greedy_output(tiny_models, tmp_path, devices, split, with_profile):
    folder = str(tiny_models["llama"][0])
    reference = Engine(EngineConfig(model=folder, parallel=4, spec=0)).generate(
        repetitive(320), GREEDY)
    path = None
    if with_profile:
        path = tmp_path / "p.json"
        CostProfile(widths=WIDTHS, layers=(flat(1e-3, 1e-4),) * 4, first=flat(0.0),
                    last=flat(1e-3, 3e-4), devices=("cpu",)).save(path)
    engine = Engine(EngineConfig(model=folder, parallel=4, devices=devices, layer_split=split,
                                 spec_pricing="load", profile=str(path) if path else None,
                                 stage_threads=1))
    try:
        assert engine.generate(repetitive(320), GREEDY) == reference
        assert engine.draft_stats.accepted > 0
        assert engine.load is not None
    finally:
        engine.close()


# -- against reality, and the command --------------------------------------------------------
@pytest.fixture(scope="module")
def small_model(tmp_path_factory, gguf_tokenizer_reference):
    """A random llama big enough that its stages' compute shows (8 layers, hidden 256),
    with the default model's tokenizer and chat template."""
    from strata.tokenizer import Tokenizer
    folder = tmp_path_factory.mktemp("small")
    gguf_tokenizer_reference.save_pretrained(folder)
    vocab = Tokenizer.from_hf_folder(folder).vocab_size
    build_tiny("llama", folder, vocab_size=vocab, max_position_embeddings=4096,
               hidden_size=256, intermediate_size=768, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=4)
    return folder


@pytest.mark.parametrize("stages", [2, 4])
def test_the_simulator_predicts_real_stage_processes(small_model, stages):
    split = {2: (4,), 4: (2, 4, 6)}[stages]
    config = EngineConfig(model=str(small_model), devices=("cpu",) * stages, layer_split=split,
                          parallel=4, stage_threads=1, spec=8, spec_suffix_global=0)
    options = CalibrateOptions(out="", users=4, max_tokens=48, repeats=2, workloads=("code",))
    _, comparisons = compare(config, options)
    for c in comparisons:  # benchmarks/simulator_check.py prints the exact ratios
        # The total: a loaded 2-core machine moves its level between calibration and this
        # run (CI of stop 37: 1.24, with one stream at 1.47 of its prediction).
        assert 0.75 < c.ratio < 1.4, c
        # Each stream's share of the streams' mean rate, whose level the total bounds
        # (stops 27 and 37 each failed once on an absolute per-stream bound of 1.4, at 1.43
        # and 1.47; stop 37's shares agreed within 5%).
        real_mean = sum(c.real_streams) / len(c.real_streams)
        sim_mean = sum(c.sim_streams) / len(c.sim_streams)
        for real, sim in zip(sorted(c.real_streams), sorted(c.sim_streams)):
            assert 0.8 < (sim / sim_mean) / (real / real_mean) < 1.25, c


def test_calibrate_writes_a_profile_that_serve_accepts(gguf_path, tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = main(["calibrate", "--devices", "cpu,cpu", "--stage-threads", "1", "--out", str(out),
                 "--max-tokens", "12", "--users", "2", "--repeats", "1", "--context", "32",
                 "--workloads", "code"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "predicted by the simulator" in printed and "wrote" in printed
    data = json.loads(out.read_text())
    assert len(data["layers"]) == 30 and len(data["settings"]["layer_split"]) == 1
    assert set(data["traces"]) == {"code"}
    assert data["hop_seconds"] >= 0 and 0 < data["cpu_efficiency"] <= 1
    assert main(["calibrate", "--simulate", str(out), "--users", "2"]) == 0
    with running_server("--profile", str(out), "--spec-pricing", "load",
                        log=tmp_path / "serve.log") as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": "Say hi."}])
    assert reply.usage.completion_tokens == 8
    log = (tmp_path / "serve.log").read_text()
    assert "stage 1" in log  # the profile's split and devices: two stage processes
