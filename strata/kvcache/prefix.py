"""PrefixCache: full KV blocks named by their tokens and everything before them, so that a
request whose prompt starts with a sequence the cache has seen (a live request's, or a
finished one's) reuses those blocks instead of computing them again.

A block is registered once every position in it is committed (its KV is final: windows
only ever write at or after a slot's committed length, so a registered block is never
written again, by its owner or by a sharer). Its key is a digest of the previous block's
key and its own tokens, so equal keys mean equal prefixes. Blocks are reference-counted
by the BlockPool; a registered block nobody holds stays cached, least recently used first
in line to be handed out again when the pool has no free block (and then forgotten).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence

ROOT = b""  # the key before the first block


def block_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block holding `tokens` after the blocks whose last key is `previous`."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return digest.digest()


def prompt_keys(token_ids: Sequence[int], block_size: int, count: int) -> Iterator[bytes]:
    """Keys of the first `count` full blocks of a sequence, computed as they are read (a
    lookup that stops at its first miss hashes no further)."""
    key = ROOT
    for i in range(count):
        key = block_key(key, token_ids[i * block_size:(i + 1) * block_size])
        yield key


class PrefixCache:
    """Which registered block holds which key; which of them nobody holds (LRU)."""

    def __init__(self):
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced

    def __len__(self) -> int:
        return len(self.key_of)

    def lookup(self, key: bytes) -> int | None:
        return self.block_of.get(key)

    def register(self, block: int, key: bytes) -> None:
        """`block` (held, full, committed) holds `key`; a key held elsewhere already keeps
        its block (this one then stays private and is freed as usual)."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key] = block
            self.key_of[block] = key

    def registered(self, block: int) -> bool:
        return block in self.key_of

    def held(self, block: int) -> None:
        """Someone holds the block again: it is not idle."""
        self.idle.pop(block, None)

    def dropped(self, block: int) -> None:
        """Nobody holds the registered block any more: it stays cached, most recent last."""
        self.idle[block] = None

    def evict(self) -> tuple[int, bytes]:
        """Forget the least recently used idle block; return it with the key it held."""
        block, _ = self.idle.popitem(last=False)
        key = self.key_of.pop(block)
        del self.block_of[key]
        return block, key
