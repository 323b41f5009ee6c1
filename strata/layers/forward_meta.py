"""ForwardMeta: everything a forward pass needs to know about one window, on one device.

Built once per window per device (not per layer) from the scheduler's Window, and
passed explicitly to every layer. Every token carries its own position and KV-cache
slot, so a window may overwrite any earlier position of its slot: that is how
rejected drafts are undone. No layer keeps state between windows except the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardMeta:
    positions: torch.Tensor     # [T] position of each token in its slot's sequence
    slot_mapping: torch.Tensor  # [T] flat KV-cache row each token writes
    q_batch: torch.Tensor       # [T] which window entry (0..B-1) each token belongs to
    q_offset: torch.Tensor      # [T] index of each token inside its entry's run
    kv_gather: torch.Tensor     # [B, Lk] flat KV-cache row of each key position 0..Lk-1
    attn_mask: torch.Tensor     # [B, 1, Lq, Lk] True where query i may attend key j
    logits_idx: torch.Tensor    # [S] rows of the window whose logits are wanted
    num_entries: int            # B
    max_query: int              # Lq

    @classmethod
    def build(cls, *, query_lens: list[int], positions: torch.Tensor, slot_mapping: torch.Tensor,
              block_tables: torch.Tensor, block_size: int, logits_idx: torch.Tensor,
              device: torch.device | str) -> ForwardMeta:
        """Vectorised over tokens; `query_lens[b]` tokens of entry b are contiguous in the
        window and `block_tables[b]` maps entry b's positions to cache blocks."""
        num_entries = len(query_lens)
        lens = torch.tensor(query_lens, dtype=torch.long)
        q_batch = torch.repeat_interleave(torch.arange(num_entries), lens)   # [T]
        starts = torch.cumsum(lens, 0) - lens
        q_offset = torch.arange(len(positions)) - starts[q_batch]             # [T]
        max_query = int(lens.max())
        # Keys: every position up to the largest one queried, rounded to whole blocks.
        max_pos = int(positions.max()) + 1
        num_blocks = (max_pos + block_size - 1) // block_size
        key_pos = torch.arange(num_blocks * block_size)                        # [Lk]
        tables = block_tables[:, :num_blocks]
        kv_gather = (tables.repeat_interleave(block_size, dim=1) * block_size
                     + (key_pos % block_size)[None, :])                        # [B, Lk]
        # Padding queries get position 0 so that no row of the mask is empty (no NaN).
        q_pos = torch.zeros(num_entries, max_query, dtype=torch.long)
        q_pos[q_batch, q_offset] = positions
        attn_mask = (key_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [B, 1, Lq, Lk]
        move = dict(device=device, non_blocking=True)
        return cls(positions=positions.to(**move), slot_mapping=slot_mapping.to(**move),
                   q_batch=q_batch.to(**move), q_offset=q_offset.to(**move),
                   kv_gather=kv_gather.to(**move), attn_mask=attn_mask.to(**move),
                   logits_idx=logits_idx.to(**move), num_entries=num_entries,
                   max_query=max_query)
