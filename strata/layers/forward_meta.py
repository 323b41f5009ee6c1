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
from strata.layers.state_meta import StateMeta


@dataclass(frozen=True)
class ForwardMeta:
    positions: torch.Tensor         # [T] position of each token in its slot's sequence
    logits_idx: torch.Tensor        # [S] rows of the window whose logits are wanted
    backend: AttentionBackend       # serves every attention layer of the stage...
    attention: Any                  # ...with this metadata, built once for the window
    state: StateMeta | None = None  # where layers with per-slot state read and write
                                    # their rows (layers/state_meta.py)

    @classmethod
    def build(cls, batch: AttentionBatch, backend: AttentionBackend, device: torch.device,
              logits_idx: torch.Tensor, state: StateMeta | None = None) -> ForwardMeta:
        """`state`: on the host, moved with the rest."""
        move = dict(device=device, non_blocking=True)
        return cls(positions=batch.positions.to(**move), logits_idx=logits_idx.to(**move),
                   backend=backend,
                   attention=backend.prepare(batch, device),
                   state=None if state is None else state.to(device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache,
               scale: float | None = None, written: bool = False) -> torch.Tensor:
        """The backend's attention over `cache` (a PagedKVCache): writes k, v (unless
        `written`: a kernel before it did, into `kv_write`'s rows), attends."""
        if written:  # only a backend with `rows` is told (others keep the plain signature)
            return self.backend.forward(q, k, v, cache, self.attention, scale, written=True)
        return self.backend.forward(q, k, v, cache, self.attention, scale)

    def kv_write(self, v: torch.Tensor, cache) -> tuple | None:
        """(v, the cache's key and value tensors, the window's cache rows) for a kernel
        that writes keys and values on its way (the rotation's), where the backend lets
        its write be done so; else None."""
        rows = getattr(self.backend, "rows", None)
        return None if rows is None else (v, cache.key, cache.value, rows(self.attention))
