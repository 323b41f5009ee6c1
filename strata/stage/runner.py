"""The Runner interface, and ModelRunner: the stages of a checkpoint in this process.

A Runner takes windows in submission order and returns their results in the same order.
ModelRunner's stages run one after another, each on its own device; hidden states move
between devices as the window goes. A window is launched when submitted and verified when
collected, so the engine drives this runner exactly like the stage processes
(strata/pipeline/runner.py): submit each idle group's window, collect the oldest result; on
a GPU the host builds the next window while the device computes the last one.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Protocol

import torch
from tqdm import tqdm

from strata.config import EngineConfig
from strata.errors import StrataError
from strata.kvcache.spec import CacheSize
from strata.scheduler.window import Window, WindowHeader
from strata.stage.results import LaunchedWindow, WindowResult, WindowVerifier
from strata.stage.stage import build_stage


def check_device(device: torch.device) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise StrataError(f"device {device} requested but this PyTorch has no usable CUDA "
                              "GPU; use --devices cpu or install a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise StrataError(f"device {device} does not exist: this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise StrataError(f"device type '{device.type}' is not supported (use cpu or cuda:N)")


class Runner(Protocol):
    """What the Engine drives: ModelRunner here, PipelineRunner with stage processes."""

    failure: str | None  # why the runner broke on its own, seen from any thread (a stage
                         # process exited while idle); None while it works

    @property
    def num_stages(self) -> int: ...

    @property
    def num_in_flight(self) -> int:
        """Windows submitted and not collected yet."""

    def submit(self, window: Window) -> None:
        """Send a window on its way (it may run later, or start now elsewhere)."""

    def collect(self) -> tuple[Window, WindowResult]:
        """The oldest window in flight and its result."""

    def close(self) -> None:
        """Stop whatever runs the stages; the runner cannot be used afterwards."""


class ModelRunner:
    failure = None  # stages in this process do not break on their own
    device_wait_seconds = 0.0  # host time spent waiting for the GPU in collect()

    def __init__(self, config: EngineConfig, checkpoint, cache_size: CacheSize,
                 mtp: bool = False):
        ranges = config.stage_ranges(checkpoint.config.num_layers)
        for i in range(len(ranges)):
            check_device(config.stage_device(i))
        self.stages = [build_stage(config, checkpoint.config, i, cache_size, mtp=mtp)
                       for i in range(len(ranges))]
        total = sum(sum(1 for _ in s.module.parameters()) for s in self.stages)
        with tqdm(total=total, desc="loading", unit="tensor", file=sys.stderr,
                  disable=not sys.stderr.isatty(), leave=False) as progress:
            for stage in self.stages:
                stage.load(checkpoint, progress)
        for stage in self.stages:
            stage.capture_graphs(config)
        self.last = WindowVerifier(self.stages[-1], config)
        self._queue: deque[tuple[Window, LaunchedWindow, list[float]]] = deque()  # launched
        # each stage's host seconds in the last submit (a CPU stage's compute: it runs there)
        self.submitted_seconds: list[float] = []

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    def submit(self, window: Window) -> None:
        """Launch the window through every stage and its verification. On a GPU this
        returns once the work is queued, so the engine schedules the next group's window
        while the GPU computes."""
        header = window.header
        seconds, events = [], []
        x = header.token_ids
        for stage in self.stages:
            start = time.perf_counter()
            pair = None
            if stage.device.type == "cuda":  # its GPU time, read once the window is done
                pair = (torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True))
                pair[0].record()
            stage.move_blocks(header)
            meta = stage.prepare(header)
            if stage is self.stages[0] and header.carry:  # a bucket that carries its ids
                x = self._carried(header, getattr(meta, "num_carried", 0) > 0)  # itself
            x = stage.forward(x, meta)
            if pair is not None:
                pair[1].record()
            seconds.append(time.perf_counter() - start)
            events.append(pair)
        self.submitted_seconds = seconds
        logits, hidden, decided = x
        self._queue.append((window, self.last.launch(header, logits, hidden, decided),
                            (seconds, events)))

    def _carried(self, header: WindowHeader, decided_only: bool = False) -> torch.Tensor:
        """The input token ids of a window built ahead, on the device: at its carry_rows
        the tokens that the group's last window launched decided for its entries
        carry_from, elsewhere the header's own. `decided_only`: those decided tokens alone
        (per entry of that window), for a graph bucket that puts them in place itself."""
        for window, launched, _ in reversed(self._queue):
            if window.header.group == header.group:
                decided = launched.decided[1]
                break
        else:
            raise RuntimeError(f"a window of group {header.group} carries tokens over but "
                               "none of that group's windows is in flight")
        if header.carry_first:  # hedges: the token at their entry's first draft position
            hedges = [(e, t) for e, t in zip(header.carry_from, header.carry_first) if t >= 0]
            at, first = torch.tensor(hedges, dtype=torch.long).T.to(decided.device,
                                                                    non_blocking=True)
            accepted = launched.decided[0].index_select(0, at) > 0
            decided = decided.index_copy(0, at, torch.where(
                accepted, first.to(decided.dtype), decided.index_select(0, at)))
        if decided_only:
            return decided
        n = header.num_tokens
        if header.carry_rows == list(range(n)) and header.carry_from == list(range(n)):
            return decided if decided.shape[0] == n else decided[:n]
        device = decided.device
        ids = header.token_ids.to(device, non_blocking=True, copy=True)
        rows, src = torch.tensor([header.carry_rows, header.carry_from]).to(device,
                                                                           non_blocking=True)
        ids[rows] = decided[src]
        return ids

    def collect(self) -> tuple[Window, WindowResult]:
        """Read back the oldest window launched (its one host read waits for the GPU)."""
        window, launched, (seconds, events) = self._queue.popleft()
        start = time.perf_counter()
        launched.wait()  # for this window only: windows launched after it go on computing
        self.device_wait_seconds += time.perf_counter() - start
        result = self.last.finish(launched)
        result.stage_seconds = [  # a CUDA stage's GPU time, a CPU stage's own
            spent if pair is None else pair[0].elapsed_time(pair[1]) / 1e3
            for spent, pair in zip(seconds, events)]
        if any(stage.experts is not None for stage in self.stages):
            result.expert_stats = [stage.report()[1:] for stage in self.stages]
        return window, result

    def close(self) -> None:
        self._queue.clear()
