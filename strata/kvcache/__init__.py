"""Paged KV cache: the BlockPool and BlockTables the scheduler owns, and the cache
tensors each stage holds for its own layers."""

from strata.kvcache.block_pool import BlockPool, BlockTable
from strata.kvcache.cache import KVCache

__all__ = ["BlockPool", "BlockTable", "KVCache"]
