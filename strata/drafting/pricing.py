"""DraftPricing: what drafting costs the engine now, in tokens, measured from its own steps.

A draft costs time beyond its tokens' share of the window: proposing it, building and
verifying a longer window, extending the proposers with the result — on the host — and
on the device wherever the window outgrows what the GPU computes for free. Whether that
time costs anything depends on the load: while the device waits on the host (several
streams, a server streaming tokens from the same process) it delays every slot's next
token; while the host waits on the device it is hidden. Rather than model either, the
engine times every step (from one collect to the next: the whole host loop, server
included, and the device's wait) and the pricing fits

    seconds = a + b * entries + c * drafted_entries + d * drafted_tokens

by least squares, recent steps weighted most (each step's weight falls by FORGET per
step: the last ~100 steps count), with a ridge that pulls c and d toward 0 (drafting is
free until the steps show otherwise). A drafted entry is counted twice: in the step that
launches its window (the proposer ran, the window was built) and in the step that
commits it (the verifier's work, the proposers extended); so one drafted entry costs 2c
and one drafted token 2d. Steps with prompt chunks launched or committed are left out
(their time is the prompt's), and so are stalls (a step more than STALL times the
running mean: a compile, a collection pause).

Prices are in tokens, the policy's unit: seconds times the engine's recent rate of
committed tokens per second — what the engine would have produced in that time. The
policy adds the entry price to its `--spec-window-cost` (what sitting out a window costs
the slot) and takes the larger of the token price and `--spec-token-cost`
(`--spec-pricing fixed` keeps those fixed costs alone).
"""

from __future__ import annotations

FORGET = 0.99        # weight kept by a step per newer step
STALL = 5.0          # a step this many times the running mean is left out
RIDGE_ENTRIES = 1.0  # pull of b toward 0 (a takes over where entries never vary)
RIDGE_ENTRY = 8.0    # pull of c toward 0, in squared drafted entries
RIDGE_TOKEN = 200.0  # pull of d toward 0, in squared drafted tokens
MIN_STEPS = 16.0     # weighted steps observed before any price is charged
REFIT = 8            # steps between fits
_EPS = 1e-9          # keeps the intercept's column solvable


class DraftPricing:
    def __init__(self):
        n = 4  # columns: 1, entries, drafted entries, drafted tokens
        self._xx = [[0.0] * n for _ in range(n)]
        self._xy = [0.0] * n
        self._weight = 0.0      # sum of the steps' weights
        self._seconds = 0.0     # weighted seconds...
        self._tokens = 0.0      # ...and committed tokens, for the rate
        self._steps = 0
        self.coefficients = (0.0, 0.0, 0.0, 0.0)  # a, b, c, d of the last fit (seconds)
        self.entry_cost = 0.0   # tokens a drafted entry costs now
        self.token_cost = 0.0   # tokens a drafted token costs now

    @property
    def rate(self) -> float:
        """Committed tokens per second over the recent steps (0 before any)."""
        return self._tokens / self._seconds if self._seconds > 0 else 0.0

    def observe(self, seconds: float, entries: int, drafted_entries: int,
                drafted_tokens: int, committed_tokens: int) -> None:
        """One step: its seconds, the committed window's entries, the drafted entries and
        tokens it launched and committed together, and the tokens it committed."""
        if seconds <= 0:
            return
        if self._weight >= MIN_STEPS and seconds > STALL * self._seconds / self._weight:
            return
        x = (1.0, float(entries), float(drafted_entries), float(drafted_tokens))
        for i in range(4):
            row = self._xx[i]
            for j in range(4):
                row[j] = FORGET * row[j] + x[i] * x[j]
            self._xy[i] = FORGET * self._xy[i] + x[i] * seconds
        self._weight = FORGET * self._weight + 1.0
        self._seconds = FORGET * self._seconds + seconds
        self._tokens = FORGET * self._tokens + committed_tokens
        self._steps += 1
        if self._steps % REFIT == 0:
            self._fit()

    def _fit(self) -> None:
        if self._weight < MIN_STEPS:
            return
        ridge = (_EPS, RIDGE_ENTRIES, RIDGE_ENTRY, RIDGE_TOKEN)
        a = [[self._xx[i][j] + (ridge[i] if i == j else 0.0) for j in range(4)]
             for i in range(4)]
        solved = _solve(a, list(self._xy))
        if solved is None:
            return
        self.coefficients = tuple(solved)
        _, _, c, d = solved
        self.entry_cost = 2 * max(c, 0.0) * self.rate
        self.token_cost = 2 * max(d, 0.0) * self.rate


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (Gaussian elimination, partial pivoting); None if singular."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for k in range(col, n):
                    a[r][k] -= f * a[col][k]
                b[r] -= f * b[col]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (b[r] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class StepMeter:
    """Feeds a DraftPricing from the engine's steps. The engine reports each window it
    launches and each it commits, with the time; a step runs from one commit to the next
    (or from the launch that woke an idle engine), and counts the drafted entries and
    tokens of the windows launched in it and of the window it commits."""

    def __init__(self, pricing: DraftPricing):
        self.pricing = pricing
        self._mark: float | None = None  # when the step in progress began
        self._entries = 0                # drafted entries and tokens launched in it
        self._tokens = 0
        self._prompt = False             # a prompt chunk launched in it

    def launched(self, window, now: float, idle: bool) -> None:
        """`idle`: nothing was in flight before this window (the step begins now)."""
        if idle:
            self._mark, self._entries, self._tokens, self._prompt = now, 0, 0, False
        entries, tokens = _drafted(window)
        self._entries += entries
        self._tokens += tokens
        self._prompt |= _has_prompt(window)

    def committed(self, window, results: list[list[int]], now: float) -> None:
        entries, tokens = _drafted(window)
        if self._mark is not None and not self._prompt and not _has_prompt(window):
            self.pricing.observe(now - self._mark, len(window.header.slots),
                                 self._entries + entries, self._tokens + tokens,
                                 sum(len(r) for r in results))
        self._mark, self._entries, self._tokens, self._prompt = now, 0, 0, False


def _drafted(window) -> tuple[int, int]:
    """The window's drafted entries and draft tokens."""
    lengths = [len(d.tokens) for d in window.drafts if d is not None and d.tokens]
    return len(lengths), sum(lengths)


def _has_prompt(window) -> bool:
    header = window.header
    return header.logits_all or not all(header.samples)
