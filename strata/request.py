"""Request: one generation job, its tokens, its status and its draft statistics
(DraftStats, which also sums every request's drafts for an engine). Tokens in, tokens out:
no text lives here. A leaf: nothing of the engine, scheduler or drafting code is imported."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from strata.sampling.params import SamplingParams

_ids = itertools.count()


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ProposerStats:
    windows: int = 0    # windows in which this proposer's draft was sent
    drafted: int = 0    # draft tokens sent
    accepted: int = 0   # draft tokens accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per drafting window."""
        return self.accepted / self.windows if self.windows else 0.0


@dataclass
class DraftStats:
    by_proposer: dict[str, ProposerStats] = field(default_factory=dict)
    simulated: bool = False  # --simulate-acceptance: the acceptance is drawn, not measured

    def record(self, proposer: str, drafted: int, accepted: int) -> None:
        s = self.by_proposer.setdefault(proposer, ProposerStats())
        s.windows += 1
        s.drafted += drafted
        s.accepted += accepted

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.by_proposer.values())

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.by_proposer.values())

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        """JSON-ready summary (the server's usage extension)."""
        return {"simulated": self.simulated, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(self.acceptance, 4),
                "by_proposer": {name: {"windows": s.windows, "drafted": s.drafted,
                                       "accepted": s.accepted,
                                       "mean_accepted": round(s.mean_accepted, 3)}
                                for name, s in self.by_proposer.items()}}

    def summary(self) -> str:
        """One line for logs and `generate --verbose`."""
        if not self.drafted:
            return "no drafts"
        parts = [f"{name} {s.accepted}/{s.drafted} ({s.mean_accepted:.1f}/window)"
                 for name, s in self.by_proposer.items()]
        label = "SIMULATED drafts" if self.simulated else "drafts"
        return f"{label} accepted {self.accepted}/{self.drafted} ({self.acceptance:.0%}): " + \
            ", ".join(parts)


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    token_ids: list[int] = field(init=False)  # prompt then output
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None          # "stop", "length", "abort", "error"
    error: str | None = None                  # why it failed (finish reason "error")
    draft_stats: DraftStats = field(default_factory=DraftStats)
    logprobs: list | None = None  # per output token (TokenLogprob), when params ask for them
    reuse_prefix: bool = True     # may start from cached KV blocks of its prompt's prefix
    num_cached_tokens: int = 0    # prompt tokens it did not compute (the prefix cache's)
    arrival: int = 0              # its place in the scheduler's queue (older runs first)
    num_preemptions: int = 0      # times its KV blocks were taken back (computed again)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append(self, token: int, max_context: int) -> None:
        """Add one generated token and finish the request if it should stop."""
        self.token_ids.append(token)
        p = self.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            self.finish("stop")
        elif (p.max_tokens is not None and self.num_output_tokens >= p.max_tokens) \
                or self.num_tokens >= max_context:
            self.finish("length")

    def extend(self, tokens: list[int], max_context: int) -> list[int]:
        """Append tokens until the request finishes; returns those appended."""
        for i, token in enumerate(tokens):
            self.append(token, max_context)
            if self.finished:
                return tokens[:i + 1]
        return tokens

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.status, self.finish_reason = RequestStatus.FINISHED, reason

    def fail(self, error: str) -> None:
        """Finish with an error that concerns this request only (its sampling, its drafts)."""
        if not self.finished:
            self.finish("error")
            self.error = error
