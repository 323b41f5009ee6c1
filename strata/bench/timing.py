"""Helpers of the kernel benchmarks (benchmarks/moe_cost.py, quant_speed.py,
deltanet_cost.py, solo_speed.py): the median time of a call — on CUDA replayed from a CUDA
graph of several calls where the call can be captured (launches and the replay's own cost
not counted) unless asked to run eagerly, else eagerly with a sync around each call —,
random weights for a layer built on its own, and the device's memory bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

GRAPH_CALLS = 20  # calls captured in one CUDA graph (median_seconds)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int,
                   eager: bool = False, per_graph: int = GRAPH_CALLS) -> float:
    """`eager`: time each call as launched (for layers that are not captured in graphs).
    A CUDA graph holds `per_graph` calls back to back and its replay time is divided by
    them: a replay and its sync cost ~14 us on the H200 whatever the graph holds, more
    than a decoding window's MoE routing or DeltaNet layer (benchmarks/README.md), and a
    model's stage replays all its layers in one graph."""
    fn()  # compiles and warms up
    calls = 1
    if device.type == "cuda" and not eager:
        torch.cuda.synchronize(device)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(per_graph):
                    fn()
            fn, calls = graph.replay, per_graph
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
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def random_weights(module: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                   seed: int = 0) -> torch.nn.Module:
    """`module` with every parameter N(0, 0.02) in `dtype` on `device` (speed does not
    depend on the values)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.data = torch.empty(p.shape, dtype=dtype, device=device).normal_(
                0.0, 0.02, generator=gen)
    return module


def bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted); NaN
    off CUDA."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * 10 * src.numel() / (time.perf_counter() - start)
