"""Host time of one window's verification (`Verifier.decide`) by its entries and drafts:
the engine's share of a drafted window that no graph hides.

    .venv/bin/python benchmarks/verify_speed.py --device cuda:0

Greedy entries with every draft wrong but the first (the work does not depend on the
values), logits of the default model's vocabulary. "host us" is the time `decide` takes to
return (its launches queued); "us to done" waits for the device too.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.sampling.params import SamplingParams
from strata.sampling.verifier import Verifier, VerifyEntry


def measure(device: torch.device, entries: int, drafts: int, vocab: int,
            calls: int) -> tuple[float, float]:
    """(host us, us to done) per decide call of `entries` greedy entries of `drafts` drafts."""
    greedy = SamplingParams(temperature=0)
    logits = torch.randn(entries * (drafts + 1), vocab, device=device, dtype=torch.bfloat16)
    top = logits.argmax(dim=-1).tolist()
    window = [VerifyEntry(greedy, f"r{i}", [top[i * (drafts + 1)]] + [-1] * (drafts - 1)
                          if drafts else []) for i in range(entries)]
    verifier = Verifier()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(20):
        verifier.decide(logits, window)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        verifier.decide(logits, window)
    host = time.perf_counter() - start
    sync()
    done = time.perf_counter() - start
    return host / calls * 1e6, done / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="1x0,1x8,4x0,4x2,4x8",
                        help="entries x drafts per entry, comma-separated")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--calls", type=int, default=500)
    add_record_flags(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows, raw = [], []
    for shape in args.shapes.split(","):
        entries, drafts = map(int, shape.split("x"))
        host, done = measure(device, entries, drafts, args.vocab, args.calls)
        rows.append([entries, drafts, f"{host:.1f}", f"{done:.1f}"])
        raw.append({"entries": entries, "drafts": drafts, "host_us": host, "done_us": done})
    settings = f"device={device} vocab={args.vocab} calls={args.calls} greedy"
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: {settings}\n")
    print(markdown_table(["entries", "drafts each", "host us a call", "us to done"], rows))
    record(args, {"benchmark": "verify_speed", "settings": settings, "rows": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
