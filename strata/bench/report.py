"""What every benchmark prints with its numbers: the machine, the commit and the
settings; a markdown table; and, when asked (`--record`, `--results FILE`), a JSON line
appended to a results file. Nothing is appended by default: benchmarks/results.jsonl is
tracked, and a run that wrote to it would mark every later run "+dirty"."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        text += f", {torch.cuda.device_count()}x {'/'.join(sorted(names))}"
    return text


def commit() -> str:
    """The checkout's short commit (+dirty where tracked files changed), or where this
    copy was packed by benchmarks/ab_speed.py, the COMMIT file it wrote."""
    packed = Path(__file__).resolve().parents[2] / "COMMIT"
    if packed.exists():
        return packed.read_text().strip() + " (packed copy)"
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent,
                               timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def append_result(path: str | Path, record: dict) -> None:
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(),
              "commit": commit(), **record}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results.jsonl"


def add_record_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", action="store_true", help="append the raw numbers to "
                        "benchmarks/results.jsonl (tracked: commit them with the tables)")
    parser.add_argument("--results", metavar="FILE", help="append the raw numbers to FILE")


def record(args: argparse.Namespace, result: dict) -> None:
    """Append `result` where --results or --record say; say where, or how to keep it."""
    path = args.results or (RESULTS if args.record else None)
    if path is None:
        print("\n(raw numbers not kept: --record appends them to benchmarks/results.jsonl, "
              "--results FILE elsewhere)")
        return
    append_result(path, result)
    print(f"\nraw numbers appended to {path}")
