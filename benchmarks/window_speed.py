"""Time of one window by its size: w tokens per slot (1 known + w - 1 drafts), 1 and 4
slots, and the host's share of it (scheduling, headers, metadata, launches, verifying).

    .venv/bin/python benchmarks/window_speed.py --model random:smollm2-135m --devices cuda:0

Each slot carries exactly w - 1 drafts every window (`--simulate-acceptance 0`: drafts are
made and all rejected, so every window has the same size). "host ms" is the window's time
minus the time the host waited for the GPU (the in-process runner's collect); on a GPU the
host and device overlap, so it bounds how fast windows can follow each other. "device ms"
is the stages' own time per window (on a GPU: CUDA events around each stage's work, the
C(w) a draft's tokens add to).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.cli import add_engine_flags, engine_config
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.sampling.params import SamplingParams


def measure(config, slots: int, window: int, steps: int,
            context: int = 64) -> tuple[float, float, float]:
    """(median ms per window, host ms per window, device ms per window) for `slots`
    requests of `window` tokens."""
    extra = dict(spec=window - 1, simulate_acceptance=0.0) if window > 1 else dict(spec=0)
    engine = Engine(dataclasses.replace(config, parallel=slots, **extra))
    gen = torch.Generator().manual_seed(slots * 100 + window)
    requests = [engine.add_request(
        torch.randint(0, engine.model_config.vocab_size, (context,), generator=gen).tolist(),
        SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True))
        for _ in range(slots)]
    while any(r.num_output_tokens < 8 for r in requests):  # prefill and warm-up
        engine.step()
    times = []

    def waited() -> float:  # only the in-process runner waits for a GPU in collect()
        return getattr(engine.runner, "device_wait_seconds", 0.0)

    wait = waited()
    device = sum(engine.stage_seconds)
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    host = total - (waited() - wait)
    device = sum(engine.stage_seconds) - device
    engine.close()
    return statistics.median(times) * 1e3, host / steps * 1e3, device / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", default="1,2,4,8,16,32", help="tokens per slot")
    parser.add_argument("--slots", default="1,4")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--context", type=int, default=64, help="prompt tokens of each slot")
    add_record_flags(parser)
    add_engine_flags(parser)
    args = parser.parse_args()
    try:
        config = engine_config(args)
    except StrataError as e:
        print(f"window_speed: error: {e}", file=sys.stderr)
        return 2
    rows, raw = [], []
    for slots in map(int, args.slots.split(",")):
        for window in map(int, args.windows.split(",")):
            ms, host, device = measure(config, slots, window, args.steps, args.context)
            rows.append([slots, window, slots * window, f"{ms:.2f}", f"{device:.2f}",
                         f"{host:.2f}", f"{host / slots:.2f}", f"{slots * 1e3 / ms:.0f}"])
            raw.append({"slots": slots, "window": window, "ms": ms, "host_ms": host,
                        "device_ms": device})
    model = args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)"
    settings = (f"devices={','.join(config.devices)} dtype={config.torch_dtype()} "
                f"attention={config.attention_backend} cuda-graphs={config.cuda_graphs} "
                f"compile={config.compile} schedule-ahead={config.schedule_ahead} "
                f"context={args.context}")
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {model}\nsettings: {settings}\n")
    print(markdown_table(["slots", "tokens per slot", "window tokens", "ms per window (median)",
                          "device ms per window", "host ms per window", "host ms per slot",
                          "tok/s if no draft is accepted"], rows))
    record(args, {"benchmark": "window_speed", "model": model, "settings": settings,
                  "rows": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
