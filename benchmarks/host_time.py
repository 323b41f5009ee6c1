"""Where an engine step's host time goes: N streams of the bench's workloads through the
engine in this process (as benchmarks/engine_streams.py steps them), with timers around
the scheduler's, proposers', stages' and verifier's functions; ms per step and us per
call of each, beside the stages' device time and the wait for it.

    .venv/bin/python benchmarks/host_time.py --devices cuda:0 --spec-suffix-global 0 \\
        --spec 8 --users 4 --workloads code,edit,prose

Timers nest (a scheduler's step holds its proposers' calls), so the rows do not add up.
`--gc-freeze` freezes the loaded engine out of the collector's passes, as the server does.
`--ops N` adds, per workload, torch.profiler's N operators with the most host time of
their own (torch ops, and on a GPU the CUDA runtime's calls: launches, graph launches,
copies, event records, synchronisations), per step; the profiler's own cost inflates them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gc
import sys
import time

import torch
from engine_streams import streams

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.cli import add_engine_flags, engine_config
from strata.drafting.lookup import LookupProposer
from strata.drafting.policy import DraftPolicy
from strata.drafting.suffix_tree import SuffixProposer
from strata.engine.engine import Engine
from strata.engine.stalls import gc_clock
from strata.errors import StrataError
from strata.llm import LLM
from strata.sampling.verifier import Verifier
from strata.scheduler.scheduler import Scheduler
from strata.stage.results import WindowVerifier
from strata.stage.runner import ModelRunner
from strata.stage.stage import Stage

TIMED = [(Engine, ["step", "launch"]),
         (Scheduler, ["schedule", "schedule_ahead", "commit", "_on_a_guess", "_with_draft",
                      "_build", "_admit"]),
         (DraftPolicy, ["draft", "committed"]),
         (SuffixProposer, ["extend", "propose"]), (LookupProposer, ["extend", "propose"]),
         (ModelRunner, ["submit", "collect", "_carried"]),
         (Stage, ["prepare", "forward"]),
         (WindowVerifier, ["launch", "finish"]), (Verifier, ["decide"])]


def timed(seconds: collections.Counter, calls: collections.Counter) -> None:
    """Wrap every TIMED function with a timer adding to `seconds` and `calls`."""
    for cls, names in TIMED:
        for name in names:
            function, label = getattr(cls, name), f"{cls.__name__}.{name}"

            @functools.wraps(function)
            def wrapper(*args, function=function, label=label, **kwargs):
                start = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    seconds[label] += time.perf_counter() - start
                    calls[label] += 1

            setattr(cls, name, wrapper)


@contextlib.contextmanager
def profiled(ops: int, cuda: bool):
    """torch.profiler around the block when `ops` > 0 (with the CUDA runtime's calls when
    `cuda`), else None."""
    if ops <= 0:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield prof


def top_ops(prof, n: int, steps: int) -> list[list[str]]:
    """The `n` operators with the most host time of their own, per step."""
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [[e.key, f"{e.self_cpu_time_total / max(steps, 1):.1f}",
             f"{e.count / max(steps, 1):.2f}"] for e in events]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--workloads", default="code,edit,prose")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--tag", default="h", help="the prompts' tag (as the bench's seed)")
    parser.add_argument("--gc-freeze", action="store_true")
    parser.add_argument("--ops", type=int, default=0,
                        help="also the N operators with the most host time of their own")
    add_record_flags(parser)
    add_engine_flags(parser)
    args = parser.parse_args()
    try:
        config = engine_config(args)
        llm = LLM(dataclasses.replace(config, parallel=max(config.parallel, args.users)))
    except StrataError as e:
        print(f"host_time: error: {e}", file=sys.stderr)
        return 2
    streams(llm, "code", 1, 50, "warm")
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    seconds, calls = collections.Counter(), collections.Counter()
    timed(seconds, calls)
    engine, clock = llm.engine, gc_clock()
    model = args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)"
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {model}\nsettings: "
          f"devices={','.join(config.devices)} spec={config.spec} users={args.users} "
          f"max-tokens={args.max_tokens} gc-freeze={args.gc_freeze}\n")
    raw = []
    for name in args.workloads.split(","):
        seconds.clear()
        calls.clear()
        wait, device = engine.runner.device_wait_seconds, sum(engine.stage_seconds)
        collected = sum(clock.seconds)
        drafted, accepted = engine.draft_stats.drafted, engine.draft_stats.accepted
        with profiled(args.ops, torch.cuda.is_available()) as profile:
            r = streams(llm, name, args.users, args.max_tokens, f"{args.tag}{name[:2]}")
        steps = calls["Engine.step"]
        device = (sum(engine.stage_seconds) - device) / max(calls["Stage.forward"], 1)
        wait = (engine.runner.device_wait_seconds - wait) / steps
        collected = (sum(clock.seconds) - collected) / steps
        print(f"{name} x{args.users}: {r['tok_s']:.0f} tok/s ({min(r['stream_tok_s']):.0f}-"
              f"{max(r['stream_tok_s']):.0f} each), {engine.draft_stats.accepted - accepted}/"
              f"{engine.draft_stats.drafted - drafted} drafts accepted; {steps} steps; device "
              f"{1e3 * device:.3f} ms a window, waited for {1e3 * wait:.3f} ms a step; the "
              f"collector {1e3 * collected:.3f} ms a step\n")
        rows = [[label, f"{1e3 * s / steps:.3f}", f"{calls[label] / steps:.2f}",
                 f"{1e6 * s / calls[label]:.1f}"]
                for label, s in sorted(seconds.items(), key=lambda kv: -kv[1])]
        print(markdown_table(["function", "ms per step", "calls per step", "us per call"],
                             rows) + "\n")
        if profile is not None:
            print(markdown_table(["operator", "host us per step (its own)", "calls per step"],
                                 top_ops(profile, args.ops, steps)) + "\n")
        raw.append({"workload": name, "tok_s": r["tok_s"], "steps": steps,
                    "seconds": dict(seconds), "calls": dict(calls)})
    record(args, {"benchmark": "host_time", "model": model, "rows": raw})
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
