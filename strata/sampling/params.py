"""SamplingParams: how one request picks its tokens, what it reports about them and when it
stops. Every value is checked to be finite and representable here, so a bad value fails the
request that carries it (a clear StrataError), never the engine that would run it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata.errors import StrataError

GREEDY_BELOW = 1e-5   # temperatures below this sample greedily (as vLLM): 1 / T stays finite
MAX_TOP_LOGPROBS = 20  # most alternatives reported per token (OpenAI's bound)
MAX_LOGIT_BIAS = 100.0
INT64 = 2 ** 63
INT32 = 2 ** 31


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0             # 0 = off; more than the vocabulary = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None = until the context is full
    stop: tuple[str, ...] = ()     # stop strings (checked on text, outside the engine)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None    # None: off; N: each token's logprob and the N most likely
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise StrataError(f"{name} must be a finite number (got {value!r})")
        if self.temperature < 0:
            raise StrataError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise StrataError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.top_k < INT32:
            raise StrataError(f"top_k must be in 0..{INT32 - 1} (got {self.top_k}); 0 turns "
                              "it off")
        if not 0 <= self.min_p <= 1:
            raise StrataError(f"min_p must be in [0, 1] (got {self.min_p})")
        if self.seed is not None and not -INT64 <= self.seed < INT64:
            raise StrataError(f"seed must be a 64-bit integer (got {self.seed})")
        if self.max_tokens is not None and not 1 <= self.max_tokens < INT32:
            raise StrataError(f"max_tokens must be in 1..{INT32 - 1} (got {self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise StrataError(f"logprobs (top alternatives) must be in 0..{MAX_TOP_LOGPROBS} "
                              f"(got {self.logprobs})")
        for token, bias in self.logit_bias:
            if not 0 <= token < INT32:
                raise StrataError(f"logit_bias: token id {token} is not a token id")
            if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise StrataError(f"logit_bias for token {token} must be in "
                                  f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (got {bias})")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
