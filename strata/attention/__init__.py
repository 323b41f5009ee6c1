"""Attention backends: how a stage's attention layers read and write the paged KV cache.

A backend builds its metadata once per window per stage from an AttentionBatch (the
window's positions, cache rows and block tables) and then serves every attention layer of
that stage: `forward(q, k, v, cache, meta)` writes the window's keys and values into their
rows and attends. `reference` (gather-then-SDPA, plain PyTorch) is the ground truth of
the tests; `triton` (a paged kernel from the block cache, for CUDA and CUDA graphs)
registers beside it without importing triton until it is chosen.
"""

from strata.attention import reference, triton_paged  # noqa: F401  (register themselves)
from strata.attention.backend import (AttentionBackend, AttentionBatch, backend_names,
                                      get_backend, register_backend)

__all__ = ["AttentionBackend", "AttentionBatch", "backend_names", "get_backend",
           "register_backend"]
