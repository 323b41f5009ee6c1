"""Solo speed of one request: prefill tok/s and decode tok/s, and decode against its
bandwidth roofline.

    .venv/bin/python benchmarks/solo_speed.py                          # default model, CPU
    .venv/bin/python benchmarks/solo_speed.py --model random:smollm2-135m --devices cuda:0

Prints a table with the machine, commit and settings; `--record` appends the raw numbers
to benchmarks/results.jsonl. Prompts are random token ids: speed does not depend on them.
The roofline: the weight bytes one decode step reads (strata/weights/traffic.py: a MoE
layer's top-k experts, no embedding table, no KV cache) at the device's bandwidth (a
device-to-device copy, or `--bandwidth`), for stages in this process on one CUDA device.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.bench.timing import bandwidth
from strata.cli import add_engine_flags, engine_config
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.sampling.params import SamplingParams
from strata.weights.traffic import decode_bytes


def measure(engine: Engine, prompt_tokens: int, decode_tokens: int, seed: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds for decode_tokens - 1 steps) of one request."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.model_config.vocab_size, (prompt_tokens,), generator=gen)
    request = engine.add_request(prompt.tolist(), SamplingParams(
        temperature=0, max_tokens=decode_tokens, ignore_eos=True))
    start = time.perf_counter()
    while request.num_output_tokens == 0:
        engine.step()
    first = time.perf_counter()
    while not request.finished:
        engine.step()
    return first - start, time.perf_counter() - first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth", type=float,
                        help="device GB/s for the roofline (default: measured on CUDA)")
    add_record_flags(parser)
    add_engine_flags(parser, defaults={"spec": 0})  # plain decode unless --spec is given
    args = parser.parse_args()
    if args.max_window_tokens < args.prompt_tokens:
        args.max_window_tokens = args.prompt_tokens  # one prefill window
    try:
        config = engine_config(args)
        engine = Engine(config)
    except StrataError as e:
        print(f"solo_speed: error: {e}", file=sys.stderr)
        return 2
    measure(engine, min(args.prompt_tokens, 32), 4, seed=99)  # warm-up
    prefill, decode = [], []
    for i in range(args.repeats):
        p, d = measure(engine, args.prompt_tokens, args.decode_tokens, seed=i)
        prefill.append(args.prompt_tokens / p)
        decode.append((args.decode_tokens - 1) / d)
    model = args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)"
    settings = (f"devices={','.join(config.devices)} dtype={config.torch_dtype()} "
                f"kv={config.kv_dtype()} split={list(config.layer_split) or '-'} spec={config.spec} "
                f"threads={torch.get_num_threads()}")
    stages = getattr(engine.runner, "stages", [])
    weights = [f"stage {s.index}: {s.weights.describe()}" for s in stages
               if s.weights is not None]
    read = sum(decode_bytes(s.module) for s in stages) if stages else None
    devices = {torch.device(d) for d in config.devices}
    if args.bandwidth:
        speed = args.bandwidth * 1e9
    elif len(devices) == 1:
        speed = bandwidth(devices.pop())  # NaN off CUDA
    else:
        speed = math.nan  # stages on several devices: no one bandwidth
    roofline = speed / read if read else math.nan  # tok/s if a step were its reads alone
    line = "-" if read is None else f"{read / 2**20:.1f} MiB of weights a decode step"
    if not math.isnan(speed):
        line += f" at {speed / 1e9:.0f} GB/s ({'given' if args.bandwidth else 'measured'})"
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {model}\nsettings: {settings}")
    print("weights: " + ("; ".join(weights) or "in the stage processes (see their log)"))
    print(f"roofline: {line}\n")
    median = statistics.median(decode)
    print(markdown_table(
        ["prompt tokens", "decode tokens", "prefill tok/s (median)", "decode tok/s (median)",
         "roofline tok/s", "of the roofline"],
        [[args.prompt_tokens, args.decode_tokens, f"{statistics.median(prefill):.0f}",
          f"{median:.1f}", "-" if math.isnan(roofline) else f"{roofline:.0f}",
          "-" if math.isnan(roofline) else f"{median / roofline:.0%}"]]))
    record(args, {
        "benchmark": "solo_speed", "model": model, "settings": settings,
        "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
        "prefill_tok_s": prefill, "decode_tok_s": decode, "weights": weights,
        "decode_bytes": read, "bandwidth": None if math.isnan(speed) else speed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
