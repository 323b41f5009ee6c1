"""The cache tensors of one layer on its stage's device, allocated from the layer's spec;
HostBlocks: a stage's copies of KV blocks in host RAM (the conversation cache).

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


class HostBlocks:
    """Host-RAM blocks for every paged-KV layer of one stage (pinned when the stage is on
    a GPU, so copies run at PCIe speed): the conversation cache's bytes (kvcache/host.py
    decides which block goes where). `copy` runs a window's spills and restores."""

    def __init__(self, caches: list[PagedKVCache], num_blocks: int, block_size: int):
        self.caches, self.block_size = caches, block_size
        pin = any(c.key.device.type == "cuda" for c in caches)
        self.key = [torch.zeros((num_blocks * block_size, *c.key.shape[1:]), dtype=c.key.dtype,
                                pin_memory=pin) for c in caches]
        self.value = [torch.zeros_like(k, pin_memory=pin) for k in self.key]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.key, self.value))

    def _rows(self, blocks: list[int]) -> torch.Tensor:
        offsets = torch.arange(self.block_size)
        return (torch.tensor(blocks)[:, None] * self.block_size + offsets).flatten()

    def copy(self, spills: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        """Device blocks to host blocks (spills), then host blocks to device blocks
        (restores), in every layer."""
        for pairs, out in ((spills, True), (restores, False)):
            if not pairs:
                continue
            sources, targets = zip(*pairs)
            src, dst = self._rows(list(sources)), self._rows(list(targets))
            for cache, host_key, host_value in zip(self.caches, self.key, self.value):
                device = cache.key.device
                if out:
                    rows = src.to(device)
                    host_key[dst] = cache.key[rows].cpu()
                    host_value[dst] = cache.value[rows].cpu()
                else:
                    rows = dst.to(device)
                    cache.key[rows] = host_key[src].to(device, non_blocking=True)
                    cache.value[rows] = host_value[src].to(device, non_blocking=True)
