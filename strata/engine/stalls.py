"""StallWatch: a warning for every engine step whose host time is far above the steps
around it, naming where it went, so that a rare stall (a first token 0.4 s late) can be
explained from the log: launching windows (a compile would show here), Python's garbage
collector (timed by a gc callback, the only way to see it), or the rest of the host's
loop (committing, the server streaming tokens).

A step runs from one commit to the next (or from the launch that woke an idle engine),
as the server sees it. Its host time is the step less its wait for the device: a long
prompt makes the device slow by right, never the host. A step is slow when its host time
exceeds SLOW_FACTOR times the running mean of the steps before it and MIN_SLOW seconds.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("strata.engine")

SLOW_FACTOR = 20.0
MIN_SLOW = 0.05   # seconds
MEAN = 0.05       # weight of the newest step in the running mean


class _GcClock:
    """Seconds Python's cyclic garbage collector has run, per generation, since start."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start


_clock: _GcClock | None = None


def gc_clock() -> _GcClock:
    """The process's one clock of the collector (made on first use)."""
    global _clock
    if _clock is None:
        _clock = _GcClock()
    return _clock


class StallWatch:
    def __init__(self):
        self.clock = gc_clock()
        self._last: float | None = None     # when the step in progress began
        self._gc = list(self.clock.seconds)
        self._mean: float | None = None     # running mean host seconds of a step
        self.stalls = 0

    def collected(self) -> float:
        """Seconds the collector has run, all generations (to take out of a span of the
        host's time that it fell in)."""
        return sum(self.clock.seconds)

    def idle(self, now: float) -> None:
        """Nothing was in flight: the next step starts from this launch."""
        self._last, self._gc = now, list(self.clock.seconds)

    def committed(self, now: float, launch: float, wait: float) -> None:
        """A commit at `now`; the step's launching took `launch` seconds of the host's and
        its device `wait` (waiting for it, or its compute where the stages compute on the
        host), neither counting the collector's runs inside them (the caller takes those
        out), so that launching, collecting and the rest add up to the step's host time."""
        gc_now = list(self.clock.seconds)
        if self._last is not None:
            seconds = now - self._last
            host = seconds - wait
            if self._mean is not None and host > max(MIN_SLOW, SLOW_FACTOR * self._mean):
                self.stalls += 1
                collected = [b - a for a, b in zip(self._gc, gc_now)]
                log.warning("a slow step: %.0f ms on the host (the mean is %.2f ms): "
                            "launching windows %.0f ms, garbage collection %.0f ms "
                            "(generation 2: %.0f ms), the rest (committing, the server) "
                            "%.0f ms; waiting for the device %.0f ms", host * 1e3,
                            self._mean * 1e3, launch * 1e3, sum(collected) * 1e3,
                            collected[2] * 1e3, (host - launch - sum(collected)) * 1e3,
                            wait * 1e3)
            else:
                self._mean = host if self._mean is None else (1 - MEAN) * self._mean + MEAN * host
        self._last, self._gc = now, gc_now
