"""BlockPool and BlockTable: which cache blocks belong to which slot.

Owned by the scheduler alone. Every stage holds a cache with the same number of blocks,
so one block id names the same rows in every stage's layers.
"""

from __future__ import annotations

import torch

from strata.errors import StrataError


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise StrataError(f"the KV cache needs at least one block of one token "
                              f"(got {num_blocks} blocks of {block_size})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"block pool exhausted: {count} wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class BlockTable:
    """The blocks of one slot, in position order: position p lives in row
    blocks[p // block_size] * block_size + p % block_size."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []

    def ensure(self, num_positions: int) -> None:
        """Grow so that positions 0..num_positions-1 have rows."""
        needed = -(-num_positions // self.pool.block_size) - len(self.blocks)
        if needed > 0:
            self.blocks.extend(self.pool.allocate(needed))

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Cache rows of positions start..end-1, as a [end - start] tensor."""
        size = self.pool.block_size
        positions = torch.arange(start, end)
        return torch.tensor(self.blocks)[positions // size] * size + positions % size

    def clear(self) -> None:
        self.pool.release(self.blocks)
        self.blocks = []
