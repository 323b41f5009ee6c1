"""Request: one generation job, its tokens and its status. Tokens in, tokens out:
no text lives here."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from strata.sampling.params import SamplingParams
from strata.drafting.stats import DraftStats

_ids = itertools.count()


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
