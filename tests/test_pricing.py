"""DraftPricing and StepMeter: drafting is charged what the engine's steps show it costs,
in the tokens the engine would have made meanwhile; the policy adds those prices to its
fixed costs; the engine feeds the pricing from its real steps."""

from __future__ import annotations

import random

import pytest

from strata.config import EngineConfig
from strata.drafting.draft import Draft
from strata.drafting.policy import DraftPolicy
from strata.drafting.pricing import MIN_STEPS, DraftPricing, StepMeter
from strata.engine.engine import Engine
from strata.request import Request
from strata.sampling.params import SamplingParams
from tests.test_policy import Fixed


def steps(pricing: DraftPricing, n: int, base: float, per_entry: float, per_token: float,
          rng: random.Random, noise: float = 0.0, slots: int = 4, draft_share: float = 0.5):
    """n steps of `slots` entries whose time is base + per_entry * drafted entries +
    per_token * drafted tokens (+ noise), each committing one token per slot."""
    for _ in range(n):
        entries = sum(rng.random() < draft_share for _ in range(slots))
        tokens = sum(rng.randint(1, 12) for _ in range(entries))
        seconds = base + per_entry * entries + per_token * tokens
        seconds *= 1 + noise * (2 * rng.random() - 1)
        pricing.observe(seconds, slots, entries, tokens, slots)


def test_recovers_what_drafts_cost_and_prices_it_in_tokens():
    pricing = DraftPricing()
    steps(pricing, 400, base=1e-3, per_entry=3e-4, per_token=2e-5, rng=random.Random(0),
          noise=0.05)
    _, _, c, d = pricing.coefficients
    assert c == pytest.approx(3e-4, rel=0.2)
    assert d == pytest.approx(2e-5, rel=0.3)
    # Each drafted entry is counted at launch and at commit: it costs 2c seconds, worth
    # 2c * rate tokens at the engine's rate.
    assert pricing.rate == pytest.approx(4 / (1e-3 + 2 * 3e-4 + 2 * 6.5 * 2e-5), rel=0.15)
    assert pricing.entry_cost == pytest.approx(2 * c * pricing.rate)
    assert pricing.token_cost == pytest.approx(2 * d * pricing.rate)
    assert 1.0 < pricing.entry_cost < 2.5


def test_free_drafts_cost_nothing_and_nothing_is_charged_early():
    pricing = DraftPricing()
    steps(pricing, int(MIN_STEPS) - 1, base=1e-3, per_entry=5e-3, per_token=0.0,
          rng=random.Random(1))
    assert pricing.entry_cost == 0.0 and pricing.token_cost == 0.0  # too few steps yet
    free = DraftPricing()
    steps(free, 300, base=1e-3, per_entry=0.0, per_token=0.0, rng=random.Random(2),
          noise=0.05)
    assert free.entry_cost < 0.1 and free.token_cost < 0.01


def test_no_drafts_seen_means_no_price():
    pricing = DraftPricing()
    steps(pricing, 200, base=1e-3, per_entry=0.0, per_token=0.0, rng=random.Random(3),
          noise=0.2, draft_share=0.0)
    assert pricing.entry_cost == 0.0 and pricing.token_cost == 0.0
    assert pricing.rate == pytest.approx(4000, rel=0.05)


def test_a_stall_is_left_out():
    pricing, stalled = DraftPricing(), DraftPricing()
    for p in (pricing, stalled):
        steps(p, 100, base=1e-3, per_entry=2e-4, per_token=0.0, rng=random.Random(4))
    stalled.observe(5.0, 4, 4, 40, 4)  # a compile, say: with drafts, 5000 steps long
    for p in (pricing, stalled):
        steps(p, 8, base=1e-3, per_entry=2e-4, per_token=0.0, rng=random.Random(5))
    assert stalled.coefficients == pricing.coefficients


def test_the_price_follows_the_load():
    """Drafts that turn costly (the host became the bottleneck) are priced up within the
    forgetting horizon, and back down when they are free again."""
    pricing, rng = DraftPricing(), random.Random(6)
    steps(pricing, 300, base=1e-3, per_entry=0.0, per_token=0.0, rng=rng, noise=0.05)
    cheap = pricing.entry_cost
    steps(pricing, 300, base=1e-3, per_entry=5e-4, per_token=0.0, rng=rng, noise=0.05)
    costly = pricing.entry_cost
    steps(pricing, 400, base=1e-3, per_entry=0.0, per_token=0.0, rng=rng, noise=0.05)
    assert cheap < 0.2 < 1.0 < costly and pricing.entry_cost < 0.3


