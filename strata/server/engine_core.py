"""EngineCore: the server's engine loop work, wherever that loop runs: admit and abort
requests, step the engine, and say what each step did as Outputs (a request's new token
ids, logprobs and end) and CoreStats (what the metrics read).

AsyncEngine runs one on its own thread, or (`--engine-process`) engine_process.py runs one
in a child process and sends the same Outputs and CoreStats back over a pipe: everything
here is plain data that pickles.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from strata.errors import StrataError
from strata.experts.cache import ExpertStats
from strata.llm import LLM
from strata.request import DraftStats, Request


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs of a loaded engine to check a request before it is sent."""
    max_context: int
    vocab_size: int
    eos_token_ids: frozenset[int]


@dataclass
class Output:
    """A request's tokens since its last Output, and its end (finish reason or error)."""
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None       # the request failed alone (its sampling or drafting raised,
    error_status: int = 500        # 500; or it could not be admitted, 400)
    drafts: dict | None = None     # the request's draft statistics, with its end
    logprobs: list | None = None   # TokenLogprob of each of token_ids, when asked


@dataclass(frozen=True)
class CacheStats:
    """The block pool and its caches as they stand (counts since the engine started)."""
    free_blocks: int = 0
    used_blocks: int = 0
    cached_blocks: int = 0
    host_blocks: int = 0
    restored_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0


@dataclass
class CoreStats:
    """What the metrics show of the engine, as it stands now (counts since it started),
    and the steps' times since the last CoreStats."""
    drafts: DraftStats = field(default_factory=DraftStats)
    pricing: object | None = None  # a DraftPricing (--spec-pricing measured)
    stage_seconds: list[float] = field(default_factory=list)
    scheduler_seconds: float = 0.0
    expert_stats: list[ExpertStats] = field(default_factory=list)
    waiting: int = 0
    running: int = 0
    cache: CacheStats = field(default_factory=CacheStats)
    prompt_tokens: int = 0          # of the requests admitted
    step_seconds: list[float] = field(default_factory=list)


def one_line(error: BaseException) -> str:
    """A user-facing reason: a StrataError's own first line; other exceptions only by
    type (their text may hold internal details; the log has the traceback)."""
    if isinstance(error, StrataError):
        return (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"the engine raised {type(error).__name__} (see the server log)"


class EngineCore:
    def __init__(self, llm: LLM):
        self.llm, self.engine = llm, llm.engine
        # What exists once the engine is loaded (modules, graphs, compiled code: millions of
        # objects) lives as long as it does: leave it out of the collector's full passes,
        # which the proposers' trees set off (one took 0.38 s on an H200's host).
        gc.collect()
        gc.freeze()
        self.info = EngineInfo(self.engine.max_context, self.engine.model_config.vocab_size,
                               llm.eos_token_ids)
        self._sent: dict[str, int] = {}  # output ids sent so far, per request in the engine
        self._prompt_tokens = 0
        self._steps: list[float] = []

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    @property
    def failure(self) -> str | None:
        """Why the engine broke while idle (a stage process exited), or None."""
        return self.engine.runner.failure

    def add(self, request: Request) -> Output | None:
        """Admit the request; an Output with the error (400) if it cannot run."""
        try:
            self.engine.add(request)
        except Exception as e:  # noqa: BLE001 - checked at submit; never the engine's end
            return Output(request.request_id, [], error=one_line(e), error_status=400)
        self._sent[request.request_id] = 0
        self._prompt_tokens += request.num_prompt_tokens
        return None

    def abort(self, request_id: str) -> None:
        if self._sent.pop(request_id, None) is not None:
            self.engine.abort(request_id)  # NOTE: None if it failed and is not reported yet

    def step(self) -> list[Output]:
        """One engine step, then the next windows launched at once (they compute while
        the caller sends these Outputs out). Raises whatever the engine raised."""
        start = time.perf_counter()
        updated = self.engine.step()
        self.engine.launch()
        self._steps.append(time.perf_counter() - start)
        return [o for o in map(self._output, updated) if o is not None]

    def _output(self, request: Request) -> Output | None:
        sent = self._sent.get(request.request_id)
        if sent is None:  # aborted
            return None
        ids = request.token_ids[request.num_prompt_tokens + sent:]
        logprobs = (request.logprobs[sent:sent + len(ids)]
                    if request.logprobs is not None else None)
        if request.finished:
            del self._sent[request.request_id]
        else:
            self._sent[request.request_id] = sent + len(ids)
        if request.finish_reason == "error":
            return Output(request.request_id, ids, error=request.error)
        final = request.finished
        return Output(request.request_id, ids, request.finish_reason if final else None,
                      drafts=request.draft_stats.as_dict() if final else None,
                      logprobs=logprobs)

    def stats(self) -> CoreStats:
        engine, scheduler = self.engine, self.engine.scheduler
        pool = scheduler.pool
        host = pool.host
        cache = CacheStats(
            free_blocks=pool.num_free, used_blocks=pool.num_used, cached_blocks=pool.num_cached,
            host_blocks=len(host) if host is not None else 0,
            restored_tokens=host.restored_blocks * pool.block_size if host is not None else 0,
            cached_tokens=scheduler.cached_tokens, preemptions=scheduler.preemptions)
        steps, self._steps = self._steps, []
        return CoreStats(
            drafts=engine.draft_stats,
            pricing=engine.meter.pricing if engine.meter is not None else None,
            stage_seconds=list(engine.stage_seconds),
            scheduler_seconds=engine.scheduler_seconds,
            expert_stats=list(engine.expert_stats), waiting=len(scheduler.waiting),
            running=scheduler.num_running, cache=cache, prompt_tokens=self._prompt_tokens,
            step_seconds=steps)

    def close(self) -> None:
        self.llm.close()
        gc.unfreeze()  # what this engine leaves behind may be collected again
