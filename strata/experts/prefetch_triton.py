"""The expert prefetch's two kernels (prefetch.py): `select` picks a layer's predicted
misses and gives them lent slots, `copy_rows` copies rows from host RAM into slots.
Imported only where they run (CUDA stages, and the tests in triton's interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_BLOCK = 8192  # values of one row that one program copies


def select(predicted: torch.Tensor, rows: torch.Tensor, host_rows: torch.Tensor,
           lend: torch.Tensor, record: torch.Tensor, source: torch.Tensor) -> None:
    """prefetch.select_torch as one program of one kernel (no host sync, a few
    microseconds)."""
    experts = rows.shape[0]
    _select[(1,)](predicted, rows, host_rows, lend, record, source, experts,
                  lend.shape[0] - 1, PER_LAYER=record.shape[1],
                  BLOCK_E=triton.next_power_of_2(experts))


def copy_rows(pool: torch.Tensor, source: torch.Tensor, slots: torch.Tensor) -> None:
    """Copy row source[i] (relative to `pool`: a slot, or host RAM by address) into row
    slots[i] of `pool`, for each slots[i] >= 0: one kernel, no host sync."""
    grid = (slots.shape[0], triton.cdiv(pool.shape[1], COPY_BLOCK))
    _copy_rows[grid](pool, source, slots, pool.shape[1], BLOCK=COPY_BLOCK)


@triton.jit
def _copy_rows(pool_ptr, source_ptr, slots_ptr, row_size, BLOCK: tl.constexpr):
    """Program (i, j): chunk j of row source[i] into row slots[i] (skipped: -1)."""
    slot = tl.load(slots_ptr + tl.program_id(0))
    source = tl.load(source_ptr + tl.program_id(0))
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < tl.where(slot >= 0, row_size, 0)  # nothing where there is no slot
    values = tl.load(pool_ptr + source * row_size + cols, mask=mask)
    tl.store(pool_ptr + slot * row_size + cols, values, mask=mask)

@triton.jit
def _select(predicted_ptr, rows_ptr, host_rows_ptr, lend_ptr, record_ptr, source_ptr,
            num_experts, capacity, PER_LAYER: tl.constexpr, BLOCK_E: tl.constexpr):
    """prefetch.select_torch: the most predicted misses, one at a time, take lent slots."""
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    rows = tl.load(rows_ptr + e, mask=valid, other=0)
    home = tl.load(host_rows_ptr + e, mask=valid, other=1)
    wanted = tl.load(predicted_ptr + e, mask=valid, other=0)
    wanted = tl.where(valid & (rows == home), wanted, 0)
    taken = tl.load(lend_ptr)
    for i in tl.static_range(PER_LAYER):
        best = tl.max(wanted, axis=0)
        expert = tl.min(tl.where(wanted == best, e, BLOCK_E), axis=0)  # the lowest id
        slot = tl.load(lend_ptr + 1 + tl.minimum(taken, capacity - 1))
        took = (best > 0) & (taken < capacity) & (slot >= 0)
        row = tl.sum(tl.where(e == expert, rows, 0), axis=0)
        tl.store(record_ptr + i, tl.where(took, expert, -1).to(tl.int64))
        tl.store(record_ptr + PER_LAYER + i, tl.where(took, slot, -1))
        tl.store(source_ptr + i, tl.where(took, row, -1))
        tl.store(rows_ptr + expert, slot, mask=took)
        taken += took.to(tl.int64)
        wanted = tl.where(e == expert, -1, wanted)
    tl.store(lend_ptr, taken)
