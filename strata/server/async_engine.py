"""AsyncEngine: the engine loop, fed from the asyncio server, and restarted when it fails.

The loop runs an EngineCore (engine_core.py) on the server's engine thread, or, with
`--engine-process`, in a child process of its own (engine_process.py) while the engine
thread only carries commands and Outputs across. Either way the engine (scheduler, stages,
sampler) is touched by one thread. HTTP handlers submit and abort through a command queue;
after every window each request's new token ids (and logprobs) reach that request's
asyncio queue. Loading happens off the event loop, so the server answers /health (503)
while the model loads.

A request that fails alone (its sampling or drafting raised) ends with its own error; the
others go on. A failure of the engine itself — a stage process that exited (seen at once by
the runner's watchdog, also while idle), a hung stage, any exception from a window, the
engine process gone — fails every request in flight with a one-line reason, turns /health
503 ("restarting" and the reason) and builds a new engine (new stage processes, a new
engine process). Restarts are bounded: more than `max_restarts` failures (failed loads
included) within RESTART_WINDOW seconds and the server gives up and exits non-zero
(`on_fatal`), so a supervisor sees it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

from strata.config import EngineConfig
from strata.engine.engine import check_prompt
from strata.errors import StrataError
from strata.llm import LLM
from strata.request import Request
from strata.sampling.params import SamplingParams
from strata.server.engine_core import EngineCore, EngineInfo, Output, one_line
from strata.server.engine_process import FAILED, EngineProcess
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
        self.request = request  # NOTE: the engine thread's (with an engine process, a copy:
                                # the child has its own); read only its constants here
        self.loop = loop
        self._pending: list[Update] = []  # event-loop thread: delivered, not yet read
        self._arrived = asyncio.Event()
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


class AsyncEngine:
    def __init__(self, config: EngineConfig, checkpoint, metrics: Metrics, max_queue: int,
                 max_restarts: int = 3, process: bool = False):
        """`process`: run the engine in a child process of its own (engine_process.py)."""
        self.config, self.metrics, self.max_queue = config, metrics, max_queue
        self.checkpoint = checkpoint
        self.max_restarts = max_restarts
        self.process = process
        self.status = "loading"   # "loading", "ready", "restarting", "failed", "stopped"
        self.error: str | None = None  # one line: why the status is not "ready"
        self.fatal: str | None = None  # why the server gives up (it exits non-zero)
        self.on_fatal: Callable[[str], None] | None = None
        self.info: EngineInfo | None = None  # the loaded engine's limits (None: not loaded)
        self.tokenizer = None                # the model's (set with the first load)
        self._core: EngineCore | EngineProcess | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # a command came: what wakes the engine thread in process mode (a socket pair)
        self._wake = socket.socketpair() if process else None
        for end in self._wake or ():
            end.setblocking(False)
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
        self._command(("wake",))

    def shutdown(self) -> None:
        self._stop.set()
        self._command(("wake",))
        self._thread.join(timeout=15)

    @property
    def ready(self) -> bool:
        return self.health[0] == "ready"

    @property
    def health(self) -> tuple[str, str | None]:
        """(status, one-line reason): the runner's watchdog (or the engine process's exit)
        is read directly, so a failure while idle shows here before the engine thread has
        woken."""
        core = self._core
        failure = core.failure if core is not None and self.status == "ready" else None
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
        info = self.info
        status, reason = self.health
        if status != "ready" or info is None:
            raise NotReady(f"the model is not ready ({status}{': ' + reason if reason else ''})")
        check_prompt(prompt_ids, info.max_context, info.vocab_size)
        limit = self.config.parallel + self.max_queue
        if len(params) > limit:
            raise StrataError(f"n={len(params)} choices need {len(params)} slots, more than "
                              f"--parallel plus --max-queue ({limit}); ask for fewer")
        for p in params:
            self._check_fits(info, len(prompt_ids), p)
        with self._lock:
            if self._unfinished + len(params) > limit:
                raise QueueFull(self.retry_after())
            self._unfinished += len(params)
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(Request(list(prompt_ids), p, info.eos_token_ids), loop)
                   for p in params]
        for handle in handles:
            self._command(("add", handle))
        return handles

    @staticmethod
    def _check_fits(info: EngineInfo, prompt: int, params: SamplingParams) -> None:
        context = info.max_context
        if params.max_tokens is not None and prompt + params.max_tokens > context:
            raise StrataError(
                f"this model's context is {context} tokens (--max-context) but the prompt "
                f"is {prompt} tokens and max_tokens is {params.max_tokens}: lower max_tokens "
                f"to at most {context - prompt} or shorten the prompt")
        vocab = info.vocab_size
        for token, _ in params.logit_bias:
            if token >= vocab:
                raise StrataError(f"logit_bias: token id {token} is outside the vocabulary "
                                  f"(0..{vocab - 1})")

    def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    def _command(self, command: tuple) -> None:
        self._commands.put(command)
        if self._wake is not None:
            try:
                self._wake[1].send(b"\0")
            except OSError:
                pass  # wake-ups are already waiting to be read, or the thread has ended

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
                if self._stop.is_set():
                    break
                if reason is None:
                    reason = (self._serve_process() if self.process else self._serve())
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
            for end in self._wake or ():
                end.close()

    def _load(self) -> str | None:
        """Build the engine; None when ready, else the one-line reason it failed."""
        try:
            if self.process:
                if self.tokenizer is None:
                    self.tokenizer = self._checkpoint().load_tokenizer()
                child = EngineProcess(self.config)
                self._core = child  # NOTE: closed by _close() whatever happens next
                info = child.wait_ready(self._stop)
                if isinstance(info, str):  # why it did not load, in one line
                    raise StrataError(info)
            else:
                llm = LLM(self.config, self.checkpoint)
                self._core = EngineCore(llm)
                self.tokenizer, info = llm.tokenizer, self._core.info
        except Exception as e:  # noqa: BLE001 - any load failure makes the server unhealthy
            if not isinstance(e, StrataError):
                log.exception("the model failed to load")
            self._close()
            reason = f"the model failed to load: {one_line(e)}"
            log.error("%s", reason)
            return reason
        self.info = info
        self.metrics.new_engine()
        self.metrics.slots_total.set(self.config.parallel)
        self.status, self.error = "ready", None
        return None

    def _checkpoint(self):
        if self.checkpoint is None:
            from strata.weights.checkpoint import open_checkpoint
            self.checkpoint = open_checkpoint(self.config.model, self.config.mtp_model)
        return self.checkpoint

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
        """Run the engine on this thread until it is stopped (None) or fails (the one-line
        reason)."""
        core = self._core
        while not self._stop.is_set():
            if core.failure is not None:  # the watchdog saw a stage process exit
                return core.failure
            self._drain(block=not core.has_work)
            self._end_overdue()
            if core.has_work:
                try:
                    outputs = core.step()
                except Exception as e:  # noqa: BLE001 - a dead engine fails requests, not hangs
                    if not isinstance(e, StrataError):
                        log.exception("engine failed")
                    return one_line(e)
                self._deliver(outputs)
            self.metrics.observe_core(core.stats())
        return None

    def _serve_process(self) -> str | None:
        """Carry commands to the engine process and its Outputs back until the server
        stops (None) or the engine fails or exits (the one-line reason)."""
        child = self._core
        while not self._stop.is_set():
            wait([child.results, self._wake[0]], timeout=POLL)
            try:
                self._wake[0].recv(4096)
            except BlockingIOError:
                pass
            self._drain(block=False)
            self._end_overdue()
            try:
                messages = child.receive()
            except (EOFError, OSError):
                child.process.join(1)
                return child.failure or "the engine process exited"
            for message in messages:
                if message[0] == FAILED:
                    return message[1]
                _, outputs, stats = message
                self._deliver(outputs)
                if stats is not None:
                    self.metrics.observe_core(stats)
            if child.failure is not None:
                return child.failure
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
        core = self._core
        if command[0] == "add":
            handle = command[1]
            self._handles[handle.request_id] = handle
            rejected = core.add(handle.request)
            if rejected is not None:
                self._deliver([rejected])
        elif command[0] == "abort":
            handle = self._handles.pop(command[1], None)
            if handle is not None:
                core.abort(command[1])
                self._finished("abort")

    def _deliver(self, outputs: list[Output]) -> None:
        """Hand each Output to its request's handle (none if aborted meanwhile)."""
        deliveries = []
        now = time.monotonic()
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            handle.started = handle.started or now
            self.metrics.generation_tokens.inc(len(out.token_ids))
            if out.error is not None:
                handle.request.fail(out.error)
                update = Update(out.token_ids, error=out.error, error_status=out.error_status)
            else:
                update = Update(out.token_ids, out.finish_reason, drafts=out.drafts,
                                logprobs=out.logprobs)
            if out.error is not None or out.finish_reason is not None:
                del self._handles[out.request_id]
                self._seconds_per_request += 0.2 * (now - handle.started
                                                    - self._seconds_per_request)
                self._finished("error" if out.error is not None else out.finish_reason)
            deliveries.append((handle, update))
        self._send(deliveries)

    def _end_overdue(self) -> None:
        """After begin_shutdown's timeout: end every request still running."""
        if self._shutdown_at is None or time.monotonic() < self._shutdown_at:
            return
        for request_id, handle in list(self._handles.items()):
            self._core.abort(request_id)
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
        core, self._core = self._core, None
        self.info = None
        if core is not None:
            try:
                core.close()  # stage processes stop with the engine
            except Exception:  # noqa: BLE001 - closing a failed engine must not fail
                log.exception("closing the engine failed")
            del core
            gc.collect()

    def _fail(self, handle: RequestHandle, message: str, status: int) -> None:
        handle.request.fail(message)
        self._send([(handle, Update([], error=message, error_status=status))])
        self._finished("error")

    def _finished(self, reason: str | None) -> None:
        with self._lock:
            self._unfinished -= 1
        self.metrics.requests.labels(reason or "unknown").inc()

    @staticmethod
    def _send(deliveries: list[tuple[RequestHandle, Update]]) -> None:
        """One wake-up of each event loop for all of its handles' updates."""
        loops: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, update in deliveries:
            loops.setdefault(handle.loop, []).append((handle, update))
        for loop, items in loops.items():
            loop.call_soon_threadsafe(deliver_all, items)
