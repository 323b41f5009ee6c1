"""Cache specs: what state each layer keeps between windows (`Architecture.cache_spec`).

- PagedKVSpec: keys and values of every position, in the paged blocks of the scheduler's
  BlockPool (attention layers).
- SlotStateSpec: a fixed-size state per slot, in rows of the scheduler's RowPool
  (recurrent layers: a convolution window, a linear-attention state). A slot owns its rows
  from admission until it is freed: versions of its state, one of them current, the
  others written by each window for the positions the verifier may stop at (the
  scheduler's docstring says how drafts roll back).

The scheduler allocates blocks and rows for every layer at once (one block id and one row
id name the same place in every layer of every stage); each stage allocates the tensors of
its own layers from the specs (cache.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKVSpec:
    num_kv_heads: int
    head_dim: int  # the cache's dtype is the stage's --kv


@dataclass(frozen=True)
class SlotStateSpec:
    shapes: tuple[tuple[int, ...], ...]   # one tensor per shape, per row
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError(f"a slot state needs at least one tensor: {self}")


CacheSpec = PagedKVSpec | SlotStateSpec


@dataclass(frozen=True)
class CacheSize:
    """What every stage allocates for each of its layers: the scheduler's numbers."""
    num_blocks: int      # KV blocks (PagedKVSpec layers)
    block_size: int      # tokens per block
    num_state_rows: int  # rows of per-slot state (SlotStateSpec layers)
    blocks_per_slot: int = 0  # the most blocks one slot holds (0: up to num_blocks)
    host_blocks: int = 0      # blocks of the conversation cache in host RAM (kvcache/host.py)

    @property
    def padding_block(self) -> int:
        """A block past the pool's, allocated by every stage and never handed to a slot:
        the padding tokens of a window padded to a CUDA-graph bucket write there."""
        return self.num_blocks


def keeps_slot_state(specs: Iterable[CacheSpec]) -> bool:
    """Does some layer keep per-slot state (so slots need state rows)?"""
    return any(isinstance(s, SlotStateSpec) for s in specs)
