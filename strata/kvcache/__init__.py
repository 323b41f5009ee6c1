"""What layers keep between windows. The scheduler's side: BlockPool/BlockTable (paged KV
blocks) and RowPool (per-slot state rows); the stages' side: the cache tensors of each
layer, allocated from its CacheSpec."""

from strata.kvcache.block_pool import BlockPool, BlockTable, RowPool, cache_rows
from strata.kvcache.cache import PagedKVCache, SlotStateCache, allocate
from strata.kvcache.spec import (CacheSize, CacheSpec, PagedKVSpec, SlotStateSpec,
                                 keeps_slot_state)

__all__ = ["BlockPool", "BlockTable", "CacheSize", "CacheSpec", "PagedKVCache", "PagedKVSpec", "RowPool",
           "SlotStateCache", "SlotStateSpec", "allocate", "cache_rows", "keeps_slot_state"]
