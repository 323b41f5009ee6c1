"""How `strata calibrate` chooses settings: a layer split that balances stage *times*
(the last stage's lm_head and verification counted), then the simulator's prediction of
the coding-agent table (1 user / N users per workload) for every candidate of groups,
draft length and pricing; the best N-user total wins among the candidates whose 1-user
rates stay within SOLO_SLACK of the best.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.calibrate.profile import CostProfile, Curve
from strata.calibrate.simulate import RunResult, Trace, simulate, synthetic_traces
from strata.config import EngineConfig

SOLO_SLACK = 0.97  # a candidate may lose this little of the best 1-user rate
TYPICAL_WIDTH = 4  # tokens of a typical window (a slot and its drafts), for balancing


def balanced_split(profile: CostProfile, num_stages: int,
                   width: int = TYPICAL_WIDTH) -> tuple[int, ...]:
    """The contiguous split into `num_stages` stages whose slowest stage at `width`
    tokens is fastest (exact, by dynamic programming over the layers)."""
    n = profile.num_layers
    if num_stages <= 1:
        return ()
    if num_stages > n:
        raise ValueError(f"{num_stages} stages for {n} layers")
    cost = [Curve(profile.widths, row)(width) for row in profile.layers]
    first, last = Curve(profile.widths, profile.first)(width), Curve(profile.widths, profile.last)(width)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    def stage(lo: int, hi: int) -> float:
        return prefix[hi] - prefix[lo] + (first if lo == 0 else 0.0) + (last if hi == n else 0.0)

    # best[k][i]: the slowest stage of the best split of layers i.. into k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    for i in range(n):
        best[1][i] = stage(i, n)
    for k in range(2, num_stages + 1):
        for i in range(n - k + 1):
            for j in range(i + 1, n - k + 2):
                value = max(stage(i, j), best[k - 1][j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    split, i = [], 0
    for k in range(num_stages, 1, -1):
        i = cut[k][i]
        split.append(i)
    return tuple(split)


@dataclass
class Prediction:
    name: str
    config: EngineConfig
    solo: dict[str, float]            # per workload: mean 1-user decode tok/s
    users: dict[str, RunResult]       # per workload: N users together

    def score(self) -> float:
        return sum(r.total_tok_s for r in self.users.values())


def predict(profile: CostProfile, config: EngineConfig, traces: dict[str, list[Trace]],
            acceptance: dict[str, float] | None = None, name: str = "") -> Prediction:
    """The table for one configuration: each workload's traces alone (the mean of their
    decode rates, as `strata bench` takes two solo requests) and all together."""
    solo, users = {}, {}
    for workload, runs in traces.items():
        p = acceptance.get(workload) if acceptance else None
        rates = [simulate(profile, config, [t], p).streams[0].decode_tok_s or 0.0
                 for t in runs[:2]]
        solo[workload] = sum(rates) / len(rates)
        users[workload] = simulate(profile, replace(config, parallel=max(config.parallel,
                                                                         len(runs))), runs, p)
    return Prediction(name, config, solo, users)


def synthetic(workloads: dict[str, float], users: int, prompt_tokens: int,
              output_tokens: int) -> dict[str, list[Trace]]:
    return {name: synthetic_traces(max(users, 2), prompt_tokens, output_tokens, seed=i)
            for i, name in enumerate(workloads)}


def candidates(profile: CostProfile, base: EngineConfig) -> list[tuple[str, EngineConfig]]:
    """Settings to compare: the balanced split (or the one given) with groups 1, one per
    stage and one more, drafts of 4, 8 and 16 tokens priced fixed or by load, and no
    drafts."""
    stages = len(base.devices)
    split = base.layer_split or balanced_split(profile, stages)
    out = []
    groups = sorted({1, min(stages, base.parallel), min(stages + 1, base.parallel)})
    for g in groups:
        out.append((f"groups {g}, no drafts",
                    replace(base, layer_split=split, batch_groups=g, spec=0)))
        for spec in (4, 8, 16):
            for pricing in ("fixed", "load"):
                out.append((f"groups {g}, spec {spec}, {pricing}",
                            replace(base, layer_split=split, batch_groups=g, spec=spec,
                                    spec_pricing=pricing)))
    return out


def choose(profile: CostProfile, base: EngineConfig, traces: dict[str, list[Trace]],
           acceptance: dict[str, float] | None = None) -> list[Prediction]:
    """Every candidate's prediction, best first."""
    predictions = [predict(profile, config, traces, acceptance, name)
                   for name, config in candidates(profile, base)]
    best_solo = max(sum(p.solo.values()) for p in predictions)
    return sorted(predictions, key=lambda p: (sum(p.solo.values()) < SOLO_SLACK * best_solo,
                                              -p.score()))


def table(predictions: list[Prediction]) -> tuple[list[str], list[list[str]]]:
    """Rows of the predicted coding-agent table: tok/s 1 user / N users per workload, and
    the N-user total over N x the 1-user rate."""
    workloads = list(predictions[0].solo)
    header = ["settings"] + [f"{w} 1 / N users" for w in workloads] + \
        [f"{w} N-user / (N x 1-user)" for w in workloads]
    rows = []
    for p in predictions:
        cells = [f"{p.solo[w]:.0f} / {p.users[w].total_tok_s:.0f}" for w in workloads]
        ratios = [f"{p.users[w].total_tok_s / (len(p.users[w].streams) * p.solo[w]):.2f}"
                  if p.solo[w] else "-" for w in workloads]
        rows.append([p.name] + cells + ratios)
    return header, rows
