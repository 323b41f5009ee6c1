"""Split sums: a product whose row tiles are walked by several programs each (splits of the
reduction), added up in the same launch by the tile's last program to finish.

A kernel that splits its reduction calls `finish` with each program's fp32 sums: with one
split the program stores y in the output's dtype; with more, each stores its partial,
counts itself in at its row tile's arrival counter (counters.py), and the last to arrive
adds the partials up in split order (the same bits whichever arrives last), stores y and
sets the counter back to 0. `split_sums` allocates what such a launch needs. Used by the
quantized GEMV (strata/quant/triton_quant.py) and the dense GEMM of verify windows
(gemv_triton.py): one launch where a separate sum and cast would take two.

NOTE: importing this module imports triton. Nothing here syncs with the host or
allocates by data (CUDA graphs).
"""

# NOTE: no `from __future__ import annotations` here: triton reads `tl.constexpr`
# annotations as objects.
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from strata.layers.counters import MAX_COUNTERS, arrival_counters


@triton.jit
def finish(acc, out_ptr, partial_ptr, count_ptr, at, split_stride, mask,
           SPLIT: tl.constexpr):
    """Store a program's sums `acc` (y's elements `at`) as y in out's dtype. With SPLIT
    (the row tile, axis 0, walked by several programs, axis 1) each program stores its
    fp32 partial and counts itself in at its tile's counter; the last one to arrive adds
    the partials up in split order, stores y and sets the counter back to 0 for the next
    launch. NOTE: the barrier puts every thread's partial before the counter's release;
    the partials are read past L1 (.cg)."""
    if SPLIT:
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        tl.store(partial_ptr + split * split_stride + at, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel")
        if arrived == splits - 1:
            total = tl.zeros_like(acc)
            for s in range(splits):
                total += tl.load(partial_ptr + s * split_stride + at, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tl.program_id(0), 0)
    else:
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_sums(x: torch.Tensor, rows: int, tiles: int, splits: int,
               launch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
               ) -> torch.Tensor:
    """y [T, rows] in x's dtype from `launch(out, partial, counts)`: a kernel that writes
    y itself (one split), or whose `splits` programs per row tile write fp32 partials
    [splits, T, rows] that the tile's last one adds up into y (`finish`)."""
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if splits == 1:
        launch(out, out, out)  # the partial and counter pointers go unused
        return out
    assert tiles <= MAX_COUNTERS, (tiles, splits)
    launch(out, torch.empty(splits, x.shape[0], rows, dtype=torch.float32, device=x.device),
           arrival_counters(x.device))
    return out
