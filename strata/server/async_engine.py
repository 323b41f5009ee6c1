"""AsyncEngine: the engine loop on its own thread, fed from the asyncio server.

The engine (scheduler, stages, sampler) is touched only by its thread. HTTP handlers
submit and abort through a command queue; after every window the thread pushes each
request's new token ids to that request's asyncio queue. Loading happens on the thread
too, so the server answers /health (503) while the model loads.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from strata.config import EngineConfig
from strata.llm import LLM
from strata.request import Request
from strata.sampling.params import SamplingParams
from strata.server.metrics import Metrics

log = logging.getLogger("strata.server")


class QueueFull(Exception):
    """More requests than slots plus --max-queue."""


@dataclass
class Update:
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    drafts: dict | None = None  # the request's draft statistics, with the final update


class RequestHandle:
    """The HTTP side of one request: an async stream of Updates."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request_id = request.request_id
        self.prompt_tokens = request.num_prompt_tokens
        self.request = request  # NOTE: owned by the engine thread; read only its constants here
        self.loop = loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.sent = 0  # engine thread: output ids pushed so far

    async def updates(self) -> AsyncIterator[Update]:
        while True:
            update = await self.queue.get()
            yield update
            if update.finish_reason is not None or update.error is not None:
                return


class AsyncEngine:
    def __init__(self, config: EngineConfig, checkpoint, metrics: Metrics, max_queue: int):
        self.config, self.metrics, self.max_queue = config, metrics, max_queue
        self.checkpoint = checkpoint
        self.status = "loading"          # "loading", "ready", "failed"
        self.error: str | None = None
        self.llm: LLM | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}
        self._unfinished = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)

    # -- asyncio side ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request; raises StrataError (bad prompt) or QueueFull."""
        engine = self.llm.engine
        engine.check_prompt(prompt_ids)
        with self._lock:
            if self._unfinished >= self.config.parallel + self.max_queue:
                raise QueueFull()
            self._unfinished += 1
        request = Request(list(prompt_ids), params, self.llm.eos_token_ids)
        handle = RequestHandle(request, asyncio.get_running_loop())
        self._commands.put(("add", handle))
        return handle

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.llm = LLM(self.config, self.checkpoint)
        except Exception as e:  # noqa: BLE001 - any load failure makes the server unhealthy
            self.status, self.error = "failed", str(e)
            log.error("model failed to load: %s", e)
            return
        self.metrics.slots_total.set(self.config.parallel)
        self.status = "ready"
        engine = self.llm.engine
        try:
            while not self._stop.is_set():
                self._drain(block=not engine.has_work)
                if engine.has_work:
                    start = time.perf_counter()
                    updated = engine.step()
                    self.metrics.window_seconds.observe(time.perf_counter() - start)
                    for request in updated:
                        self._push(request)
                    self.metrics.observe_drafts(engine.draft_stats)
                    self.metrics.observe_stages(engine.stage_seconds, engine.scheduler_seconds)
                self.metrics.queue_length.set(len(engine.scheduler.waiting))
                self.metrics.slots_used.set(engine.scheduler.num_running)
        except Exception as e:  # noqa: BLE001 - a dead engine must fail requests, not hang them
            log.exception("engine failed")
            self.status, self.error = "failed", f"engine failed: {e}"
            for handle in list(self._handles.values()):
                self._send(handle, Update([], error=self.error))
            self._handles.clear()
        finally:
            engine.close()  # stage processes stop with the engine thread

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
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
            self._handles[handle.request_id] = handle
            engine.add(handle.request)
            self.metrics.prompt_tokens.inc(handle.prompt_tokens)
        elif command[0] == "abort":
            handle = self._handles.pop(command[1], None)
            if handle is not None and engine.abort(command[1]) is not None:
                self._finished(handle.request)

    def _push(self, request: Request) -> None:
        handle = self._handles.get(request.request_id)
        if handle is None:
            return
        ids = request.token_ids[request.num_prompt_tokens + handle.sent:]
        handle.sent += len(ids)
        self.metrics.generation_tokens.inc(len(ids))
        final = request.finished
        self._send(handle, Update(ids, request.finish_reason if final else None,
                                  drafts=request.draft_stats.as_dict() if final else None))
        if request.finished:
            del self._handles[request.request_id]
            self._finished(request)

    def _finished(self, request: Request) -> None:
        with self._lock:
            self._unfinished -= 1
        self.metrics.requests.labels(request.finish_reason or "unknown").inc()

    @staticmethod
    def _send(handle: RequestHandle, update: Update) -> None:
        handle.loop.call_soon_threadsafe(handle.queue.put_nowait, update)
