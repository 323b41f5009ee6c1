"""C_s(w): each stage's time for a window of w tokens of one slot, relative to w = 1 — the
cost model of docs/BATCHING.md (what a draft token costs a busy stage).

    .venv/bin/python benchmarks/stage_cost.py --layer-split 10,20,28          # default model, CPU
    .venv/bin/python benchmarks/stage_cost.py --model random:smollm2-135m --devices cuda:0 --layer-split 15

The stages run in this process, each timed alone on a slot that already holds a
`--context`-token prefix (the KV of random tokens). Prints milliseconds per window and the
ratio to a one-token window per stage, with machine, commit and settings; `--record`
appends the raw numbers to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import sys

import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.calibrate.measure import stage_inputs, time_stage
from strata.cli import add_engine_flags, engine_config
from strata.engine.engine import Engine
from strata.errors import StrataError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_flags(parser)
    add_engine_flags(parser)
    parser.add_argument("--widths", default="1,2,4,8,16,32", help="window widths to time")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the slot")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = engine_config(args)
        if config.stage_processes:
            raise StrataError("stage_cost times stages in this process: give one device "
                              "(e.g. --devices cpu), not one per stage")
        engine = Engine(config)
    except StrataError as e:
        print(f"stage_cost: error: {e}", file=sys.stderr)
        return 2
    results = {}
    with torch.inference_mode():
        for width in widths:
            inputs = stage_inputs(engine, width, args.context)
            results[width] = [time_stage(stage, x, header, args.repeats)
                              for stage, (x, header) in zip(engine.runner.stages, inputs)]
    stages = engine.runner.stages
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: model={config.model or 'default'} "
          f"devices={','.join(config.devices)} layer_split={','.join(map(str, config.layer_split))} "
          f"dtype={config.torch_dtype()} context={args.context} threads={torch.get_num_threads()} "
          f"repeats={args.repeats} (median)")
    header = ["w"] + [f"stage {i} ({s.layers[0]}-{s.layers[1] - 1}) ms / ×w=1"
                      for i, s in enumerate(stages)]
    rows = [[str(w)] + [f"{t * 1e3:.2f} / {t / results[widths[0]][i]:.2f}"
                        for i, t in enumerate(results[w])] for w in widths]
    print(markdown_table(header, rows))
    record(args, {
        "benchmark": "stage_cost", "settings": {
            "model": config.model, "devices": list(config.devices),
            "layer_split": list(config.layer_split), "dtype": str(config.torch_dtype()),
            "context": args.context, "threads": torch.get_num_threads()},
        "seconds": {str(w): results[w] for w in widths}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
