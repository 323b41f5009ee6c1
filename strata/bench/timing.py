"""Median time of a call for the kernel benchmarks (benchmarks/moe_cost.py,
quant_speed.py): on CUDA replayed from a CUDA graph where the call can be captured, so
that launches are not counted, else run eagerly with a sync around each call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # compiles and warms up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            fn = graph.replay
        except RuntimeError:  # not capturable (a host sync): timed eagerly
            torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
