"""Slot: one of the P places a running request occupies, with its KV blocks and, for
models whose layers keep per-slot state, its state rows."""

from __future__ import annotations

from strata.drafting.draft import Draft
from strata.kvcache.block_pool import BlockPool, BlockTable, RowPool
from strata.kvcache.prefix import ROOT, block_key
from strata.request import Request


class Slot:
    def __init__(self, index: int, pool: BlockPool, row_pool: RowPool, rows_per_slot: int = 0,
                 snapshots: bool = False):
        """`snapshots`: the slot keeps a copy of its state at its last block boundary
        (kvcache/snapshots.py), in one more row."""
        self.index = index
        self.block_table = BlockTable(pool)
        self.row_pool, self.rows_per_slot = row_pool, rows_per_slot
        self.snapshots = snapshots
        self.request: Request | None = None
        self.num_computed = 0  # tokens of the request whose KV is in the cache
        self.draft: Draft | None = None  # drafts carried by the slot's window in flight
        self.state_rows: list[int] = []  # rows of per-slot state, while it holds a request
        self.state_current: int | None = None  # the row holding its committed state
        self.keys: list[bytes] = []  # prefix-cache keys of its leading full committed
                                     # blocks: shared or registered, never written again
        self.snapshot_row: int | None = None  # its state at its last block boundary...
        self.snapshot_at = 0                  # ...this one (0: none yet)
        self.keep_at = 0  # the last block boundary of the tokens known at admission

    @property
    def free(self) -> bool:
        return self.request is None

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model (the last known token included)."""
        return 0 if self.request is None else self.request.num_tokens - self.num_computed

    @property
    def num_drafted(self) -> int:
        return len(self.draft.tokens) if self.draft is not None else 0

    def assign(self, request: Request) -> None:
        self.request, self.num_computed = request, 0
        self.state_rows = self.row_pool.allocate(self.rows_per_slot)
        self.snapshot_row = self.row_pool.allocate(1)[0] if self.snapshots else None
        self.snapshot_at = 0
        self.state_current = self.state_rows[0] if self.state_rows else None

    def release(self) -> None:
        """Give back the blocks and the state rows (the snapshot row too, unless the
        scheduler took it: `take_snapshot`)."""
        self.block_table.clear()
        self.row_pool.release(self.state_rows)
        if self.snapshot_row is not None:
            self.row_pool.release([self.snapshot_row])
        self.request, self.num_computed, self.draft, self.state_rows = None, 0, None, []
        self.state_current = self.snapshot_row = None
        self.keys = []

    def take_snapshot(self) -> tuple[bytes, int] | None:
        """The key of the block its snapshot follows and the snapshot's row, which the
        slot no longer owns; None without a snapshot of a registered block."""
        if self.snapshot_row is None or not self.snapshot_at:
            return None
        index = self.snapshot_at // self.block_table.pool.block_size - 1
        if index >= len(self.keys):
            return None
        row, self.snapshot_row = self.snapshot_row, None
        return self.keys[index], row

    def reuse_prefix(self, hits: list[tuple[bytes, int | None]], replay: bool = False) -> None:
        """Take the cached blocks `hits` ((key, block) of the request's leading full
        blocks, BlockPool.cached_prefix: on the device, or None for those copied back
        from host RAM) and start computing after them; `replay`: from their last token,
        whose hidden state the MTP layer needs (its KV is not written again: the
        scheduler sends it to the padding row)."""
        pool = self.block_table.pool
        self.block_table.blocks = pool.take(hits)
        self.keys = [key for key, _ in hits]
        self.num_computed = max(0, len(hits) * pool.block_size - replay)
        if hits and pool.host is not None:
            pool.host.touch(self.keys[-1])

    def register_blocks(self) -> None:
        """Register the slot's blocks that are now full of committed tokens."""
        pool, request = self.block_table.pool, self.request
        size = pool.block_size
        for i in range(len(self.keys), min(self.num_computed, request.num_tokens) // size):
            key = block_key(self.keys[-1] if self.keys else ROOT,
                            request.token_ids[i * size:(i + 1) * size])
            pool.prefix.register(self.block_table.blocks[i], key)
            self.keys.append(key)

    def state_order(self, source: int) -> list[int]:
        """The slot's state rows for a window: `source` (the state its run starts from),
        then the others, where the run writes the state after its last known token and
        after each draft (layers/deltanet.py)."""
        return [source, *(row for row in self.state_rows if row != source)]
