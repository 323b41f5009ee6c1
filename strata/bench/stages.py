"""Each stage's busy fraction while a measurement ran: the server's
`strata_stage_busy_seconds` counters (compute time per stage) read from /metrics before
and after, over the measurement's wall time; the last number is the scheduler's
(`strata_scheduler_busy_seconds`). Servers without these counters give None."""

from __future__ import annotations

import re
import time

import httpx

_SAMPLE = re.compile(r'^strata_stage_busy_seconds_total\{stage="(\d+)"\} (\S+)$', re.M)
_SCHEDULER = re.compile(r'^strata_scheduler_busy_seconds_total (\S+)$', re.M)


def busy_seconds(base_url: str) -> list[float] | None:
    """Busy seconds of each stage, then of the scheduler."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        text = httpx.get(f"{root}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    samples = {int(stage): float(value) for stage, value in _SAMPLE.findall(text)}
    if not samples:
        return None
    scheduler = _SCHEDULER.search(text)
    return [samples[s] for s in sorted(samples)] + [float(scheduler[1]) if scheduler else 0.0]


class BusyMeter:
    """with BusyMeter(url) as meter: ...; meter.fractions -> [per stage..., scheduler]
    or None."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.fractions: list[float] | None = None

    def __enter__(self) -> BusyMeter:
        self.before = busy_seconds(self.base_url)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.start
        after = busy_seconds(self.base_url)
        if self.before is None or after is None or wall <= 0:
            return
        before = self.before + [0.0] * (len(after) - len(self.before))
        self.fractions = [round((a - b) / wall, 3) for a, b in zip(after, before)]
