"""AsyncEngine: the engine loop on its own thread, fed from the asyncio server, and
restarted when it fails.

The engine (scheduler, stages, sampler) is touched only by its thread. HTTP handlers
submit and abort through a command queue; after every window the thread pushes each
request's new token ids (and logprobs) to that request's asyncio queue. Loading happens on
the thread too, so the server answers /health (503) while the model loads.

A request that fails alone (its sampling or drafting raised) ends with its own error; the
others go on. A failure of the engine itself — a stage process that exited (seen at once by
the runner's watchdog, also while idle), a hung stage, any exception from a window — fails
every request in flight with a one-line reason, turns /health 503 ("restarting" and the
reason) and builds a new engine with new stage processes. Restarts are bounded: more than
`max_restarts` failures (failed loads included) within RESTART_WINDOW seconds and the
server gives up and exits non-zero (`on_fatal`), so a supervisor sees it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from strata.config import EngineConfig
from strata.errors import StrataError
from strata.llm import LLM
from strata.request import Request
from strata.sampling.params import SamplingParams
from strata.server.metrics import Metrics

log = logging.getLogger("strata.server")

RESTART_WINDOW = 600.0   # seconds over which failures are counted against --max-restarts
MAX_BACKOFF = 30.0       # longest pause before a restart (1, 2, 4, ... s)
POLL = 0.5               # an idle engine thread wakes this often (watchdog, shutdown)


class QueueFull(Exception):
    """More requests than slots plus --max-queue."""

    def __init__(self, retry_after: int):
        super().__init__(f"retry after {retry_after} s")
        self.retry_after = retry_after


class NotReady(Exception):
    """The engine is loading, restarting or has failed (the message says which)."""


@dataclass
class Update:
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None       # the request failed: alone (500) or with the engine (503)
    error_status: int = 503
    drafts: dict | None = None     # the request's draft statistics, with the final update
    logprobs: list | None = None   # TokenLogprob of each of token_ids, when asked


class RequestHandle:
    """The HTTP side of one request: an async stream of Updates.

    The engine thread delivers updates in batches (one wake-up of the event loop per
    window for every request it advanced); a consumer that fell behind gets the updates
    that piled up merged into one (`coalesce`), so a slow client or a busy event loop
    costs one SSE chunk per turn of the loop, not one per window."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request_id = request.request_id
        self.prompt_tokens = request.num_prompt_tokens
        self.request = request  # NOTE: owned by the engine thread; read only its constants here
        self.loop = loop
        self._pending: list[Update] = []  # event-loop thread: delivered, not yet read
        self._arrived = asyncio.Event()
        self.sent = 0  # engine thread: output ids pushed so far
        self.started: float | None = None  # engine thread: when its first tokens came

    def deliver(self, update: Update) -> None:
        """Event-loop thread: one more update for `updates`."""
        self._pending.append(update)
        self._arrived.set()

    async def updates(self, keepalive: float | None = None) -> AsyncIterator[Update | None]:
        """The request's updates, those that came together merged; None every `keepalive`
        seconds that nothing came (a stream still waiting for a slot can say it is alive)."""
        while True:
            if not self._pending:
                self._arrived.clear()
                try:
                    if keepalive is None:
                        await self._arrived.wait()
                    else:
                        await asyncio.wait_for(self._arrived.wait(), keepalive)
                except asyncio.TimeoutError:
                    yield None
                    continue
            batch, self._pending = self._pending, []
            for update in coalesce(batch):
                yield update
                if update.finish_reason is not None or update.error is not None:
                    return


def coalesce(updates: list[Update]) -> list[Update]:
    """Runs of token updates merged into one (ids and logprobs concatenated, the last
    one's finish and draft statistics); an error update stays apart, after the tokens
    before it."""
    merged: list[Update] = []
    for update in updates:
        last = merged[-1] if merged else None
        if (last is None or last.error is not None or last.finish_reason is not None
                or update.error is not None):
            merged.append(update)
            continue
        logprobs = (None if last.logprobs is None and update.logprobs is None
                    else (last.logprobs or []) + (update.logprobs or []))
        merged[-1] = Update(last.token_ids + update.token_ids, update.finish_reason,
                            drafts=update.drafts, logprobs=logprobs)
    return merged


