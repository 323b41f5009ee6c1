"""The simulator against reality: calibrate a configuration, then run the same requests
for real (N at once) and in the simulator, and compare the total and per-stream tok/s.
Used by `benchmarks/simulator_check.py` (the exact ratios) and the tests (generous bounds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.calibrate.command import CalibrateOptions, measure_profile
from strata.calibrate.measure import concurrent_run
from strata.calibrate.profile import CostProfile
from strata.calibrate.simulate import Trace, simulate
from strata.config import EngineConfig


@dataclass
class Comparison:
    workload: str
    real_total: float         # tok/s, N requests together
    sim_total: float
    real_streams: list[float]  # each stream's decode tok/s
    sim_streams: list[float]

    @property
    def ratio(self) -> float:
        """Simulated over measured total."""
        return self.sim_total / self.real_total if self.real_total else float("inf")


def compare(config: EngineConfig, options: CalibrateOptions,
            profile: CostProfile | None = None) -> tuple[CostProfile, list[Comparison]]:
    """Calibrate `config` (unless a profile is given), then for each workload run its
    sample prompts together with `config` for real and simulated."""
    if profile is None:
        profile, _ = measure_profile(config, options)
    from strata.weights.checkpoint import open_checkpoint
    checkpoint = open_checkpoint(config.model, config.mtp_model)
    out = []
    for name, pairs in profile.traces.items():
        if name not in options.workloads:
            continue
        pairs = pairs[:options.users]
        traces = [(tuple(p), tuple(o)) for p, o in pairs]
        tokens = max(len(o) for _, o in traces)
        config_n = replace(config, parallel=max(config.parallel, len(traces)))
        real, wall = concurrent_run(config_n, checkpoint, [list(p) for p, _ in traces], tokens)
        sim = simulate(profile, config_n, [Trace(p, o) for p, o in traces])
        out.append(Comparison(
            name, sum(n for n, _, _ in real) / wall, sim.total_tok_s,
            [(n - 1) / (last - first) if last > first else 0.0 for n, first, last in real],
            [s.decode_tok_s or 0.0 for s in sim.streams]))
    return profile, out
