"""Window buckets: the few shapes a stage's windows are padded to so that each shape can be
replayed from one captured CUDA graph.

A bucket fixes the number of tokens T; the number of entries (every slot plus one padding
entry) and the block-table width (a slot's most blocks) are fixed per stage. Padding is
harmless because every token carries its own position and cache row: the padding tokens
form one extra entry at position 0 that writes only the padding block (a cache block no
slot is ever given, `CacheSize.padding_block`) and no state row (a fresh entry of the
StateMeta), and their logits rows are never read.
Plain Python over host tensors: the CPU tests check it with the reference backend.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

from strata.attention.backend import AttentionBatch, BatchPadding
from strata.layers.state_meta import StateMeta
from strata.scheduler.window import WindowHeader


def bucket_sizes(max_tokens: int) -> list[int]:
    """Token counts a window is padded to, up to `max_tokens` (included): every count to 8,
    then four steps per doubling (10, 12, 14, 16, 20, ...): at most a quarter wasted."""
    sizes, size = [], 1
    while size < max_tokens:
        sizes.append(size)
        size += max(1, 2 ** (size.bit_length() - 3))
    sizes.append(max_tokens)
    return sizes


def pick_bucket(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `num_tokens`; None when the window is larger than all."""
    i = bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class WindowShape:
    """What a stage's buckets share: entries (slots + 1), block-table width, and the most
    logits rows a bucket computes (a large bucket carries prompt chunks, whose logits rows
    are few: one per sampling entry and its drafts)."""
    num_entries: int
    table_width: int
    padding_block: int
    max_logits: int = 256
    state: bool = False  # the stage has layers with per-slot state (StateMeta padded too)

    def logit_rows(self, tokens: int) -> int:
        """Logits rows of a bucket of `tokens` tokens."""
        return min(tokens, self.max_logits)

    def padding(self, tokens: int, block_size: int) -> BatchPadding:
        """How a window is padded to the bucket of `tokens` tokens."""
        return BatchPadding(tokens, self.num_entries, self.padding_block * block_size,
                            self.padding_block)


@dataclass(frozen=True)
class PaddedWindow:
    batch: AttentionBatch     # T tokens, `num_entries` entries, `table_width` blocks each
    token_ids: torch.Tensor   # [T]
    logits_idx: torch.Tensor  # [shape.logit_rows(T)]: the window's logits rows, then row 0
    num_tokens: int           # real tokens (the first rows of the outputs)
    num_logits: int           # real logits rows
    state: StateMeta | None = None  # T tokens, `num_entries` entries (shape.state)


def pad_window(header: WindowHeader, tokens: int, shape: WindowShape) -> PaddedWindow:
    """`header`'s window as `tokens` tokens and `shape.num_entries` entries."""
    real, entries = header.num_tokens, len(header.query_lens)
    logits_idx = header.logits_idx()
    rows = shape.logit_rows(tokens)
    if real > tokens or entries >= shape.num_entries or len(logits_idx) > rows:
        raise ValueError(f"a window of {real} tokens, {entries} entries and "
                         f"{len(logits_idx)} logits rows does not fit a bucket of {tokens} "
                         f"tokens, {shape.num_entries - 1} entries and {rows} rows")
    pad = tokens - real
    padding = shape.padding(tokens, header.block_size)
    tables = torch.full((shape.num_entries, shape.table_width), shape.padding_block,
                        dtype=torch.long)
    width = header.block_tables.shape[1]
    tables[:entries, :width] = header.block_tables
    batch = AttentionBatch(
        query_lens=padding.query_lens(header.query_lens),
        positions=_extend(header.positions, pad, 0),
        slot_mapping=_extend(header.slot_mapping, pad, padding.row),
        block_tables=tables,
        block_size=header.block_size)
    state = (StateMeta.build(header.query_lens, header.starts, header.num_drafts,
                             header.state_rows, tokens, shape.num_entries)
             if shape.state else None)
    return PaddedWindow(batch, _extend(header.token_ids, pad, 0),
                        _extend(logits_idx, rows - len(logits_idx), 0), real, len(logits_idx),
                        state)


def _extend(values: torch.Tensor, count: int, fill: int) -> torch.Tensor:
    return torch.cat([values, torch.full((count,), fill, dtype=values.dtype)])
