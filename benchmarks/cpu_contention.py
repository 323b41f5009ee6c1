"""How much CPU stages slow each other down, with no pipeline between them: P processes of
T threads each decode the same model on their own (one engine each, `--devices cpu`), first
one at a time, then all at once, and the table gives each one's windows a second alone and
together. Their ratio bounds what any scheduler can get from P CPU stage processes of T
threads on this machine: a stage computing beside the others runs at that share of its
speed alone, so P pipelined requests make at most that share of P x one request's rate
(docs/BATCHING.md, "What the CPU allows").

    .venv/bin/python benchmarks/cpu_contention.py --model random:smollm2-135m \
        --processes 4 --threads 4 --slots 1

Each process runs `--slots` requests of random token ids (`--spec 0`, so every window is
the same size) and counts the windows it finishes in `--seconds`.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import sys
import time

import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.cli import add_engine_flags, engine_config
from strata.errors import StrataError


def _run(engine, seconds: float) -> float:
    """Windows a second over `seconds` of decoding."""
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - start)


def _worker(index: int, config, threads: int, slots: int, seconds: float, processes: int,
            barrier, results) -> None:
    """One process: build an engine, decode alone in its turn, then beside the others."""
    from strata.engine.engine import Engine
    from strata.sampling.params import SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(config)
    try:
        gen = torch.Generator().manual_seed(index)
        for _ in range(slots):
            prompt = torch.randint(0, engine.model_config.vocab_size, (64,), generator=gen)
            engine.add_request(prompt.tolist(), SamplingParams(
                temperature=0, max_tokens=1_000_000, ignore_eos=True))
        for _ in range(8):  # prefill and warm-up
            engine.step()
        barrier.wait()
        alone = 0.0
        for turn in range(processes):
            if turn == index:
                alone = _run(engine, seconds)
            barrier.wait()
        together = _run(engine, seconds)
        results.put((index, alone, together))
    finally:
        engine.close()


def measure(config, processes: int, threads: int, slots: int, seconds: float) -> list[tuple]:
    """[(process, windows/s alone, windows/s together)] for `processes` engines."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(i, config, threads, slots, seconds,
                                                 processes, barrier, results))
               for i in range(processes)]
    for w in workers:
        w.start()
    timeout = 600 + 2 * seconds * (processes + 1)
    rows = [results.get(timeout=timeout) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    return sorted(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", default="4", help="comma-separated counts to try")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of each process (default: the cores shared out)")
    parser.add_argument("--slots", type=int, default=1, help="requests in each engine")
    parser.add_argument("--seconds", type=float, default=10.0)
    add_record_flags(parser)
    add_engine_flags(parser, defaults={"spec": 0, "devices": "cpu"})
    args = parser.parse_args()
    try:
        config = dataclasses.replace(engine_config(args), parallel=args.slots)
    except StrataError as e:
        print(f"cpu_contention: error: {e}", file=sys.stderr)
        return 2
    if any(d != "cpu" for d in config.devices):
        print("cpu_contention: error: it measures CPU engines: use --devices cpu",
              file=sys.stderr)
        return 2
    cores = multiprocessing.cpu_count()
    table, raw = [], []
    for processes in map(int, args.processes.split(",")):
        threads = args.threads or max(1, cores // processes)
        rows = measure(config, processes, threads, args.slots, args.seconds)
        alone = [a for _, a, _ in rows]
        together = [t for _, _, t in rows]
        shares = [t / a for a, t in zip(alone, together)]
        table.append([processes, threads, " ".join(f"{a:.1f}" for a in alone),
                      " ".join(f"{t:.1f}" for t in together),
                      f"{statistics.mean(shares):.2f} ({min(shares):.2f}-{max(shares):.2f})"])
        raw.append({"processes": processes, "threads": threads, "alone": alone,
                    "together": together})
    model = args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)"
    settings = (f"cores={cores} dtype={config.torch_dtype()} slots={args.slots} "
                f"seconds={args.seconds}")
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {model}\nsettings: {settings}\n")
    print(markdown_table(["processes", "threads each", "windows/s alone",
                          "windows/s all at once", "share of its speed alone"], table))
    record(args, {"benchmark": "cpu_contention", "model": model, "settings": settings,
                  "rows": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
