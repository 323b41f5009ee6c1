"""Each stage's busy fraction while a measurement ran: the server's
`strata_stage_busy_seconds` counters (compute time per stage) read from /metrics before
and after, over the measurement's wall time; the last number is the scheduler's
(`strata_scheduler_busy_seconds`). Servers without these counters give None. With
--experts-in-ram, each stage's expert cache over the measurement too: its hit rate
(`strata_expert_reads_total`), the bytes it uploaded (`strata_expert_bytes_total`) and
the upload time the compute waited for (`strata_expert_exposed_seconds_total`)."""

from __future__ import annotations

import re
import time

import httpx

_SAMPLE = re.compile(r'^strata_stage_busy_seconds_total\{stage="(\d+)"\} (\S+)$', re.M)
_SCHEDULER = re.compile(r'^strata_scheduler_busy_seconds_total (\S+)$', re.M)
_EXPERTS = re.compile(r'^strata_expert_reads_total\{([^}]*)\} (\S+)$', re.M)
_UPLOADS = re.compile(r'^strata_expert_bytes_total\{([^}]*kind="upload"[^}]*)\} (\S+)$',
                      re.M)
_EXPOSED = re.compile(r'^strata_expert_exposed_seconds_total\{([^}]*)\} (\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def metrics(base_url: str) -> str | None:
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        return httpx.get(f"{root}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None


def expert_reads(text: str | None) -> dict[int, tuple[float, float]]:
    """stage -> (expert reads that hit the VRAM cache, that missed), since start-up."""
    reads: dict[int, list[float]] = {}
    for labels, value in _EXPERTS.findall(text or ""):
        label = dict(_LABEL.findall(labels))
        reads.setdefault(int(label["stage"]), [0.0, 0.0])[label["result"] == "miss"] = \
            float(value)
    return {stage: (hit, miss) for stage, (hit, miss) in reads.items()}


def per_stage(pattern: re.Pattern, text: str | None) -> dict[int, float]:
    """stage -> the value of a counter labelled by stage (one series per stage)."""
    return {int(dict(_LABEL.findall(labels))["stage"]): float(value)
            for labels, value in pattern.findall(text or "")}


def busy_seconds(base_url: str, text: str | None = None) -> list[float] | None:
    """Busy seconds of each stage, then of the scheduler."""
    text = text if text is not None else metrics(base_url)
    if text is None:
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
        self.expert_hits: list[float] | None = None  # per stage with an expert cache
        self.expert_upload: list[float] | None = None   # bytes uploaded, per stage
        self.expert_exposed: list[float] | None = None  # seconds the compute waited

    def __enter__(self) -> BusyMeter:
        text = metrics(self.base_url)
        self.before, self.reads = busy_seconds(self.base_url, text), expert_reads(text)
        self.uploads, self.exposed = per_stage(_UPLOADS, text), per_stage(_EXPOSED, text)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.start
        text = metrics(self.base_url)
        after = busy_seconds(self.base_url, text)
        hits = []
        for stage, (hit, miss) in sorted(expert_reads(text).items()):
            hit0, miss0 = self.reads.get(stage, (0.0, 0.0))
            reads = hit - hit0 + miss - miss0
            hits.append(round((hit - hit0) / reads, 3) if reads else 1.0)
        self.expert_hits = hits or None
        if hits:
            for name, pattern, before in (("expert_upload", _UPLOADS, self.uploads),
                                          ("expert_exposed", _EXPOSED, self.exposed)):
                now = per_stage(pattern, text)
                setattr(self, name, [now[s] - before.get(s, 0.0) for s in sorted(now)] or None)
        if self.before is None or after is None or wall <= 0:
            return
        before = self.before + [0.0] * (len(after) - len(self.before))
        self.fractions = [round((a - b) / wall, 3) for a, b in zip(after, before)]

    def annotate(self, result: dict) -> None:
        """Writes what was measured into a measurement's result."""
        result["stage_busy"] = self.fractions
        result["expert_hits"] = self.expert_hits
        result["expert_upload"] = self.expert_upload
        result["expert_exposed"] = self.expert_exposed