def deliver_all(deliveries: list[tuple[RequestHandle, Update]]) -> None:
    """Event-loop thread: hand each update to its request."""
    for handle, update in deliveries:
        handle.deliver(update)


def one_line(error: BaseException) -> str:
    """A user-facing reason: a StrataError's own first line; other exceptions only by
    type (their text may hold internal details; the log has the traceback)."""
    if isinstance(error, StrataError):
        return (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"the engine raised {type(error).__name__} (see the server log)"


class AsyncEngine:
    def __init__(self, config: EngineConfig, checkpoint, metrics: Metrics, max_queue: int,
                 max_restarts: int = 3):
        self.config, self.metrics, self.max_queue = config, metrics, max_queue
        self.checkpoint = checkpoint
        self.max_restarts = max_restarts
        self.status = "loading"   # "loading", "ready", "restarting", "failed", "stopped"
        self.error: str | None = None  # one line: why the status is not "ready"
        self.fatal: str | None = None  # why the server gives up (it exits non-zero)
        self.on_fatal: Callable[[str], None] | None = None
        self.llm: LLM | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}
        self._unfinished = 0
        self._failures: deque[float] = deque()
        self._seconds_per_request = 5.0  # running mean of request times (Retry-After)
        self._shutdown_at: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)

    # -- asyncio side ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def begin_shutdown(self, timeout: float) -> None:
        """Requests still running `timeout` seconds from now are ended with an error."""
        self._shutdown_at = time.monotonic() + timeout
        self._commands.put(("wake",))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    @property
    def ready(self) -> bool:
        return self.health[0] == "ready"

    @property
    def health(self) -> tuple[str, str | None]:
        """(status, one-line reason): the runner's watchdog is read directly, so a stage
        that died while idle shows here before the engine thread has woken."""
        llm = self.llm
        failure = llm.engine.runner.failure if llm is not None and self.status == "ready" else None
        if failure is not None:
            return "restarting", failure
        return self.status, self.error

    def retry_after(self) -> int:
        """Seconds until a request sent now would likely get a slot: the queue ahead of it
        shared by the slots, at the running mean time of a request."""
        waiting = max(0, self._unfinished - self.config.parallel)
        seconds = self._seconds_per_request * (waiting + 1) / self.config.parallel
        return int(min(max(math.ceil(seconds), 1), 600))

    def submit(self, prompt_ids: list[int], params: list[SamplingParams]) -> list[RequestHandle]:
        """Queue one request per SamplingParams (the choices of one HTTP request), all or
        none; raises StrataError (a request that cannot run), NotReady or QueueFull."""
        llm = self.llm
        status, reason = self.health
        if status != "ready" or llm is None:
            raise NotReady(f"the model is not ready ({status}{': ' + reason if reason else ''})")
        engine = llm.engine
        engine.check_prompt(prompt_ids)
        limit = self.config.parallel + self.max_queue
        if len(params) > limit:
            raise StrataError(f"n={len(params)} choices need {len(params)} slots, more than "
                              f"--parallel plus --max-queue ({limit}); ask for fewer")
        for p in params:
            self._check_fits(engine, len(prompt_ids), p)
        with self._lock:
            if self._unfinished + len(params) > limit:
                raise QueueFull(self.retry_after())
            self._unfinished += len(params)
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(Request(list(prompt_ids), p, llm.eos_token_ids), loop)
                   for p in params]
        for handle in handles:
            self._commands.put(("add", handle))
        return handles

    @staticmethod
    def _check_fits(engine, prompt: int, params: SamplingParams) -> None:
        context = engine.max_context
        if params.max_tokens is not None and prompt + params.max_tokens > context:
            raise StrataError(
                f"this model's context is {context} tokens (--max-context) but the prompt "
                f"is {prompt} tokens and max_tokens is {params.max_tokens}: lower max_tokens "
                f"to at most {context - prompt} or shorten the prompt")
        vocab = engine.model_config.vocab_size
        for token, _ in params.logit_bias:
            if token >= vocab:
                raise StrataError(f"logit_bias: token id {token} is outside the vocabulary "
                                  f"(0..{vocab - 1})")

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._supervise()
        except BaseException as e:  # noqa: BLE001 - a bug here must not leave a zombie server
            log.exception("the engine thread failed")
            self.status, self.error = "failed", f"the engine thread failed ({type(e).__name__})"
            self.fatal = self.error
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)

    def _supervise(self) -> None:
        try:
            while not self._stop.is_set():
                reason = self._load()
                if reason is None:
                    reason = self._serve()
                    if reason is None:
                        break  # stopped
                    log.error("engine failed: %s; failing the requests in flight", reason)
                    self.status, self.error = "restarting", reason
                    self._abandon(f"{reason}; the engine is restarting")
                else:
                    self.status, self.error = "failed", reason
                if not self._pause_before_restart(reason):
                    break
        finally:
            self._close()
            if self.status == "ready":
                self.status = "stopped"

    def _load(self) -> str | None:
        """Build the engine; None when ready, else the one-line reason it failed."""
        try:
            llm = LLM(self.config, self.checkpoint)
        except Exception as e:  # noqa: BLE001 - any load failure makes the server unhealthy
            if not isinstance(e, StrataError):
                log.exception("the model failed to load")
            reason = f"the model failed to load: {one_line(e)}"
            log.error("%s", reason)
            return reason
        self.llm = llm
        self.metrics.slots_total.set(self.config.parallel)
        self.status, self.error = "ready", None
        return None

    def _pause_before_restart(self, reason: str) -> bool:
        """Count the failure; wait 1, 2, 4, ... s, or give up (False) when more than
        max_restarts failures fell within RESTART_WINDOW."""
        now = time.monotonic()
        self._failures.append(now)
        while now - self._failures[0] > RESTART_WINDOW:
            self._failures.popleft()
        failures = len(self._failures)
        if failures > self.max_restarts:
            self.status = "failed"
            self.fatal = (f"{reason} (failure {failures} within {RESTART_WINDOW / 60:.0f} "
                          f"minutes, --max-restarts {self.max_restarts}); giving up")
            log.error("%s", self.fatal)
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)
            return False
        pause = min(2.0 ** (failures - 1), MAX_BACKOFF)
        log.warning("restarting the engine in %g s (restart %d; at most %d within %.0f "
                    "minutes)", pause, failures, self.max_restarts, RESTART_WINDOW / 60)
        if self._stop.wait(pause):
            return False
        self.metrics.restarts.inc()
        if self.status == "failed":
            self.status = "restarting"
        return True

    def _serve(self) -> str | None:
        """Run the engine until it is stopped (None) or fails (the one-line reason)."""
        engine = self.llm.engine
        while not self._stop.is_set():
            if engine.runner.failure is not None:  # the watchdog saw a stage process exit
                return engine.runner.failure
            self._drain(block=not engine.has_work)
            self._end_overdue()
            if engine.has_work:
                start = time.perf_counter()
                try:
                    updated = engine.step()
                    engine.launch()  # the next windows compute while these tokens go out
                except Exception as e:  # noqa: BLE001 - a dead engine fails requests, not hangs
                    if not isinstance(e, StrataError):
                        log.exception("engine failed")
                    return one_line(e)
                self.metrics.window_seconds.observe(time.perf_counter() - start)
                self._send([d for d in map(self._push, updated) if d is not None])
                self.metrics.observe_drafts(engine.draft_stats)
                if engine.meter is not None:
                    self.metrics.observe_pricing(engine.meter.pricing)
                self.metrics.observe_stages(engine.stage_seconds, engine.scheduler_seconds)
                self.metrics.observe_experts(engine.expert_stats)
            scheduler = engine.scheduler
            self.metrics.queue_length.set(len(scheduler.waiting))
            self.metrics.slots_used.set(scheduler.num_running)
            self.metrics.observe_cache(scheduler.pool, scheduler.cached_tokens,
                                       scheduler.preemptions)
        return None

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=POLL) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        engine = self.llm.engine
        if command[0] == "add":
            handle = command[1]
            try:
                engine.add(handle.request)
            except Exception as e:  # noqa: BLE001 - checked at submit; never the engine's end
                self._fail(handle, one_line(e), 400)
                return
            self._handles[handle.request_id] = handle
            self.metrics.prompt_tokens.inc(handle.prompt_tokens)
        elif command[0] == "abort":
            handle = self._handles.pop(command[1], None)
            if handle is not None:
                engine.abort(command[1])  # NOTE: None if it failed and is not reported yet
                self._finished(handle.request)

    def _push(self, request: Request) -> tuple[RequestHandle, Update] | None:
        """The update that carries the request's new tokens to its handle (None if the
        request has no handle: aborted)."""
        handle = self._handles.get(request.request_id)
        if handle is None:
            return None
        now = time.monotonic()
        handle.started = handle.started or now
        start = request.num_prompt_tokens + handle.sent
        ids = request.token_ids[start:]
        logprobs = (request.logprobs[handle.sent:handle.sent + len(ids)]
                    if request.logprobs is not None else None)
        handle.sent += len(ids)
        self.metrics.generation_tokens.inc(len(ids))
        final = request.finished
        if request.finish_reason == "error":
            update = Update(ids, error=request.error, error_status=500)
        else:
            update = Update(ids, request.finish_reason if final else None, logprobs=logprobs,
                            drafts=request.draft_stats.as_dict() if final else None)
        if final:
            del self._handles[request.request_id]
            self._seconds_per_request += 0.2 * (now - handle.started - self._seconds_per_request)
            self._finished(request)
        return handle, update

    def _end_overdue(self) -> None:
        """After begin_shutdown's timeout: end every request still running."""
        if self._shutdown_at is None or time.monotonic() < self._shutdown_at:
            return
        for request_id, handle in list(self._handles.items()):
            self.llm.engine.abort(request_id)
            self._fail(handle, "the server is shutting down (--shutdown-timeout passed)", 503)
        self._handles.clear()

    def _abandon(self, reason: str) -> None:
        """The engine failed: end every request in flight or queued with `reason`."""
        for handle in list(self._handles.values()):
            self._fail(handle, reason, 503)
        self._handles.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._fail(command[1], reason, 503)
        self._close()
        self.metrics.slots_used.set(0)
        self.metrics.queue_length.set(0)

    def _close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.close()  # stage processes stop with the engine
            except Exception:  # noqa: BLE001 - closing a failed engine must not fail
                log.exception("closing the engine failed")
            del llm
            gc.collect()

    def _fail(self, handle: RequestHandle, message: str, status: int) -> None:
        handle.request.fail(message)
        self._send([(handle, Update([], error=message, error_status=status))])
        self._finished(handle.request)

    def _finished(self, request: Request) -> None:
        with self._lock:
            self._unfinished -= 1
        self.metrics.requests.labels(request.finish_reason or "unknown").inc()

    @staticmethod
    def _send(deliveries: list[tuple[RequestHandle, Update]]) -> None:
        """One wake-up of each event loop for all of its handles' updates."""
        loops: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, update in deliveries:
            loops.setdefault(handle.loop, []).append((handle, update))
        for loop, items in loops.items():
            loop.call_soon_threadsafe(deliver_all, items)
