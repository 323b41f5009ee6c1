"""HostCache: the conversation cache's bookkeeping — which prefix-cache keys have a copy
of their KV block in host RAM, and which conversations those copies are kept for.

Finished (and preempted) requests are remembered as conversations: the keys of their full
committed blocks, least recently used first, at most `max_conversations`. A device block
the prefix cache evicts (kvcache/prefix.py) is copied to a host block when a remembered
conversation holds its key and a host block is free or can be freed (by forgetting the
least recently used conversations); a request whose prompt continues a remembered
conversation gets such blocks back by a copy into fresh device blocks instead of
computing them. A conversation that grows (its next turn) replaces the one it continues.

Owned by the scheduler's BlockPool, like the prefix cache. The copies themselves are done
by every stage, in window order (WindowHeader.spills and restores, stage.py), so a host
block read by a restore not yet run is never handed out again before the window carrying
that restore has been built (`pinned` until `settle`).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count


class HostCache:
    def __init__(self, num_blocks: int, max_conversations: int):
        if num_blocks < 1 or max_conversations < 1:
            raise ValueError(f"a host cache of {num_blocks} blocks for {max_conversations} "
                             "conversations")
        self.num_blocks, self.max_conversations = num_blocks, max_conversations
        self._free = list(range(num_blocks - 1, -1, -1))
        self.block_of: dict[bytes, int] = {}   # key -> its host block
        self.holders: dict[bytes, set[int]] = {}  # key -> conversations holding it
        self.conversations: OrderedDict[int, list[bytes]] = OrderedDict()  # LRU first
        self._last_key: dict[bytes, int] = {}  # a conversation's last key -> the conversation
        self._ids = count()
        self.pinned: set[int] = set()    # read by a restore not run yet
        self._deferred: list[int] = []   # forgotten while pinned: free after settle()
        self.restored_blocks = 0         # blocks brought back (all requests)

    def __len__(self) -> int:
        return len(self.block_of)

    def lookup(self, key: bytes) -> int | None:
        return self.block_of.get(key)

    def remember(self, keys: list[bytes]) -> None:
        """A request's full committed blocks' keys, in order: its conversation, most
        recently used now; the conversation it continues (whose last key it holds) is
        forgotten, and the least recently used beyond `max_conversations`."""
        if not keys:
            return
        for key in keys:
            continued = self._last_key.get(key)
            if continued is not None:
                self._forget(continued)
        conversation = next(self._ids)
        self.conversations[conversation] = list(keys)
        self._last_key[keys[-1]] = conversation
        for key in keys:
            self.holders.setdefault(key, set()).add(conversation)
        while len(self.conversations) > self.max_conversations:
            self._forget(next(iter(self.conversations)))

    def touch(self, key: bytes) -> None:
        """A request reused the blocks up to `key`: the conversations holding it are used
        most recently."""
        for conversation in self.holders.get(key, ()):
            self.conversations.move_to_end(conversation)

    def spill(self, key: bytes) -> int | None:
        """The host block to copy an evicted device block of `key` into, or None: no
        conversation wants it, it is there already, or no block can be freed for it."""
        if key in self.block_of or key not in self.holders:
            return None
        while not self._free:
            oldest = next(iter(self.conversations))
            if oldest in self.holders[key]:
                return None  # room only by forgetting its own conversation
            self._forget(oldest)
        block = self._free.pop()
        self.block_of[key] = block
        return block

    def restore(self, key: bytes) -> int:
        """The host block of `key`, pinned until the window carrying its copy is built."""
        block = self.block_of[key]
        self.pinned.add(block)
        self.restored_blocks += 1
        return block

    def settle(self) -> None:
        """The pending copies are in a window now: pinned blocks may be handed out again."""
        self.pinned.clear()
        self._free.extend(self._deferred)
        self._deferred = []

    def _forget(self, conversation: int) -> None:
        keys = self.conversations.pop(conversation)
        if self._last_key.get(keys[-1]) == conversation:
            del self._last_key[keys[-1]]
        for key in keys:
            holders = self.holders[key]
            holders.discard(conversation)
            if holders:
                continue
            del self.holders[key]
            block = self.block_of.pop(key, None)
            if block is not None:
                (self._deferred if block in self.pinned else self._free).append(block)
