"""The engine loop in a child process of its own (`strata serve --engine-process`).

In one process the server's event loop (parsing requests, detokenizing, writing SSE
chunks) and the engine's host work (scheduling, proposing, verifying) take turns on one
GIL, so every chunk sent delays the next window. Here the child runs an EngineCore and
nothing else; the server sends it requests and aborts down one pipe and reads Outputs and
CoreStats from another, one message per step. The child ignores SIGINT and SIGTERM (the
server stops it once its requests are done) and ends when the server's end of the pipe
closes, so it never outlives the server;
the server restarts it when it exits (a crash in a kernel, the OOM killer) as it restarts
a failed engine thread.

Messages from the child: (READY, EngineInfo), (OUTPUTS, [Output], CoreStats | None),
(FAILED, one-line reason). To the child: ("add", Request), ("abort", request_id), ("stop",).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from strata.config import EngineConfig
from strata.errors import StrataError
from strata.llm import LLM
from strata.request import Request
from strata.server.engine_core import EngineCore, EngineInfo, one_line

log = logging.getLogger("strata.server")

READY, OUTPUTS, FAILED = "ready", "outputs", "failed"
POLL = 0.5           # an idle child wakes this often (a stage process's watchdog)
STATS_EVERY = 0.05   # seconds between CoreStats while the engine steps (and when it idles)
STOP_WAIT = 10.0     # seconds a child may take to stop before it is terminated


def run(config: EngineConfig, commands: Connection, results: Connection, level: int) -> None:
    """The child's main: load, say READY (or FAILED), then step while there is work."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a terminal's or a service manager's stop
        signal.signal(sig, signal.SIG_IGN)      # reaches the whole group: the server
                                                # finishes its requests, then stops this one
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    try:
        llm = LLM(config)
    except Exception as e:  # noqa: BLE001 - any load failure is reported, then the child ends
        if not isinstance(e, StrataError):
            log.exception("the model failed to load")
        results.send((FAILED, one_line(e)))
        return
    core = EngineCore(llm)
    try:
        results.send((READY, core.info))
        _loop(core, commands, results)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server is gone
    finally:
        core.close()


def _loop(core: EngineCore, commands: Connection, results: Connection) -> None:
    last_stats, dirty = 0.0, False
    while True:
        failure = core.failure
        if failure is not None:
            results.send((FAILED, failure))
            return
        outputs = []
        if commands.poll(0 if core.has_work else POLL):
            while True:
                command = commands.recv()
                if command[0] == "stop":
                    return
                if command[0] == "add":
                    rejected = core.add(command[1])
                    if rejected is not None:
                        outputs.append(rejected)
                elif command[0] == "abort":
                    core.abort(command[1])
                dirty = True
                if not commands.poll(0):
                    break
        if core.has_work:
            try:
                outputs += core.step()
            except Exception as e:  # noqa: BLE001 - a dead engine fails requests, not hangs
                if not isinstance(e, StrataError):
                    log.exception("engine failed")
                results.send((FAILED, one_line(e)))
                return
            dirty = True
        now = time.monotonic()
        stats = None
        if dirty and (now - last_stats >= STATS_EVERY or not core.has_work):
            stats, last_stats, dirty = core.stats(), now, False
        if outputs or stats is not None:
            results.send((OUTPUTS, outputs, stats))


class EngineProcess:
    """The server's side of one child: start it, send it commands, read its messages."""

    def __init__(self, config: EngineConfig):
        ctx = mp.get_context("spawn")  # NOTE: no fork: the child starts CUDA on its own
        commands, self._commands = ctx.Pipe(duplex=False)
        self.results, results = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run, name="strata-engine", args=(
            config, commands, results, logging.getLogger().getEffectiveLevel()))
        self.process.start()
        commands.close()  # the child's ends: an exited child shows as EOF here
        results.close()
        log.info("the engine runs in its own process (pid %d)", self.process.pid)

    @property
    def failure(self) -> str | None:
        """Why the child is gone, or None while it runs."""
        code = self.process.exitcode
        if code is None:
            return None
        how = f"signal {-code}" if code < 0 else f"status {code}"
        return f"the engine process exited ({how})"

    def wait_ready(self, stop: threading.Event) -> EngineInfo | str:
        """The child's EngineInfo once it has loaded, or the one-line reason it did not."""
        while not stop.is_set():
            try:
                if not self.results.poll(POLL):
                    if self.failure is not None:
                        return self.failure
                    continue
                message = self.results.recv()
            except (EOFError, OSError):
                return self.failure or "the engine process exited"
            if message[0] == READY:
                return message[1]
            if message[0] == FAILED:
                return message[1]
        return "the server is stopping"

    def add(self, request: Request) -> None:
        """Send the request; an Output says later if it could not be admitted."""
        self._send(("add", request))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        """Only the server's engine thread sends (commands, and close())."""
        try:
            self._commands.send(command)
        except OSError:
            pass  # the child is gone: its results pipe says so

    def receive(self) -> list[tuple]:
        """The messages that have come, without waiting. Raises EOFError when the child
        has exited and nothing is left to read."""
        messages = []
        while self.results.poll(0):
            messages.append(self.results.recv())
        return messages

    def close(self) -> None:
        """Stop the child (its stage processes with it) and wait for it."""
        self._send(("stop",))
        self.process.join(STOP_WAIT)
        if self.process.is_alive():
            log.warning("the engine process did not stop in %.0f s; terminating it", STOP_WAIT)
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._commands.close()
        self.results.close()
