"""Where a decode step's device time goes: each kernel's time per generated token.

    .venv/bin/python benchmarks/kernel_profile.py --model random:qwen3-30b-a3b --devices cuda:0
    .venv/bin/python benchmarks/kernel_profile.py --model random:qwen3-30b-a3b --devices cuda:0 --pdl off

One request (random prompt ids, greedy, `--decode-tokens` tokens) decodes under
torch.profiler; every CUDA kernel it ran, graph replays included, is summed by name and
divided by the tokens decoded. Prints the machine, commit and settings, then a table of
kernels (launches a token, us a token, share of the kernels' time) and the decode's wall
time a token. With PDL on (`--pdl on`, the default on Hopper) a kernel's span includes its
wait for the one before it, so spans overlap and their sum exceeds the wall time: give
`--pdl off` to attribute time to kernels. The profiler's own cost slows the wall clock a
little; benchmarks/solo_speed.py gives the speed. `--record` appends the raw numbers to
benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.cli import add_engine_flags, engine_config
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.sampling.params import SamplingParams


def decode(engine: Engine, prompt_tokens: int, decode_tokens: int, seed: int,
           profiler=None) -> float:
    """Seconds from the first generated token to the last, of one greedy request; the
    profiler (if any) records that span only."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.model_config.vocab_size, (prompt_tokens,), generator=gen)
    request = engine.add_request(prompt.tolist(), SamplingParams(
        temperature=0, max_tokens=decode_tokens, ignore_eos=True))
    while request.num_output_tokens == 0:
        engine.step()
    if profiler is not None:
        profiler.start()
    start = time.perf_counter()
    while not request.finished:
        engine.step()
    seconds = time.perf_counter() - start
    if profiler is not None:
        torch.cuda.synchronize()
        profiler.stop()
    return seconds


def kernel_times(profiler) -> dict[str, list[float]]:
    """Kernel name -> its spans (us) on the device."""
    spans: dict[str, list[float]] = collections.defaultdict(list)
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            spans[event.name].append(event.time_range.elapsed_us())
    return spans


def short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=20, help="kernels listed (the rest summed)")
    add_record_flags(parser)
    add_engine_flags(parser, defaults={"spec": 0})
    args = parser.parse_args()
    if args.max_window_tokens < args.prompt_tokens:
        args.max_window_tokens = args.prompt_tokens
    if not torch.cuda.is_available():
        print("kernel_profile: needs a CUDA device (give --devices cuda:0)", file=sys.stderr)
        return 2
    try:
        config = engine_config(args)
        engine = Engine(config)
    except StrataError as e:
        print(f"kernel_profile: error: {e}", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    decode(engine, min(args.prompt_tokens, 32), 8, seed=99)  # warm-up
    wall = decode(engine, args.prompt_tokens, args.decode_tokens, seed=1)
    profiler = profile(activities=[ProfilerActivity.CUDA])
    profiled_wall = decode(engine, args.prompt_tokens, args.decode_tokens, seed=2, profiler=profiler)
    steps = args.decode_tokens - 1
    spans = kernel_times(profiler)
    total = sum(sum(s) for s in spans.values())
    ranked = sorted(spans.items(), key=lambda kv: -sum(kv[1]))
    rows = [[short(name), f"{len(s) / steps:.1f}", f"{sum(s) / steps:.1f}",
             f"{sum(s) / total:.1%}"] for name, s in ranked[:args.top]]
    rest = ranked[args.top:]
    if rest:
        rest_us = sum(sum(s) for _, s in rest)
        rows.append([f"({len(rest)} others)", f"{sum(len(s) for _, s in rest) / steps:.1f}",
                     f"{rest_us / steps:.1f}", f"{rest_us / total:.1%}"])
    rows.append(["all kernels", f"{sum(len(s) for s in spans.values()) / steps:.1f}",
                 f"{total / steps:.1f}", "100%"])
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {args.model or 'default'}\n"
          f"settings: devices={','.join(config.devices)} dtype={config.torch_dtype()} "
          f"pdl={config.pdl} prompt={args.prompt_tokens} decode={args.decode_tokens}\n")
    print(markdown_table(["kernel", "launches a token", "us a token", "share"], rows))
    print(f"\ndecode wall time a token: {wall / steps * 1e6:.1f} us "
          f"({steps / wall:.1f} tok/s); under the profiler {profiled_wall / steps * 1e6:.1f} us")
    record(args, {"benchmark": "kernel_profile", "model": args.model or "default",
                  "pdl": config.pdl, "wall_us_per_token": wall / steps * 1e6,
                  "kernels_us_per_token": {name: sum(s) / steps for name, s in ranked}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
