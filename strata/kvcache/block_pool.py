"""BlockPool and BlockTable: which KV blocks belong to which slot (shared through the
prefix cache, prefix.py, and reference-counted); RowPool: which per-slot state rows;
`cache_rows`: where a position lives through a block table.

Owned by the scheduler alone. Every stage holds caches with the same number of blocks
and rows, so one block id (or row id) names the same place in every stage's layers.
"""

from __future__ import annotations

import torch

from strata.errors import StrataError
from strata.kvcache.host import HostCache
from strata.kvcache.prefix import PrefixCache, prompt_keys


def cache_rows(block_table: torch.Tensor, positions: torch.Tensor,
               block_size: int) -> torch.Tensor:
    """Flat cache rows (block * block_size + offset) of `positions` [P] through
    `block_table` [..., max blocks]: [..., P]. BlockTable.rows computes the same rows on
    the host, block by block (tests/test_scheduler.py checks that they agree)."""
    return block_table[..., positions // block_size] * block_size + positions % block_size


class RowPool:
    """Ids 0..size-1 handed out and taken back; low ids first."""

    def __init__(self, size: int, what: str = "state rows"):
        self.size, self.what = size, what
        self._free = list(range(size - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"{self.what} exhausted: {count} wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


class BlockPool(RowPool):
    """KV blocks, reference-counted: a block shared through the prefix cache is held by
    every slot that reads it, and goes back to the pool (or stays cached, if registered)
    when the last one lets go. With a host cache (host.py), a cached block handed out
    again is first copied to host RAM if a remembered conversation holds it, and a prompt
    may continue with blocks copied back from there: the copies wait in `spills` and
    `restores` for the next window (`take_moves`)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False,
                 host: HostCache | None = None):
        if num_blocks < 1 or block_size < 1:
            raise StrataError(f"the KV cache needs at least one block of one token "
                              f"(got {num_blocks} blocks of {block_size})")
        super().__init__(num_blocks, "block pool")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.prefix = PrefixCache() if prefix_cache else None
        self.host = host if prefix_cache else None
        self.spills: list[tuple[int, int]] = []    # (device block, host block) to copy
        self.restores: list[tuple[int, int]] = []  # (host block, device block) to copy

    @property
    def num_free(self) -> int:
        """Blocks a slot can get: free ones and cached ones nobody holds."""
        return len(self._free) + (len(self.prefix.idle) if self.prefix is not None else 0)

    @property
    def num_cached(self) -> int:
        return len(self.prefix) if self.prefix is not None else 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def cached_prefix(self, token_ids: list[int], count: int) -> list[tuple[bytes, int | None]]:
        """(key, block) of the leading full blocks of `token_ids` that the prefix cache
        holds, at most `count` (none without a prefix cache); block None: the block is in
        the host cache, not on the device."""
        hits = []
        if self.prefix is not None:
            for key in prompt_keys(token_ids, self.block_size, count):
                block = self.prefix.lookup(key)
                if block is None and (self.host is None or self.host.lookup(key) is None):
                    break
                hits.append((key, block))
        return hits

    def num_idle(self, blocks: list[int | None]) -> int:
        """How many of `blocks` are cached and held by none (holding them takes them out
        of num_free)."""
        if self.prefix is None:
            return 0
        return sum(block in self.prefix.idle for block in blocks)

    def take(self, hits: list[tuple[bytes, int | None]]) -> list[int]:
        """The device blocks of `hits` (cached_prefix), held: those on the device shared,
        those in host RAM copied back into new blocks (registered under their keys)."""
        self.hold([block for _, block in hits if block is not None])
        # Their host blocks first (pinned): a device block handed out below may be copied
        # out to host RAM, which may forget the conversations holding them.
        spots = {key: self.host.restore(key) for key, block in hits if block is None}
        blocks = []
        for key, block in hits:
            if block is None:
                block = self.allocate(1)[0]
                self.restores.append((spots[key], block))
                self.prefix.register(block, key)
            blocks.append(block)
        return blocks

    def take_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies waiting for a window (spills first, then restores, on every stage)."""
        moves, self.spills, self.restores = (self.spills, self.restores), [], []
        if self.host is not None:
            self.host.settle()
        return moves

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError(f"block pool exhausted: {count} wanted, {self.num_free} free")
        out = []
        for _ in range(count):
            block = self._free.pop() if self._free else self._evict()
            self.refs[block] = 1
            out.append(block)
        return out

    def _evict(self) -> int:
        """The least recently used cached block nobody holds, copied to host RAM first
        where a remembered conversation wants it."""
        block, key = self.prefix.evict()
        if self.host is not None and (spot := self.host.spill(key)) is not None:
            self.spills.append((block, spot))
        return block

    def hold(self, blocks: list[int]) -> None:
        """Share cached blocks: one more holder each."""
        for block in blocks:
            self.refs[block] += 1
            self.prefix.held(block)

    def release(self, ids: list[int]) -> None:
        for block in reversed(ids):
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            if self.prefix is not None and self.prefix.registered(block):
                self.prefix.dropped(block)
            else:
                self._free.append(block)


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

    def rows(self, start: int, end: int) -> list[int]:
        """Cache rows of positions start..end-1 (`cache_rows`' formula, block by block on
        the host: the scheduler builds a window's rows this way in microseconds)."""
        size, out, position = self.pool.block_size, [], start
        while position < end:
            block, offset = divmod(position, size)
            run = min(end - position, size - offset)
            first = self.blocks[block] * size + offset
            out.extend(range(first, first + run))
            position += run
        return out

    def clear(self) -> None:
        self.pool.release(self.blocks)
        self.blocks = []
