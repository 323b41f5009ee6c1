"""What `strata calibrate` measures for --experts-in-ram: the settings of the expert cache
that only a run on the real devices can choose, --pcie-frac (how much of a window's reads
may be uploaded into the cache) and --expert-prefetch (experts uploaded one layer ahead).

Each candidate runs the sample prompts `users` at once through an engine of the chosen
split (measure.concurrent_run), and the fastest in total tokens per second wins; ties go
to the earlier candidate, the defaults first. The PCIe link, the cache's size and the
model's routing decide it, and none of them can be simulated from layer times.
"""

from __future__ import annotations

from dataclasses import replace

from strata.config import EngineConfig

# (--pcie-frac, --expert-prefetch), the defaults first
CANDIDATES = ((1.0, 0), (1.0, 2), (0.25, 0), (0.0, 0))
TOKENS = 32  # per request and candidate


def choose_offload(config: EngineConfig, checkpoint, prompts: list[list[int]],
                   say=print) -> tuple[dict, list[list[str]]]:
    """The best candidate as profile settings, and a table row per candidate."""
    from strata.calibrate.measure import concurrent_run
    results = []
    for frac, prefetch in CANDIDATES:
        say(f"expert cache: --pcie-frac {frac:g} --expert-prefetch {prefetch}, "
            f"{len(prompts)} requests at once")
        run, wall = concurrent_run(replace(config, pcie_frac=frac, expert_prefetch=prefetch),
                                   checkpoint, prompts, TOKENS)
        results.append((sum(n for n, _, _ in run) / wall, frac, prefetch))
    best = max(results, key=lambda r: r[0])  # the first of equals
    rows = [[f"{frac:g}", str(prefetch), f"{rate:.1f}",
             "chosen" if (rate, frac, prefetch) == best else ""]
            for rate, frac, prefetch in results]
    return {"pcie_frac": best[1], "expert_prefetch": best[2]}, rows
