"""The pipeline simulator against reality: calibrate a configuration (or read its profile),
then run each workload's sample prompts N at once for real and in the simulator, and print
the total and per-stream tok/s of both with their ratio.

    .venv/bin/python benchmarks/simulator_check.py --devices cpu,cpu,cpu,cpu --stage-threads 4
    .venv/bin/python benchmarks/simulator_check.py --profile p.json --devices cpu,cpu

The configuration is the engine flags given (or the profile's settings); the real run and
the simulation use the same requests, whose greedy outputs the calibration recorded.
"""

from __future__ import annotations

import argparse
import sys

from strata.bench.report import commit, machine, markdown_table
from strata.calibrate.check import compare
from strata.calibrate.command import CalibrateOptions
from strata.calibrate.profile import load_profile
from strata.cli import add_engine_flags, engine_config
from strata.errors import StrataError


def main() -> int:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--profile")
    given = first.parse_known_args()[0].profile
    try:
        profile = load_profile(given) if given else None
    except StrataError as e:
        print(f"simulator_check: error: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(parser, defaults={"parallel": 4, "spec_suffix_global": 0,
                                       **(profile.settings if profile else {})})
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="code,edit,prose")
    args = parser.parse_args()
    try:
        config = engine_config(args)
        options = CalibrateOptions(out="", users=args.users, max_tokens=args.max_tokens,
                                   repeats=args.repeats,
                                   workloads=tuple(args.workloads.split(",")))
        profile, comparisons = compare(config, options, profile)
    except StrataError as e:
        print(f"simulator_check: error: {e}", file=sys.stderr)
        return 2
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: model={config.model or 'default'} "
          f"devices={','.join(config.devices)} layer_split={','.join(map(str, config.layer_split))} "
          f"batch_groups={config.num_groups()} spec={config.spec} pricing={config.spec_pricing} "
          f"stage_threads={config.stage_threads} users={args.users} max_tokens={args.max_tokens}")
    print(f"profile: hop {profile.hop_seconds * 1e3:.3f} ms, engine "
          f"{profile.host_window_seconds * 1e3:.3f} ms/window, cpu efficiency "
          f"{profile.cpu_efficiency:.2f}")
    rows = [[c.workload, f"{c.real_total:.1f}", f"{c.sim_total:.1f}", f"{c.ratio:.2f}",
             " ".join(f"{x:.1f}" for x in c.real_streams),
             " ".join(f"{x:.1f}" for x in c.sim_streams)] for c in comparisons]
    print(markdown_table(["workload", "measured tok/s", "simulated tok/s", "ratio",
                          "measured streams", "simulated streams"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
