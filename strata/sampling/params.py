"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import StrataError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0             # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None = until the context is full
    stop: tuple[str, ...] = ()     # stop strings (checked on text, outside the engine)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise StrataError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise StrataError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise StrataError(f"top_k must be >= 0 (got {self.top_k}); 0 turns it off")
        if not 0 <= self.min_p <= 1:
            raise StrataError(f"min_p must be in [0, 1] (got {self.min_p})")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise StrataError(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
