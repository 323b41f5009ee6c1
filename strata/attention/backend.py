"""The AttentionBackend interface, the AttentionBatch it is prepared from (and how a batch is
padded to a CUDA-graph bucket: BatchPadding), the registry of backends by name
(`--attention-backend`)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from strata.errors import StrataError
from strata.kvcache.cache import PagedKVCache


@dataclass(frozen=True)
class AttentionBatch:
    """One forward's attention layout, on the host. Entry b's `query_lens[b]` tokens are
    contiguous; each token has its own position and the flat cache row it writes; entry
    b's positions 0..p live in the rows its block table names."""
    query_lens: list[int]
    positions: torch.Tensor     # [T]
    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [B, max blocks]
    block_size: int


@dataclass(frozen=True)
class BatchPadding:
    """A batch padded to `tokens` tokens and `entries` entries (a CUDA-graph bucket,
    stage/buckets.py). The extra tokens form one more entry, at position 0, writing cache
    row `row` (in a block no slot is ever given); the extra entries are empty, and every
    block-table cell past an entry's own blocks names `block`."""
    tokens: int
    entries: int
    row: int
    block: int

    def query_lens(self, query_lens: list[int]) -> list[int]:
        extra = self.entries - len(query_lens) - 1
        if extra < 0 or sum(query_lens) > self.tokens:
            raise ValueError(f"{sum(query_lens)} tokens in {len(query_lens)} entries do not "
                             f"fit {self.tokens} tokens and {self.entries - 1} entries")
        return [*query_lens, self.tokens - sum(query_lens)] + [0] * extra


def write_padded(into: np.ndarray, values: np.ndarray | list[int], fill: int) -> None:
    """`values` into the first rows of `into` (a staging buffer's host array), `fill` after."""
    n = len(values)
    into[:n] = values
    into[n:] = fill


class AttentionBackend(Protocol):
    name: str

    def prepare(self, batch: AttentionBatch, device: torch.device) -> Any:
        """This backend's metadata for one forward on `device`: built once per window per
        stage, then passed to every attention layer's `forward`."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache, meta: Any, scale: float | None = None,
                written: bool = False) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] -> [T, H, D]. Writes k and v into the window's
        cache rows (unless `written`: only a backend with `rows(meta)`, the rows [T] a
        kernel before it may write them to, is told so), then each token attends to its
        own entry's keys at positions up to its own. `scale` multiplies q·k (default
        1/sqrt(D))."""

    # A backend that CUDA graphs capture (`capturable = True`) also has
    # `prepare_host(batch)`: the metadata on the host (a bucket's shapes, from a padded
    # batch), and `write_host(into, batch, padding)`: the same values of `batch` padded by
    # `padding`, written into `into` (metadata whose tensor fields are numpy arrays: a
    # staging buffer's host side), without building a padded batch first.


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, make: Callable[[], AttentionBackend]) -> None:
    _BACKENDS[name] = make


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto`: triton on a CUDA device where the triton package is installed, else
    reference. Any other name is itself."""
    if name != "auto":
        return name
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "reference"


def get_backend(name: str, device: torch.device | None = None) -> AttentionBackend:
    """The backend `name` (`auto` resolved for `device`)."""
    name = resolve_backend(name, device or torch.device("cpu"))
    if name not in _BACKENDS:
        raise StrataError(f"--attention-backend {name} does not exist; "
                          f"available: {', '.join(backend_names())}")
    return _BACKENDS[name]()
