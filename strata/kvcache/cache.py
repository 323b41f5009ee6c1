"""The cache tensors of one layer on its stage's device, allocated from the layer's spec;
HostBlocks: a stage's copies of KV blocks in host RAM (the conversation cache).

PagedKVCache rows are addressed flat (block * block_size + offset); SlotStateCache rows by
the row ids the scheduler gave each slot. Both are zero-initialised, so that a masked-out
row read during attention is a finite number. A row keeps what its previous slot left:
a layer with per-slot state starts a sequence afresh where its run begins at position 0.
"""

from __future__ import annotations

import torch

from strata.errors import StrataError
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
    a GPU): the conversation cache's bytes (kvcache/host.py decides which block goes
    where). `copy` runs a window's spills and restores without waiting for the device:
    blocks are moved whole (a block's rows are contiguous on both sides), every layer's
    keys and values in one transfer through a pinned staging tensor; a spill's bytes
    land in their host blocks once its copy is done (checked at each window's copies)
    or when a restore needs them (`_flush`)."""

    def __init__(self, caches: list[PagedKVCache], num_blocks: int, block_size: int):
        if len({c.key.shape[1:] for c in caches}) > 1:
            raise StrataError("the conversation cache needs attention layers of one shape "
                              "in a stage; leave --conversation-cache-mib at 0")
        self.caches, self.block_size = caches, block_size
        self.device = caches[0].key.device
        self.pin = self.device.type == "cuda"
        shape = (len(caches), 2, num_blocks, block_size, *caches[0].key.shape[1:])
        self.blocks = torch.zeros(shape, dtype=caches[0].key.dtype, pin_memory=self.pin)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, object]] = []  # spills in flight

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def _views(self) -> list[torch.Tensor]:
        """Each layer's keys, then values, as [blocks + padding, block_size, heads, dim]."""
        shape = (-1, self.block_size, *self.caches[0].key.shape[1:])
        return [t.view(shape) for c in self.caches for t in (c.key, c.value)]

    def copy(self, spills: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        """Device blocks to host blocks (spills), then host blocks to device blocks
        (restores), in every layer."""
        self._flush(wait=False)  # the spills already copied, so their staging goes back
        if spills:
            device_ids = self._on_device([d for d, _ in spills])
            gathered = torch.stack([v.index_select(0, device_ids) for v in self._views()])
            staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=self.pin)
            staged.copy_(gathered, non_blocking=True)
            done = None
            if self.pin:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
            self._pending.append((staged, torch.tensor([h for _, h in spills]), done))
        if restores:
            self._flush()
            host_ids = torch.tensor([h for h, _ in restores])
            flat = self.blocks.view(-1, *self.blocks.shape[2:])  # [layers * 2, blocks, ...]
            staged = torch.empty((flat.shape[0], len(restores), *flat.shape[2:]),
                                 dtype=flat.dtype, pin_memory=self.pin)
            torch.index_select(flat, 1, host_ids, out=staged)
            moved = staged.to(self.device, non_blocking=True)
            device_ids = self._on_device([d for _, d in restores])
            for view, blocks in zip(self._views(), moved):
                view.index_copy_(0, device_ids, blocks)

    def _on_device(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the stage's device, copied from pinned memory (a copy from pageable
        memory would wait for the device's work queued so far)."""
        return torch.tensor(ids, pin_memory=self.pin).to(self.device, non_blocking=True)

    def _flush(self, wait: bool = True) -> None:
        """Put the spills in flight into their host blocks, in order: all of them, waiting
        for their copies, or (`wait` False) those whose copies are done."""
        flat = self.blocks.view(-1, *self.blocks.shape[2:])
        while self._pending:
            staged, host_ids, done = self._pending[0]
            if done is not None:
                if not wait and not done.query():
                    return
                done.synchronize()
            flat.index_copy_(1, host_ids, staged)
            self._pending.pop(0)
