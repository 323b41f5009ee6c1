"""StagingBuffer: a window's small metadata tensors moved to the device in one copy.

A graphed window's metadata (positions, KV rows, block tables, attention tiles, state rows,
the first stage's token ids) is a handful of small tensors. Copied one by one from
pageable host memory, each is a synchronous staging copy of ~10-20 us of host time on a
GPU: most of a window's preparation. Here every such tensor of a bucket is a view into one
device block of bytes (the views are what its CUDA graph captured); a window's values are
written into the same layout in pinned host memory and the block moves in one asynchronous
copy, in stream order behind the windows already queued. The host side is numpy arrays over
that memory: a graph runner writes a window's lists and tensors straight into them
(`claim`, then `send`), about a microsecond a field where a torch op costs several.

The pinned blocks form a ring: a block is written again only once its copy has run (an
event per block), so preparing a window while earlier ones are still queued never changes
what they read. On the CPU (the tests) the same layout, ring and copy run without pinning
(each copy done before `send` returns).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

import numpy as np
import torch

from strata.errors import StrataError

ALIGN = 16  # bytes: every view starts aligned for any dtype
RING = 4    # pinned blocks per buffer: more than the windows a stage has queued at once


class StagingBuffer:
    def __init__(self, templates: list[torch.Tensor], device: torch.device, ring: int = RING):
        """`templates`: the tensors to hold (their shapes and dtypes; values copied in)."""
        self.offsets, size = [], 0
        for t in templates:
            size = -(-size // ALIGN) * ALIGN
            self.offsets.append(size)
            size += t.numel() * t.element_size()
        self.device = torch.device(device)
        self.block = torch.zeros(max(size, 1), dtype=torch.uint8, device=self.device)
        self.views = [_view(self.block, o, t) for o, t in zip(self.offsets, templates)]
        pinned = self.device.type == "cuda"
        self._hosts = [torch.zeros(self.block.shape, dtype=torch.uint8, pin_memory=pinned)
                       for _ in range(ring)]
        # numpy arrays over each pinned block: what a window's values are written into
        self.hosts = [[_view(h, o, t).numpy() for o, t in zip(self.offsets, templates)]
                      for h in self._hosts]
        self._copied = [torch.cuda.Event() if pinned else None for _ in self._hosts]
        self._next = 0
        self.fill(templates)

    def claim(self) -> int:
        """The ring slot the next window is written into (`hosts[slot]`), once its last
        copy has run (long since, as a rule); `send(slot)` then moves it."""
        slot = self._next
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()
        return slot

    def send(self, slot: int) -> None:
        """Queue the copy of `hosts[slot]` into the device views on the current stream."""
        self._next = (slot + 1) % len(self._hosts)
        self.block.copy_(self._hosts[slot], non_blocking=True)
        copied = self._copied[slot]
        if copied is not None:  # on the stream that copies (the block's device's)
            copied.record(torch.cuda.current_stream(self.device))

    def fill(self, values: list[torch.Tensor]) -> None:
        """Copy `values` (host tensors, one per template, same shapes and dtypes) into the
        device views, with one host-to-device copy."""
        if len(values) != len(self.views):
            raise StrataError(f"staging: {len(values)} tensors for {len(self.views)} views")
        for i, (view, value) in enumerate(zip(self.views, values)):
            if value.shape != view.shape or value.dtype != view.dtype:
                raise StrataError(f"staging: tensor {i} is {tuple(value.shape)} {value.dtype}, "
                                  f"its view {tuple(view.shape)} {view.dtype} (pad the window "
                                  f"to its bucket's shape)")
        slot = self.claim()
        for host, value in zip(self.hosts[slot], values):
            host[...] = value.numpy()
        self.send(slot)


def _view(block: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    size = like.numel() * like.element_size()
    return block[offset:offset + size].view(like.dtype).view(like.shape)


def tensor_fields(meta: Any) -> list[Any]:
    """The tensor fields of a metadata dataclass (torch tensors or, on a staging buffer's
    host side, numpy arrays), in field order."""
    return [value for f in fields(meta)
            if isinstance(value := getattr(meta, f.name), torch.Tensor | np.ndarray)]


def with_views(meta: Any, views: Iterator[torch.Tensor]) -> Any:
    """`meta` (a frozen dataclass) with each tensor field replaced by the next of `views`,
    in field order: how a bucket's static metadata comes to live in a StagingBuffer."""
    return replace(meta, **{f.name: next(views) for f in fields(meta)
                            if isinstance(getattr(meta, f.name), torch.Tensor)})
