"""The pipeline simulator: the real Scheduler, DraftPolicy and group logic, with the stages
replaced by a clock.

`simulate(profile, config, traces)` runs requests through the engine's own loop (send a
window for every idle group, collect the oldest, commit it) against a SimulatedRunner:
each stage takes its profile curve C_s(w) for a window of w tokens, one window at a time
in arrival order, and a window travels `hop_seconds` into the first stage, between stages
and back; the engine spends the profile's host time per window. CPU stages share the
profile's cores: while more of their threads compute than there are cores, each runs
slower in proportion; `cpu_efficiency` (fitted by calibrate to a run of N requests at
once) is the share of the cores they get in effect (the engine process, the hops'
copies and the switching between processes take the rest).

What the verifier accepts comes from traces: a Trace is one request's prompt and the
output greedy decoding gives (recorded by running the model), so a draft is accepted as
far as it matches the output — exactly what greedy verification would do — and drafts
come from the real proposers reading the same tokens. Or, for hardware and models that are
not here, `synthetic_traces` with a TraceProposer that is right with a given probability
per token. Either way the scheduler, the policy and its pricing are the engine's.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from strata.calibrate.profile import CostProfile, Curve
from strata.config import EngineConfig
from strata.drafting.draft import Draft
from strata.drafting.load_pricing import LoadPricing, from_profile
from strata.drafting.policy import DraftPolicy
from strata.engine.engine import schedules_ahead
from strata.errors import StrataError
from strata.request import DraftStats, Request
from strata.sampling.params import SamplingParams
from strata.scheduler.scheduler import Scheduler
from strata.scheduler.window import Window
from strata.stage.results import WindowResult


@dataclass(frozen=True)
class Trace:
    prompt: tuple[int, ...]
    output: tuple[int, ...]  # what greedy decoding produces after the prompt


# -- synthetic acceptance ---------------------------------------------------------------------
SYNTHETIC_VOCAB = 50_000


def synthetic_traces(count: int, prompt_tokens: int, output_tokens: int,
                     seed: int = 0) -> list[Trace]:
    """Random token sequences: what they say does not matter to a TraceProposer."""
    rng = random.Random(seed)
    return [Trace(tuple(rng.randrange(SYNTHETIC_VOCAB) for _ in range(prompt_tokens)),
                  tuple(rng.randrange(SYNTHETIC_VOCAB) for _ in range(output_tokens)))
            for _ in range(count)]


class TraceProposer:
    """Drafts the trace's true continuation, right for each next token with probability
    `acceptance` (a run of right tokens drawn once per request and position, so every
    policy sees the same luck), then wrong tokens; its scores are acceptance^j."""
    on_last_stage = False

    def __init__(self, truth: dict[str, list[int]], acceptance: float, max_draft: int,
                 seed: int = 0, name: str = "trace"):
        self.truth, self.acceptance, self.max_draft = truth, acceptance, max_draft
        self.seed, self.name = seed, name
        self._length: dict[str, int] = {}

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self._length[request_id] = len(prompt_ids)

    def extend(self, request_id: str, token_ids: list[int],
               stage_drafts: Draft | None = None) -> None:
        self._length[request_id] += len(token_ids)

    def propose(self, request_id: str, max_tokens: int) -> Draft | None:
        position = self._length[request_id]
        truth = self.truth[request_id]
        length = min(max_tokens, self.max_draft, len(truth) - position)
        if length <= 0:
            return None
        rng = random.Random(hash((self.seed, *truth[:4], position)))  # ints hash alike
        right = 0
        while right < length and rng.random() < self.acceptance:
            right += 1
        tokens = [truth[position + j] if j < right else truth[position + j] + 1
                  for j in range(length)]
        return Draft(tokens, [self.acceptance ** (j + 1) for j in range(length)], self.name)

    def finish(self, request_id: str) -> None:
        self._length.pop(request_id, None)


# -- the clock --------------------------------------------------------------------------------
@dataclass
class _Job:
    window: int        # index of the window
    tokens: int        # its tokens
    work: float        # seconds left at full speed
    arrival: float     # when it reaches the stage


@dataclass
class _Flight:
    window: Window
    result: WindowResult
    ready: float | None = None  # when the result is back at the engine


class SimulatedRunner:
    """The Runner interface on a simulated clock: FIFO stages with profile costs."""
    failure = None

    def __init__(self, curves: list[Curve], hop_seconds: float, cpu: list[bool],
                 cores: float | None, threads: int, truth: dict[str, list[int]]):
        """`curves`: each stage's seconds with `threads` threads and the cores to itself."""
        self.curves, self.hop = curves, hop_seconds
        self.cpu, self.cores, self.threads = cpu, cores, threads
        self.truth = truth
        self.now = 0.0
        self.busy = [0.0] * len(curves)  # seconds each stage computed
        self._queues: list[deque[_Job]] = [deque() for _ in curves]
        self._flights: dict[int, _Flight] = {}
        self._order: deque[int] = deque()
        self._next = 0
        self._time = 0.0  # the pipeline's own clock (may run ahead of or behind `now`)

    @property
    def num_stages(self) -> int:
        return len(self.curves)

    @property
    def num_in_flight(self) -> int:
        return len(self._order)

    def submit(self, window: Window) -> None:
        index, self._next = self._next, self._next + 1
        self._advance(self.now)
        self._flights[index] = _Flight(window, WindowResult(self._verify(window)))
        self._order.append(index)
        tokens = window.header.num_tokens
        self._queues[0].append(_Job(index, tokens, self.curves[0](tokens), self.now + self.hop))

    def collect(self) -> tuple[Window, WindowResult]:
        index = self._order.popleft()
        flight = self._flights[index]
        while flight.ready is None:
            if not self._step(math.inf):
                raise RuntimeError("the simulated pipeline stalled")
        del self._flights[index]
        self.now = max(self.now, flight.ready)
        return flight.window, flight.result

    def close(self) -> None:
        pass

    def _verify(self, window: Window) -> list[list[int]]:
        """Greedy verification against the traces: drafts accepted as far as they match."""
        tokens = []
        for entry in window.header.verify:
            truth, at = self.truth[entry.request_id], entry.position
            accepted = 0
            while (accepted < len(entry.draft) and at + accepted < len(truth)
                   and entry.draft[accepted] == truth[at + accepted]):
                accepted += 1
            end = at + accepted
            tokens.append(list(entry.draft[:accepted]) + [truth[end] if end < len(truth) else 0])
        return tokens

    def _advance(self, until: float) -> None:
        while self._step(until):
            pass
        self._time = max(self._time, until)

    def _rates(self, active: list[int]) -> dict[int, float]:
        cpu = [s for s in active if self.cpu[s]]
        share = 1.0
        if self.cores and cpu:
            share = min(1.0, self.cores / (len(cpu) * self.threads))
        return {s: (share if self.cpu[s] else 1.0) for s in active}

    def _step(self, until: float) -> bool:
        """Run the pipeline to its next event no later than `until`; False if none."""
        now = self._time
        active = [s for s, q in enumerate(self._queues) if q and q[0].arrival <= now]
        arrivals = [q[0].arrival for q in self._queues if q and q[0].arrival > now]
        rates = self._rates(active)
        finish = min((now + self._queues[s][0].work / rates[s] for s in active),
                     default=math.inf)
        event = min(finish, min(arrivals, default=math.inf))
        if event == math.inf or event > until:
            if until != math.inf:
                for s in active:
                    self._queues[s][0].work -= (until - now) * rates[s]
                    self.busy[s] += until - now
            return False
        for s in active:
            self._queues[s][0].work -= (event - now) * rates[s]
            self.busy[s] += event - now
        self._time = event
        for s in active:
            job = self._queues[s][0]
            if job.work > 1e-12:
                continue
            self._queues[s].popleft()
            if s + 1 < len(self._queues):
                self._queues[s + 1].append(_Job(job.window, job.tokens,
                                                self.curves[s + 1](job.tokens), event + self.hop))
            else:
                self._flights[job.window].ready = event + self.hop
        return True


