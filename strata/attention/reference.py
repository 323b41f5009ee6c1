"""The reference attention backend: gather each entry's whole context through its block
table and attend with an explicit position mask (torch SDPA). Plain PyTorch on any
device, and the ground truth that every other backend is tested against.

Its metadata pads the window to [entries, longest run] queries and [entries, keys up to
the largest position] keys, so its shapes depend on the window's data: fine for the CPU
and for tests, not for CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.attention.backend import AttentionBatch, register_backend
from strata.kvcache.block_pool import cache_rows
from strata.kvcache.cache import PagedKVCache


@dataclass(frozen=True)
class ReferenceMeta:
    slot_mapping: torch.Tensor  # [T] flat KV-cache row each token writes
    q_batch: torch.Tensor       # [T] which window entry (0..B-1) each token belongs to
    q_offset: torch.Tensor      # [T] index of each token inside its entry's run
    kv_gather: torch.Tensor     # [B, Lk] flat KV-cache row of each key position 0..Lk-1
    attn_mask: torch.Tensor     # [B, 1, Lq, Lk] True where query i may attend key j
    num_entries: int            # B
    max_query: int              # Lq


class ReferenceBackend:
    name = "reference"

    def prepare(self, batch: AttentionBatch, device: torch.device) -> ReferenceMeta:
        """Vectorised over tokens."""
        num_entries, positions = len(batch.query_lens), batch.positions
        lens = torch.tensor(batch.query_lens, dtype=torch.long)
        q_batch = torch.repeat_interleave(torch.arange(num_entries), lens)   # [T]
        starts = torch.cumsum(lens, 0) - lens
        q_offset = torch.arange(len(positions)) - starts[q_batch]             # [T]
        max_query = int(lens.max())
        # Keys: every position up to the largest one queried, rounded to whole blocks.
        size = batch.block_size
        num_blocks = (int(positions.max()) + size) // size
        key_pos = torch.arange(num_blocks * size)                              # [Lk]
        kv_gather = cache_rows(batch.block_tables[:, :num_blocks], key_pos, size)  # [B, Lk]
        # Padding queries get position 0 so that no row of the mask is empty (no NaN).
        q_pos = torch.zeros(num_entries, max_query, dtype=torch.long)
        q_pos[q_batch, q_offset] = positions
        attn_mask = (key_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [B, 1, Lq, Lk]
        move = dict(device=device, non_blocking=True)
        return ReferenceMeta(batch.slot_mapping.to(**move), q_batch.to(**move),
                             q_offset.to(**move), kv_gather.to(**move), attn_mask.to(**move),
                             num_entries, max_query)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache, meta: ReferenceMeta,
                scale: float | None = None, written: bool = False) -> torch.Tensor:
        assert not written, "the reference backend writes its cache itself"
        cache.key[meta.slot_mapping] = k.to(cache.key.dtype)
        cache.value[meta.slot_mapping] = v.to(cache.value.dtype)
        heads, dim = q.shape[1], q.shape[2]
        q_pad = q.new_zeros(meta.num_entries, meta.max_query, heads, dim)
        q_pad[meta.q_batch, meta.q_offset] = q
        keys = cache.key[meta.kv_gather].to(q.dtype)                # [B, Lk, Hkv, D]
        values = cache.value[meta.kv_gather].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=meta.attn_mask, scale=scale, enable_gqa=True)  # [B, H, Lq, D]
        return out.transpose(1, 2)[meta.q_batch, meta.q_offset]


register_backend(ReferenceBackend.name, ReferenceBackend)
