"""The `triton` attention backend: paged attention on CUDA, straight from the block cache.

`forward` writes the window's keys and values to their cache rows (one small kernel), then
one Triton kernel (triton_kernel.py) attends: each query tile reads only its own entry's
keys, up to its largest position, through the entry's block table. Cost grows with each
entry's own context; nothing is gathered or padded to the window's longest context.

Metadata contract (for CUDA graphs): `prepare` returns a frozen TritonMeta whose tensor
fields have shapes set only by the window's token count T, entry count B and block-table
width W — never by positions or lengths — and whose one plain field (`block_size`) is the
engine's setting. So a graph runner can pad windows to a few (T, B, W) buckets, capture
`forward` once per bucket over a static TritonMeta, and replay after copying a new
window's metadata into its tensors (stage/staging.py): `write_host` writes a window's
values, padded to the bucket, straight into the staging buffer's host arrays. Padding is
harmless when dummy tokens have position 0 and write a spare block, and dummy entries'
block-table rows name that block (BatchPadding).
`forward` never syncs with the host and allocates only by T, H and D.

Importing this module does not import triton: the registered factory does, and says how to
install it when it is missing. On the CPU the kernel runs only under TRITON_INTERPRET=1
(the tests); an engine there should use `reference`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from strata.attention.backend import (AttentionBatch, BatchPadding, register_backend,
                                     write_padded)
from strata.errors import StrataError
from strata.kvcache.cache import PagedKVCache

TILE_TOKENS = 16  # query tokens per tile: triton_kernel.BLOCK_M (checked when it is built)


@dataclass(frozen=True)
class TritonMeta:
    slot_mapping: torch.Tensor  # [T] int64: flat KV-cache row each token writes
    positions: torch.Tensor     # [T] int32: position of each token in its entry's sequence
    block_tables: torch.Tensor  # [B, W] int32: each entry's blocks, in position order
    tile_entry: torch.Tensor    # [ceil(T / 16) + B] int32: entry of each query tile
    tile_start: torch.Tensor    # [ceil(T / 16) + B] int32: window index of its first token
    tile_count: torch.Tensor    # [ceil(T / 16) + B] int32: its tokens (0: an unused tile)
    block_size: int             # tokens per KV block (the engine's --block-size)


def query_tiles(query_lens: list[int], num_tiles: int) -> list[list[int]]:
    """3 rows of `num_tiles`: (entry, first token, token count) of each run of at most
    TILE_TOKENS consecutive tokens of one entry, in window order; unused tiles are (0, 0, 0).
    Plain Python over a few entries: cheaper on the host than tensor ops."""
    tiles: list[list[int]] = [[], [], []]
    start = 0
    for entry, length in enumerate(query_lens):
        for offset in range(0, length, TILE_TOKENS):
            tiles[0].append(entry)
            tiles[1].append(start + offset)
            tiles[2].append(min(TILE_TOKENS, length - offset))
        start += length
    unused = num_tiles - len(tiles[0])
    return [row + [0] * unused for row in tiles]


def tiles_for(tokens: int, entries: int) -> int:
    """Query tiles of a window of `tokens` tokens in `entries` entries: a bound by shape,
    not the count one window uses (each entry's last tile may be partial)."""
    return -(-tokens // TILE_TOKENS) + entries


class TritonBackend:
    name = "triton"
    capturable = True  # static metadata shapes, no host sync: CUDA graphs may capture it

    def __init__(self, kernel: Callable[..., torch.Tensor], write: Callable[..., None]):
        self.kernel = kernel  # triton_kernel.paged_attention
        self.write = write    # triton_kernel.write_kv

    @staticmethod
    def rows(meta: TritonMeta) -> torch.Tensor:
        """The cache rows a window's k and v go to: a kernel before `forward` may write
        them there (the rotation's: ForwardMeta.kv_write), and say so."""
        return meta.slot_mapping

    def prepare(self, batch: AttentionBatch, device: torch.device) -> TritonMeta:
        check_device(torch.device(device).type)
        host = self.prepare_host(batch)
        move = dict(device=device, non_blocking=True)
        return TritonMeta(**{f.name: getattr(host, f.name).to(**move)
                             if isinstance(getattr(host, f.name), torch.Tensor)
                             else getattr(host, f.name) for f in fields(host)})

    def prepare_host(self, batch: AttentionBatch) -> TritonMeta:
        """The metadata on the host: what a CUDA graph's static buffers are filled from
        (one copy each, no device-to-device step)."""
        tiles = torch.tensor(query_tiles(batch.query_lens, tiles_for(
            len(batch.positions), len(batch.query_lens))), dtype=torch.int32)
        return TritonMeta(slot_mapping=batch.slot_mapping.to(dtype=torch.long),
                          positions=batch.positions.to(dtype=torch.int32),
                          block_tables=batch.block_tables.to(dtype=torch.int32),
                          tile_entry=tiles[0], tile_start=tiles[1], tile_count=tiles[2],
                          block_size=batch.block_size)

    def write_host(self, into: TritonMeta, batch: AttentionBatch,
                   padding: BatchPadding) -> None:
        """`prepare_host` of `batch` padded by `padding`, written into `into`'s arrays (a
        staging buffer's host side): a few numpy writes, no tensors made."""
        write_padded(into.slot_mapping, batch.slot_mapping.numpy(), padding.row)
        write_padded(into.positions, batch.positions.numpy(), 0)
        tables = batch.block_tables.numpy()
        into.block_tables[:] = padding.block
        into.block_tables[:tables.shape[0], :tables.shape[1]] = tables
        tiles = query_tiles(padding.query_lens(batch.query_lens), len(into.tile_entry))
        into.tile_entry[:], into.tile_start[:], into.tile_count[:] = tiles

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache, meta: TritonMeta,
                scale: float | None = None, written: bool = False) -> torch.Tensor:
        if not written:  # (written: the rotation's kernel put them in `rows(meta)`)
            self._write(k, v, cache, meta)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return self.kernel(q if q.stride(-1) == 1 else q.contiguous(), cache.key, cache.value,
                           meta.positions, meta.block_tables, meta.tile_entry,
                           meta.tile_start, meta.tile_count, meta.block_size, scale)

    def _write(self, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache,
               meta: TritonMeta) -> None:
        """k and v into the window's cache rows: one kernel, or PyTorch's copies where a
        cast comes first."""
        if k.stride(-1) == v.stride(-1) == 1 and k.dtype == v.dtype == cache.key.dtype:
            self.write(k, v, cache.key, cache.value, meta.slot_mapping)
        else:
            cache.key.index_copy_(0, meta.slot_mapping, k.to(cache.key.dtype))
            cache.value.index_copy_(0, meta.slot_mapping, v.to(cache.value.dtype))


def check_device(device_type: str) -> None:
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise StrataError("the triton backend runs on CUDA devices; use "
                          "--attention-backend reference on the CPU")


def make_triton_backend() -> TritonBackend:
    """Import the kernel (and triton) only when the backend is chosen. A machine without
    CUDA is refused here, when the stage is built; a CPU stage on a CUDA machine when its
    first window is prepared."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise StrataError("--attention-backend triton needs the triton package: "
                          "pip install 'strata[gpu]'") from None
    if not torch.cuda.is_available():
        check_device("cpu")
    from strata.attention import triton_kernel

    assert triton_kernel.BLOCK_M == TILE_TOKENS, "the tile map and the kernel disagree"
    return TritonBackend(triton_kernel.paged_attention, triton_kernel.write_kv)


register_backend(TritonBackend.name, make_triton_backend)
