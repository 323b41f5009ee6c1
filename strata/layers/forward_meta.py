"""ForwardMeta: everything a forward pass needs to know about one window, on one device.

Built by the stage once per window (not per layer) and passed explicitly to every layer.
Every token carries its own position and KV-cache row (inside the attention backend's
metadata), so a window may overwrite any earlier position of its slot: that is how
rejected drafts are undone. Layers keep nothing between windows except their cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from strata.attention.backend import AttentionBackend, AttentionBatch


@dataclass(frozen=True)
class ForwardMeta:
    positions: torch.Tensor         # [T] position of each token in its slot's sequence
    logits_idx: torch.Tensor        # [S] rows of the window whose logits are wanted
    query_lens: tuple[int, ...]     # tokens of each entry, contiguous in the window (layers
                                    # with per-slot state; not refreshed by graph replays)
    backend: AttentionBackend       # serves every attention layer of the stage...
    attention: Any                  # ...with this metadata, built once for the window
    state_rows: torch.Tensor | None = None  # [B, rows per slot] each entry's state rows:
                                            # the state before its run, then where the
                                            # states after its last known token and each
                                            # draft go (layers/deltanet.py)
    num_drafts: tuple[int, ...] = ()        # drafts each entry carries (state layers)
    starts: tuple[int, ...] = ()            # each entry's first position (state layers:
                                            # 0 is a fresh sequence), known on the host

    @classmethod
    def build(cls, batch: AttentionBatch, backend: AttentionBackend, device: torch.device,
              logits_idx: torch.Tensor, state_rows: torch.Tensor | None = None,
              num_drafts: tuple[int, ...] = (), starts: tuple[int, ...] = ()) -> ForwardMeta:
        move = dict(device=device, non_blocking=True)
        return cls(positions=batch.positions.to(**move), logits_idx=logits_idx.to(**move),
                   query_lens=tuple(batch.query_lens), backend=backend,
                   attention=backend.prepare(batch, device),
                   state_rows=None if state_rows is None else state_rows.to(**move),
                   num_drafts=tuple(num_drafts), starts=tuple(starts))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache,
               scale: float | None = None) -> torch.Tensor:
        """The backend's attention over `cache` (a PagedKVCache): writes k, v, attends."""
        return self.backend.forward(q, k, v, cache, self.attention, scale)
