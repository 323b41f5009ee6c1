"""The cache tensors of one layer on its stage's device, allocated from the layer's spec.

PagedKVCache rows are addressed flat (block * block_size + offset); SlotStateCache rows by
the row ids the scheduler gave each slot. Both are zero-initialised, so that a masked-out
row read during attention is a finite number. A row keeps what its previous slot left:
a layer with per-slot state starts a sequence afresh where its run begins at position 0.
"""

from __future__ import annotations

import torch

from strata.kvcache.spec import CacheSize, CacheSpec, PagedKVSpec, SlotStateSpec


class PagedKVCache:
    def __init__(self, spec: PagedKVSpec, num_rows: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (num_rows, spec.num_kv_heads, spec.head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)    # [rows, Hkv, D]
        self.value = torch.zeros(shape, dtype=dtype, device=device)


class SlotStateCache:
    def __init__(self, spec: SlotStateSpec, num_rows: int, device: torch.device | str):
        self.tensors = [torch.zeros((num_rows, *shape), dtype=spec.dtype, device=device)
                        for shape in spec.shapes]                    # [rows, *shape] each


Cache = PagedKVCache | SlotStateCache


def allocate(spec: CacheSpec, size: CacheSize, kv_dtype: torch.dtype,
             device: torch.device | str) -> Cache:
    """One layer's cache: `size.num_blocks` blocks of KV and the padding block, or
    `size.num_state_rows` rows of state."""
    if isinstance(spec, PagedKVSpec):
        return PagedKVCache(spec, (size.num_blocks + 1) * size.block_size, kv_dtype, device)
    if isinstance(spec, SlotStateSpec):
        return SlotStateCache(spec, size.num_state_rows, device)
    raise TypeError(f"unknown cache spec {spec!r}")
