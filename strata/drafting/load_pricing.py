"""LoadPricing (`--spec-pricing load`): how many draft tokens a window should carry, from
the stages' cost curves and how busy they are.

A window's drafts are worth their expected accepted tokens; they cost the time they add.
What that time is worth depends on the load:

- **stages waiting on each other** (fewer groups with work than stages; one request
  alone): the window's group waits for it at every stage in turn, so the drafts are
  chosen to make the most tokens per second of the group's own trip,
  (n + worth(K)) / (sum_s C_s(w + K) + host(w + K) + overhead), where n is what the
  window makes without drafts and the overhead is the rest of a trip (hops, the return
  path), measured between commits;
- **every stage busy** (at least as many groups with work as stages): the busiest stage b
  sets the pace of every stream; it works through every group's window in turn, so the
  drafts are chosen to make the most tokens per second of its round,
  (others' tokens + n + worth(K)) / max(others' C_b + C_b(w + K), the trip above), the
  others being the windows the other groups committed last (a round cannot be shorter
  than one window's trip: then the stages wait, as above).

Either is the exact trade (a ratio, maximised by trying every K), so a window whose cost
rises steeply with its first extra tokens and then flattens still drafts when its drafts
are worth it; a draft that only pays at a stage that idles anyway costs what that stage's
time costs the group. The curves C_s(w) come from a profile (`--profile`, measured by
`strata calibrate`), or are fitted on the fly, per stage, from the seconds each window's
result reports (`observe`); the engine's own time per window joins them where the profile
has it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

FORGET = 0.98       # weight kept by a window's sample per newer window (fits, overhead)


class LineFit:
    """seconds = a + b * tokens by weighted least squares, recent windows weighted most."""

    def __init__(self):
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        f = FORGET
        self._n = f * self._n + 1
        self._x = f * self._x + tokens
        self._y = f * self._y + seconds
        self._xx = f * self._xx + tokens * tokens
        self._xy = f * self._xy + tokens * seconds

    def __call__(self, tokens: float) -> float:
        if self._n == 0:
            return 0.0
        var = self._n * self._xx - self._x * self._x
        if var <= 1e-12 * max(self._n * self._xx, 1e-30):  # one width seen: flat
            return self._y / self._n
        b = max((self._n * self._xy - self._x * self._y) / var, 0.0)
        a = (self._y - b * self._x) / self._n
        return max(a + b * tokens, 0.0)


class LoadPricing:
    def __init__(self, num_stages: int,
                 curves: Sequence[Callable[[float], float]] | None = None,
                 host: Callable[[float], float] | None = None, overhead: float = 0.0):
        """`curves`: C_s(w) of each stage in seconds (None: fitted from `observe`);
        `host`: the engine's own seconds per window of w tokens, if known; `overhead`:
        the rest of a trip (hops), until measured."""
        self.num_stages = num_stages
        self.fits = None if curves is not None else [LineFit() for _ in range(num_stages)]
        self.curves: list[Callable[[float], float]] = list(curves or self.fits)
        if host is not None:
            self.curves.append(host)
        self.groups = 1            # groups with work now (`load`)
        self.overhead = overhead   # seconds of a group's trip beyond its stages (measured)
        self._last: float | None = None      # the last commit, or when work resumed
        self._recent: dict[int, tuple[int, int]] = {}  # group -> (tokens, committed) last

    def load(self, groups: int) -> None:
        """How many groups have work (requests in their slots) as windows are built."""
        self.groups = max(groups, 1)

    @property
    def saturated(self) -> bool:
        return 1 < self.groups and self.num_stages <= self.groups

    def resume(self, now: float) -> None:
        """The engine had nothing in flight until now: the time before is not a trip."""
        self._last = now

    def observe(self, group: int, tokens: int, stage_seconds: Sequence[float],
                committed: int, now: float) -> None:
        """A committed window: its group, its tokens, each stage's seconds for it (one
        entry per stage, else ignored), the tokens it committed, and the time."""
        if self.fits is not None and len(stage_seconds) == self.num_stages:
            for fit, seconds in zip(self.fits, stage_seconds):
                fit.add(tokens, seconds)
        if self._last is not None and self.groups == 1:  # one trip, commit to commit
            rest = max(now - self._last - sum(c(tokens) for c in self.curves), 0.0)
            self.overhead = FORGET * self.overhead + (1 - FORGET) * rest
        self._last = now
        self._recent[group] = (tokens, committed)

    def best_count(self, worths: Sequence[float], base: int, made: float,
                   group: int | None = None) -> int:
        """How many of `worths` (draft tokens' expected acceptance, best first) a window
        of `base` tokens that makes `made` tokens without them should carry."""
        if not worths:
            return 0
        curves = self.curves
        def trip(k: int) -> float:
            return self.overhead + sum(c(base + k) for c in curves)

        seconds = trip
        if self.saturated:  # the busiest stage's round, unless the trip takes longer
            busiest = max(curves, key=lambda c: c(base))
            others = [v for g, v in self._recent.items() if g != group][:self.groups - 1]
            made += sum(committed for _, committed in others)
            fixed = sum(busiest(tokens) for tokens, _ in others)

            def seconds(k: int) -> float:
                return max(fixed + busiest(base + k), trip(k))
        best, best_rate, worth = 0, made / max(seconds(0), 1e-12), 0.0
        for k, w in enumerate(worths, start=1):
            worth += w
            rate = (made + worth) / max(seconds(k), 1e-12)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


def from_profile(profile, config) -> LoadPricing:
    """Load pricing from a CostProfile for an EngineConfig: the stages it runs, their
    curves, the engine's time per window and the hops of a trip."""
    curves, _ = profile.simulated_stages(config)
    return LoadPricing(len(curves), curves, profile.host_seconds, profile.trip_hops(len(curves)))
