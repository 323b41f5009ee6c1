"""StateSnapshots: per-slot state (a recurrent layer's, kvcache/spec.py SlotStateSpec) at a
block boundary of a finished request, kept so that a later prompt that starts with the
same blocks can reuse them: the prefix cache gives the KV blocks, a snapshot the state
after the last of them.

A slot copies its state into its own snapshot row each time its committed tokens cross a
block boundary (the scheduler; the copy runs on every stage before the next window). When
its request finishes, that row (the state after the boundary's block, whose prefix-cache
key names it) moves here; at most `capacity` are kept, least recently used given back
first. Owned by the scheduler, like the block pool.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.row_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self.row_of)

    def get(self, key: bytes) -> int | None:
        """The row holding the state after the block of `key` (used most recently now)."""
        row = self.row_of.get(key)
        if row is not None:
            self.row_of.move_to_end(key)
        return row

    def put(self, key: bytes, row: int) -> list[int]:
        """Keep `row` as the state after the block of `key`; returns the rows no longer
        kept (an older snapshot of the same key, the least recently used beyond capacity)."""
        released = []
        old = self.row_of.pop(key, None)
        if old is not None:
            released.append(old)
        self.row_of[key] = row
        while len(self.row_of) > self.capacity:
            released.append(self.row_of.popitem(last=False)[1])
        return released
