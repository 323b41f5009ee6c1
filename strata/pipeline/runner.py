"""PipelineRunner: the engine's side of the stage processes.

It starts one process per stage (or joins the stages torchrun started), publishes the
plan, waits until every stage has loaded its layers, then sends each submitted window's
header to every stage. A receiver thread takes results from the last stage in order.
`collect` waits for the oldest window's result while watching the stages: a stage process
that exits, or no result for --stage-timeout seconds, raises StageFailure within a
fraction of a second of being noticed, and every stage process is stopped. A watchdog
thread waits on the stage processes' sentinels all the time, so a stage that dies while
the engine is idle is known at once (`failure`).

A failure is told in one line that names the stage that died for a reason of its own:
stages that stop only because a neighbour vanished exit with NEIGHBOUR_GONE and are named
only when no other stage died. Transport errors (gloo's text, peer addresses) go to the
log, never into the message.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
from collections import deque

import torch.distributed as dist

from strata.config import EngineConfig
from strata.errors import StrataError
from strata.kvcache.spec import CacheSize
from strata.pipeline import rendezvous
from strata.pipeline.transport import Pending, pack, recv_object, send_object, send_packed
from strata.pipeline.worker import NEIGHBOUR_GONE, STOP, WINDOW, stage_process_main
from strata.scheduler.window import Window
from strata.stage.results import WindowResult
from strata.stage.runner import check_device

log = logging.getLogger("strata.pipeline")

POLL_SECONDS = 0.1
EXIT_GRACE_SECONDS = 3.0  # how long a failed send or receive waits for a stage exit to show


class StageFailure(StrataError):
    """A stage process died or hung; the engine cannot go on."""


class PipelineRunner:
    def __init__(self, config: EngineConfig, checkpoint, cache_size: CacheSize,
                 mtp: bool = False):
        if dist.is_initialized():
            raise StrataError("this process already runs stage processes (one pipelined "
                              "engine per process); close the other engine first")
        ranges = config.stage_ranges(checkpoint.config.num_layers)
        devices = [config.stage_device(i) for i in range(len(ranges))]
        for device in devices:
            check_device(device)
        nccl = all(d.type == "cuda" for d in devices) and len(set(map(str, devices))) == len(
            devices)
        self.plan = rendezvous.Plan(config, cache_size, mtp, nccl)
        self.num_stages = len(ranges)
        self.timeout = config.stage_timeout
        self.processes: list[multiprocessing.Process] = []
        self.pending = Pending()
        self.in_flight: deque[Window] = deque()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.last_progress = time.monotonic()
        self.receiver: threading.Thread | None = None
        self.closed = False
        self.failure: str | None = None  # set by the watchdog when a stage process exits
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # -- start ------------------------------------------------------------------------------
    def _start(self) -> None:
        rank = rendezvous.torchrun_rank()
        if rank is None:
            store = rendezvous.host_store()
            address = rendezvous.Address("127.0.0.1", store.port, self.num_stages + 1)
            context = multiprocessing.get_context("spawn")
            for stage in range(self.num_stages):
                process = context.Process(
                    target=stage_process_main, name=f"strata-stage-{stage}", daemon=True,
                    args=(address.host, address.port, address.world_size, stage + 1))
                process.start()
                self.processes.append(process)
        else:
            address = rendezvous.torchrun_address()
            if address.world_size != self.num_stages + 1:
                raise StrataError(f"torchrun started {address.world_size} processes but "
                                  f"{self.num_stages} stages need {self.num_stages + 1} "
                                  "(the server plus one per stage): set --nproc-per-node "
                                  "(summed over nodes) to match")
            store = rendezvous.connect_store(address)
        rendezvous.publish_plan(store, self.plan)
        self._wait_ready(store)
        self.groups = rendezvous.join_groups(store, 0, self.plan)
        self.receiver = threading.Thread(target=self._receive, name="strata-results",
                                         daemon=True)
        self.receiver.start()
        if self.processes:
            threading.Thread(target=self._watch, name="strata-stage-watchdog",
                             daemon=True).start()
        config = self.plan.config
        log.info("%d stage processes ready (%s), %d groups, hidden states over %s",
                 self.num_stages, ", ".join(
                     f"stage {i}: {config.stage_device(i)} pid {p.pid}"
                     for i, p in enumerate(self.processes)) or "started by torchrun",
                 config.num_groups(), "NCCL" if self.plan.nccl else "gloo")

    def _wait_ready(self, store) -> None:
        """Until every stage reports "ok". The first load error reported is raised; a stage
        that exited without reporting one crashed."""
        keys = rendezvous.strata_keys(store)
        names = [rendezvous.ready_key(i) for i in range(self.num_stages)]
        while True:
            # NOTE: exits are seen before the keys are read: a stage writes its load error,
            # then exits, so a stage seen exited here has its error in the keys read below.
            exited = any(not process.is_alive() for process in self.processes)
            reported = [keys.get(name).decode() if keys.check([name]) else None
                        for name in names]
            for stage, status in enumerate(reported):
                if status not in (None, "ok"):
                    self.close(graceful=False)  # at once: the others would not exit by themselves
                    raise StrataError(f"stage {stage} could not load: "
                                      f"{status.removeprefix('error: ')}")
            if None not in reported:
                return
            if exited:
                self._check_alive("it stopped while loading its layers (its error is above), "
                                  "so the engine did not start")
            time.sleep(POLL_SECONDS)

    # -- windows ----------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def submit(self, window: Window) -> None:
        if self.closed:
            raise StageFailure(f"the stage processes have stopped ({self.failure or 'closed'})")
        header = window.header
        if header.carry:
            raise RuntimeError("stage processes cannot carry tokens between windows; the "
                               "scheduler builds no window ahead for them")
        if not self.in_flight:
            self.last_progress = time.monotonic()
        message = pack((WINDOW, header))
        try:
            for stage in range(self.num_stages):
                send_packed(message, stage + 1, self.pending)
        except Exception as e:  # noqa: BLE001 - a stage is gone; say which, not gloo's text
            log.warning("sending a window to the stages failed: %s", e)
            self._fail_transport("sending a window to the stage processes failed")
        self.in_flight.append(window)

    def collect(self) -> tuple[Window, WindowResult]:
        """The oldest window in flight and its result, in submission order."""
        if self.closed:
            raise StageFailure(f"the stage processes have stopped ({self.failure or 'closed'})")
        while True:
            try:
                result = self.results.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                self._check_alive()
                waited = time.monotonic() - self.last_progress
                if waited > self.timeout:
                    self._fail(f"no result from the stages for {waited:.0f} s "
                               f"(--stage-timeout {self.timeout:g}): a stage is hung")
        if isinstance(result, Exception):
            log.warning("receiving from the last stage failed: %s", result)
            self._fail_transport("the connection to the last stage failed")
        self.last_progress = time.monotonic()
        return self.in_flight.popleft(), result

    def _receive(self) -> None:
        try:
            while True:
                self.results.put(recv_object(self.num_stages, group=self.groups.results))
        except Exception as e:  # noqa: BLE001 - handed to collect(), which fails the engine
            self.results.put(e)

    # -- faults and shutdown ----------------------------------------------------------------
    def _watch(self) -> None:
        """Wait until any stage process exits; unless the runner is closing, record why."""
        fired = multiprocessing.connection.wait([p.sentinel for p in self.processes])
        for process in self.processes:
            if process.sentinel in fired:
                process.join(timeout=1)  # NOTE: its pipe closes just before it can be reaped
        if not self.closed:
            self.failure = self._dead_stage()
            log.error("%s", self.failure)

    def _dead_stage(self) -> str | None:
        """One line naming the stage process that exited for a reason of its own (a signal,
        an error), preferred to those that followed a vanished neighbour."""
        dead = [(i, p) for i, p in enumerate(self.processes) if not p.is_alive()]
        if not dead:
            return None
        first = [d for d in dead if d[1].exitcode != NEIGHBOUR_GONE] or dead
        stage, process = first[0]
        return f"stage {stage} (pid {process.pid}) exited with code {process.exitcode}"

    def _check_alive(self, when: str = "") -> None:
        dead = self._dead_stage()
        if dead is not None:
            self.failure = dead
            self._fail(f"{dead}; {when}" if when else dead)

    def _fail_transport(self, message: str):
        """A send or receive failed: a stage is gone or going. Its connection can reset
        before its exit is visible here, so wait a moment for the exit to name the stage."""
        deadline = time.monotonic() + EXIT_GRACE_SECONDS
        while time.monotonic() < deadline:
            self._check_alive()
            time.sleep(POLL_SECONDS / 10)
        self._fail(message)

    def _fail(self, message: str):
        self.failure = self.failure or message
        self.close(graceful=False)
        raise StageFailure(message)

    def close(self, graceful: bool = True) -> None:
        """Stop every stage process: ask them (graceful), then terminate, then kill.
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        graceful = graceful and self.failure is None
        if graceful and dist.is_initialized():
            for stage in range(self.num_stages):
                try:
                    send_object((STOP, None), stage + 1, self.pending)
                except Exception:  # noqa: BLE001 - that stage is gone already
                    pass
        deadline = time.monotonic() + (5 if graceful else 0)
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=1)
            if process.is_alive():
                process.kill()
                process.join()
        receiver = self.receiver
        if receiver is not None:  # it ends when the last stage's connection closes
            receiver.join(timeout=max(0.0, deadline - time.monotonic()) + 1)
        # NOTE: destroying the groups under a receive still blocked would abort the process.
        if dist.is_initialized() and (receiver is None or not receiver.is_alive()):
            dist.destroy_process_group()