def request() -> Request:
    return Request([1, 2, 3], SamplingParams(temperature=0))


def test_the_policy_adds_measured_prices_to_its_fixed_costs():
    proposer = Fixed("p", [5, 6, 7, 8], [0.95, 0.9, 0.7, 0.3])
    pricing = DraftPricing()
    policy = DraftPolicy([proposer], token_cost=0.05, pricing=pricing)
    assert policy.draft(request(), room=8, window_cost=1.0).tokens == [5, 6, 7, 8]
    pricing.token_cost = 0.4          # tokens worth 0.3 now cost more than they gain
    assert policy.draft(request(), room=8, window_cost=1.0).tokens == [5, 6, 7]
    pricing.entry_cost = 0.8          # gain 0.55 + 0.5 + 0.3 = 1.35 < 1.0 + 0.8: not sent
    assert policy.draft(request(), room=8, window_cost=1.0) is None
    assert policy.draft(request(), room=8, window_cost=0.0).tokens == [5, 6, 7]
    fixed = DraftPolicy([proposer], token_cost=0.05)  # --spec-pricing fixed
    assert fixed.draft(request(), room=8, window_cost=1.0).tokens == [5, 6, 7, 8]


class FakeWindow:
    def __init__(self, drafts: list[int | None], samples: list[bool] | None = None):
        class Header:
            pass
        self.header = Header()
        self.header.slots = list(range(len(drafts)))
        self.header.samples = samples or [True] * len(drafts)
        self.header.logits_all = False
        self.drafts = [Draft([7] * n, [1.0] * n, "p") if n else None for n in drafts]


class Recorder(DraftPricing):
    def __init__(self):
        super().__init__()
        self.seen = []

    def observe(self, *args):
        self.seen.append(args)


def test_the_meter_counts_a_step_from_commit_to_commit():
    pricing = Recorder()
    meter = StepMeter(pricing)
    first = FakeWindow([3, None])
    meter.launched(first, now=10.0, idle=True)           # wakes an idle engine
    meter.launched(FakeWindow([None, 2]), now=10.0, idle=False)
    meter.committed(first, [[1, 2], [3]], now=10.004)
    # 4 ms; 2 entries; drafted: launched 3 + 2 tokens (2 entries), committed 3 (1 entry)
    assert pricing.seen == [(pytest.approx(0.004), 2, 3, 8, 3)]
    meter.committed(FakeWindow([None, 2]), [[4], [5, 6, 7]], now=10.005)
    assert pricing.seen[-1] == (pytest.approx(0.001), 2, 1, 2, 4)
    prompt = FakeWindow([None, None], samples=[True, False])
    meter.launched(prompt, now=10.005, idle=False)
    meter.committed(FakeWindow([None]), [[1]], now=10.006)  # a prompt launched: left out
    meter.committed(prompt, [[1]], now=10.007)               # a prompt committed: left out
    assert len(pricing.seen) == 2
    meter.committed(FakeWindow([None]), [[1]], now=10.008)
    assert pricing.seen[-1] == (pytest.approx(0.001), 1, 0, 0, 1)


@pytest.mark.parametrize("pricing,ahead", [("measured", "on"), ("measured", "off"),
                                           ("fixed", "on")])
def test_the_engine_feeds_its_pricing_and_output_stays_lossless(tiny_models, pricing, ahead):
    folder = tiny_models["llama"][0]
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [9, 8, 7, 9, 8, 7, 9, 8], [4, 4, 4]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(folder), spec=0, parallel=3))
    want = plain.generate(prompts, params)
    engine = Engine(EngineConfig(model=str(folder), spec=4, parallel=3, spec_pricing=pricing,
                                 schedule_ahead=ahead))
    assert engine.generate(prompts, params) == want
    policy = engine.scheduler.drafts
    if pricing == "fixed":
        assert policy.pricing is None and engine.meter is None
    else:
        assert policy.pricing._weight > 10 and policy.pricing.rate > 0
        assert engine.draft_stats.drafted > 0


def test_metrics_show_the_measured_prices():
    from strata.server.metrics import Metrics
    pricing = DraftPricing()
    pricing.entry_cost, pricing.token_cost = 1.25, 0.125
    metrics = Metrics()
    metrics.observe_pricing(pricing)
    text = metrics.render().decode()
    assert 'strata_draft_price_tokens{per="entry"} 1.25' in text
    assert 'strata_draft_price_tokens{per="token"} 0.125' in text