# -- running requests -------------------------------------------------------------------------
@dataclass
class StreamResult:
    tokens: int
    first: float        # seconds from the start to its first token
    last: float         # ...and to its last

    @property
    def decode_tok_s(self) -> float | None:
        return (self.tokens - 1) / (self.last - self.first) \
            if self.tokens > 1 and self.last > self.first else None


@dataclass
class RunResult:
    streams: list[StreamResult]
    wall: float
    stage_busy: list[float]
    drafts: DraftStats = field(default_factory=DraftStats)

    @property
    def total_tok_s(self) -> float:
        return sum(s.tokens for s in self.streams) / self.wall if self.wall > 0 else 0.0


def simulate(profile: CostProfile, config: EngineConfig, traces: list[Trace],
             acceptance: float | None = None, seed: int = 0) -> RunResult:
    """Run `traces` as requests sent together (greedy, max_tokens = their output) through
    the real scheduler on the simulated clock. `acceptance`: draft with a TraceProposer
    right with this probability per token, instead of the proposers `config` names."""
    curves, cpu = profile.simulated_stages(config)
    requests = [Request(list(t.prompt), SamplingParams(temperature=0, max_tokens=len(t.output)))
                for t in traces]
    truth = {r.request_id: list(t.prompt) + list(t.output) for r, t in zip(requests, traces)}
    policy = _policy(config, truth, acceptance, seed, profile)
    longest = max(len(t.prompt) + len(t.output) for t in traces)
    max_context = longest + max(config.spec, config.spec_suffix_max) + 2
    scheduler = Scheduler(config.parallel, max_context, config.max_window_tokens,
                          config.block_size, policy, num_groups=config.num_groups(),
                          ahead=schedules_ahead(config), window_cost=config.spec_window_cost,
                          hedge=config.spec_hedge == "on",
                          prefix_cache=config.prefix_cache == "on")
    cores = profile.cpu_cores * profile.cpu_efficiency if profile.cpu_cores else None
    runner = SimulatedRunner(curves, profile.hop_seconds if config.stage_processes else 0.0,
                             cpu, cores, profile.stage_threads_for(config), truth)
    load = policy.load if policy is not None else None
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work:
        while (window := scheduler.schedule()) is not None:
            _submit(runner, window, load)
        while (window := scheduler.schedule_ahead()) is not None:
            _submit(runner, window, load)
        if runner.num_in_flight == 0:
            raise RuntimeError("the simulated engine has work but sent no window")
        window, result = runner.collect()
        runner.now += profile.host_seconds(window.header.num_tokens)
        if load is not None:
            load.observe(window.header.group, window.header.num_tokens,
                         [c(window.header.num_tokens) for c in curves],
                         sum(len(t) for t in result.tokens), runner.now)
        for request in scheduler.commit(window, result.tokens):
            first.setdefault(request.request_id, runner.now)
            last[request.request_id] = runner.now
    streams = [StreamResult(r.num_output_tokens, first[r.request_id], last[r.request_id])
               for r in requests]
    return RunResult(streams, max(last.values()), runner.busy,
                     policy.stats if policy is not None else DraftStats())


def _submit(runner: SimulatedRunner, window: Window, load: LoadPricing | None) -> None:
    if runner.num_in_flight == 0 and load is not None:
        load.resume(runner.now)
    runner.submit(window)


def _policy(config: EngineConfig, truth: dict[str, list[int]], acceptance: float | None,
            seed: int, profile: CostProfile) -> DraftPolicy | None:
    if config.spec == 0:
        return None
    if config.spec_pricing == "measured":
        raise StrataError("the simulator prices drafts fixed, shared or by load; --spec-pricing "
                          "measured times the host, which it does not run")
    if acceptance is not None:
        proposers = [TraceProposer(truth, acceptance, config.spec, seed)]
    else:
        from strata.drafting.registry import PROPOSERS
        names = [n for n in (config.spec_type or ("suffix", "lookup")) if n != "mtp"]
        proposers = [p for p in (PROPOSERS[n](config) for n in names) if p is not None]
    load = from_profile(profile, config) if config.spec_pricing == "load" else None
    return DraftPolicy(proposers, config.spec_token_cost, load=load,
                       shared=config.spec_pricing == "shared")
