"""SnapshotKeeper: the scheduler's side of prefix reuse for layers with per-slot state
(kvcache/snapshots.py keeps the snapshots): when to copy a slot's state to its snapshot
row, which snapshot a reusing request starts from, and the row copies that the next window
carries (WindowHeader.state_copies, run on every stage before it computes).

A slot copies its state to its snapshot row each time a commit moves its committed tokens
across a block boundary whose state a row of the window holds (a window writes the state
after its last known token and after each draft). A prompt chunk that would cross the last
boundary of the tokens known at admission (`Slot.keep_at`) is cut there, so that state is
always caught; it is kept when a later snapshot takes its place, and the last one when the
slot lets go of its request. A request reuses the longest run of its cached blocks after
whose last block a snapshot is kept.

With MTP drafts (`lag` 1) each snapshot is the state one token before its boundary: a
reusing request runs the last cached token again (its KV not written, Scheduler._build) so
that the MTP layer has that token's hidden state, and its recurrent layers must start from
the state before it.
"""

from __future__ import annotations

import torch

from strata.kvcache.block_pool import RowPool
from strata.kvcache.snapshots import StateSnapshots
from strata.scheduler.slot import Slot

Hits = list[tuple[bytes, int | None]]  # BlockPool.cached_prefix


class SnapshotKeeper:
    def __init__(self, capacity: int, rows: RowPool, block_size: int, lag: int = 0):
        self.snapshots = StateSnapshots(capacity)
        self.rows, self.block_size, self.lag = rows, block_size, lag
        self.copies: list[tuple[int, int]] = []  # (row, row) for the next window

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def reusable(self, hits: Hits) -> tuple[Hits, int | None]:
        """The longest run of `hits` after whose last block a snapshot is kept, and that
        snapshot's row (none: nothing is reused)."""
        for end in range(len(hits), 0, -1):
            if (row := self.snapshots.get(hits[end - 1][0])) is not None:
                return hits[:end], row
        return [], None

    def start(self, slot: Slot, snapshot: int | None) -> None:
        """An admitted slot: the boundary to catch, and the snapshot it starts from."""
        size = self.block_size
        slot.keep_at = (slot.request.num_tokens - 1) // size * size
        if snapshot is not None:
            self.copies.append((snapshot, slot.state_current))

    def chunk(self, slot: Slot, count: int) -> int:
        """A prompt chunk of `count` tokens, cut to end where `keep_at`'s snapshot is
        taken if it would cross that point."""
        end = slot.keep_at - self.lag
        if slot.snapshot_at < slot.keep_at and slot.num_computed < end < slot.num_computed + count:
            return end - slot.num_computed
        return count

    def committed(self, slot: Slot, rows: torch.Tensor, start: int, count: int, drafted: int,
                  accepted: int) -> None:
        """A slot's entry committed (its state rows, start, tokens, drafts and accepted
        drafts): copy the state at a boundary it crossed to the snapshot row."""
        last_known = start + count - 1 - drafted
        boundary = (last_known + accepted + 1 + self.lag) // self.block_size * self.block_size
        after = boundary - 1 - self.lag  # the token whose state the snapshot is
        if after < last_known or boundary <= slot.snapshot_at:
            return
        if slot.snapshot_at and slot.snapshot_at == slot.keep_at:  # the prompt's is kept
            self.keep(slot)
            if slot.snapshot_row is None:
                slot.snapshot_row = self.rows.allocate(1)[0]
        self.copies.append((int(rows[1 + after - last_known]), slot.snapshot_row))
        slot.snapshot_at = boundary

    def keep(self, slot: Slot) -> None:
        """The slot's snapshot (of a registered block) is kept; the rows of those no longer
        kept go back."""
        if (taken := slot.take_snapshot()) is not None:
            self.rows.release(self.snapshots.put(*taken))
