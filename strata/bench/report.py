"""What every benchmark prints with its numbers: the machine, the commit and the
settings; a markdown table; and a JSON line appended to a results file."""

from __future__ import annotations

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
