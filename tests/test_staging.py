"""StagingBuffer (strata/stage/staging.py): a bucket's metadata tensors as views of one block
of memory, refilled by one copy per window; on the CPU here, the same layout and checks as
on a GPU (where the host side is pinned and a ring of them is reused)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from strata.errors import StrataError
from strata.stage.staging import ALIGN, StagingBuffer, tensor_fields, with_views


@dataclass(frozen=True)
class Meta:
    rows: torch.Tensor
    block_size: int
    table: torch.Tensor
    empty: torch.Tensor


def meta(seed: int) -> Meta:
    g = torch.Generator().manual_seed(seed)
    return Meta(torch.randint(0, 1000, (5,), generator=g), 16,
                torch.randint(0, 100, (3, 4), generator=g, dtype=torch.int32),
                torch.zeros(0, dtype=torch.long))


def test_views_share_one_aligned_block_and_fills_replace_their_values():
    first = meta(0)
    staging = StagingBuffer(tensor_fields(first), torch.device("cpu"))
    static = with_views(first, iter(staging.views))
    assert static.block_size == 16
    for view, value in zip(tensor_fields(static), tensor_fields(first)):
        assert view.untyped_storage().data_ptr() == staging.block.untyped_storage().data_ptr()
        assert (view.data_ptr() - staging.block.data_ptr()) % ALIGN == 0
        assert torch.equal(view, value)  # filled with the templates' values
    table = static.table
    for seed in range(1, 8):  # more fills than the ring has blocks
        new = meta(seed)
        staging.fill(tensor_fields(new))
        assert static.table is table  # the same tensors, refilled in place
        assert torch.equal(static.rows, new.rows) and torch.equal(static.table, new.table)


def test_a_mismatched_tensor_is_refused_before_anything_is_copied():
    first = meta(0)
    staging = StagingBuffer(tensor_fields(first), torch.device("cpu"))
    static = with_views(first, iter(staging.views))
    new = meta(1)
    with pytest.raises(StrataError, match=r"tensor 1 is \(3, 4\) torch.int64, its view "
                                          r"\(3, 4\) torch.int32"):
        staging.fill([new.rows, new.table.long(), new.empty])
    with pytest.raises(StrataError, match=r"tensor 0 is \(6,\)"):
        staging.fill([torch.arange(6), new.table, new.empty])
    with pytest.raises(StrataError, match="2 tensors for 3 views"):
        staging.fill([new.rows, new.table])
    assert torch.equal(static.rows, first.rows) and torch.equal(static.table, first.table)


def test_a_window_written_into_a_claimed_slot_reaches_the_views_when_sent():
    """`claim` names the ring slot whose host arrays (numpy, over the pinned block on a GPU)
    take the next window's values; `send` copies them into the device views and moves on
    to the next slot, so a window written ahead never changes one queued before it."""
    first = meta(0)
    staging = StagingBuffer(tensor_fields(first), torch.device("cpu"), ring=3)
    static = with_views(first, iter(staging.views))
    slots = []
    for seed in range(1, 8):
        new = meta(seed)
        slot = staging.claim()
        host = with_views(new, iter(staging.hosts[slot]))
        host.rows[:] = new.rows.numpy()
        host.table[...] = new.table.numpy()
        assert not torch.equal(static.rows, new.rows)  # not before it is sent
        staging.send(slot)
        slots.append(slot)
        assert torch.equal(static.rows, new.rows) and torch.equal(static.table, new.table)
    assert slots == [1, 2, 0, 1, 2, 0, 1]  # the templates' copy took slot 0
    assert len({id(h[0]) for h in staging.hosts}) == 3
