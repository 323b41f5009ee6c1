"""StageGraphs: one stage's forward captured as a CUDA graph per window bucket, replayed.

A graphed window is padded to its bucket (buckets.py), its metadata copied into the
bucket's static buffers (a few small host-to-device copies, in stream order, so a window
prepared while the previous one still runs never disturbs it), and the graph replayed: one
launch for the whole stage instead of several per layer. The outputs are copied out of
the graph's buffers at once, so a later replay cannot overwrite a window not yet read.
Windows larger than the largest bucket run eagerly. Capturing needs an attention backend
whose metadata has static shapes (`capturable = True`, with `prepare_host(batch)`: the
metadata on the host) and layers without host reads.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from strata.attention.backend import copy_meta
from strata.layers.forward_meta import ForwardMeta
from strata.scheduler.window import WindowHeader
from strata.stage.buckets import WindowShape, pad_window, pick_bucket

log = logging.getLogger("strata.engine")


@dataclass(frozen=True)
class GraphCall:
    """A window prepared for replay: its bucket's static buffers hold its metadata."""
    tokens: int      # the bucket
    num_tokens: int  # real tokens
    num_logits: int  # real logits rows
    token_ids: torch.Tensor  # [bucket] on the host (the first stage's input)
    meta: ForwardMeta | None = None  # the window's own metadata, where the backend's
                                     # shapes are not static (padding checked eagerly)


class _Captured:
    def __init__(self, meta: ForwardMeta, graph: bool):
        self.meta = meta
        self.graph = torch.cuda.CUDAGraph() if graph else None
        self.out: Any = None


class StageGraphs:
    """`graphs=False` keeps everything but the graphs (padding, buckets, static buffers)
    and runs each padded window eagerly: how the CPU tests check the same logic."""

    def __init__(self, stage, sizes: list[int], shape: WindowShape, hidden_size: int,
                 graphs: bool = True):
        self.stage, self.sizes, self.shape, self.graphs = stage, sizes, shape, graphs
        self.static_meta = bool(getattr(stage.backend, "capturable", False))
        if graphs and not self.static_meta:
            raise ValueError(f"the {stage.backend.name} backend cannot be captured")
        device, largest = stage.device, sizes[-1]
        self.input = (torch.zeros(largest, dtype=torch.long, device=device)
                      if stage.module.first else
                      torch.zeros(largest, hidden_size, dtype=stage.dtype, device=device))
        self.captured: dict[int, _Captured] = {}

    def capture(self) -> None:
        """Capture every bucket, largest first (later ones reuse its memory pool)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.graphs else None
        blank = WindowHeader(group=0, slots=[0], starts=[0], query_lens=[1], samples=[True],
                             num_drafts=[0], token_ids=torch.zeros(1, dtype=torch.long),
                             positions=torch.zeros(1, dtype=torch.long),
                             slot_mapping=torch.full((1,), self.shape.padding_block
                                                     * self.stage.cache_size.block_size),
                             block_tables=torch.full((1, 1), self.shape.padding_block),
                             block_size=self.stage.cache_size.block_size,
                             sample_rows=torch.zeros(1, dtype=torch.long), verify=[],
                             following=[None])
        with tqdm(total=len(self.sizes), desc=f"stage {self.stage.index}: CUDA graphs",
                  unit="graph", file=sys.stderr, leave=False,
                  disable=not sys.stderr.isatty()) as progress, torch.inference_mode():
            for tokens in reversed(self.sizes):
                padded = pad_window(blank, tokens, self.shape)
                entry = _Captured(self._meta(padded), self.graphs)
                self.captured[tokens] = entry
                if self.graphs:
                    self._capture(entry, self.input[:tokens], pool)
                progress.update()
        if not self.graphs:
            return
        torch.cuda.synchronize(self.stage.device)
        log.info("stage %d: %d CUDA graphs captured (windows of up to %d tokens) in %.1f s",
                 self.stage.index, len(self.sizes), self.sizes[-1], time.perf_counter() - start)

    def _capture(self, entry: _Captured, x: torch.Tensor, pool) -> None:
        side = torch.cuda.Stream(self.stage.device)
        side.wait_stream(torch.cuda.current_stream(self.stage.device))
        with torch.cuda.stream(side):  # warm-up: kernels compiled, workspaces made
            self.stage.module(x, entry.meta, self.stage.caches)
        torch.cuda.current_stream(self.stage.device).wait_stream(side)
        with torch.cuda.graph(entry.graph, pool=pool):
            entry.out = self.stage.module(x, entry.meta, self.stage.caches)

    def _meta(self, padded) -> ForwardMeta:
        return ForwardMeta.build(padded.batch, self.stage.backend, self.stage.device,
                                 padded.logits_idx, padded.state)

    def prepare(self, header: WindowHeader) -> GraphCall | None:
        """Fill the window's bucket with its metadata; None when no bucket holds it."""
        tokens = pick_bucket(header.num_tokens, self.sizes)
        logits = header.num_tokens if header.logits_all else len(header.sample_rows)
        if (tokens is None or len(header.query_lens) >= self.shape.num_entries
                or logits > self.shape.logit_rows(tokens)):
            return None
        padded = pad_window(header, tokens, self.shape)
        meta = None
        if self.static_meta:  # host tensors copied straight into the graph's buffers
            static = self.captured[tokens].meta
            static.positions.copy_(padded.batch.positions, non_blocking=True)
            static.logits_idx.copy_(padded.logits_idx, non_blocking=True)
            copy_meta(static.attention, self.stage.backend.prepare_host(padded.batch))
            if padded.state is not None:
                copy_meta(static.state, padded.state)
        else:
            meta = self._meta(padded)
        return GraphCall(tokens, padded.num_tokens, padded.num_logits, padded.token_ids, meta)

    def replay(self, x: torch.Tensor, call: GraphCall):
        """x: the real tokens' input (token ids are taken from the call on the first
        stage). Returns the stage's outputs for the real rows, copied out of the graph."""
        entry = self.captured[call.tokens]
        if self.stage.module.first:
            self.input[:call.tokens].copy_(call.token_ids, non_blocking=True)
            if x.device == self.input.device:  # ids carried over on the device (header.carry)
                self.input[:call.num_tokens].copy_(x)
        else:
            self.input[:call.num_tokens].copy_(x, non_blocking=True)
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.out
        else:
            out = self.stage.module(self.input[:call.tokens], call.meta or entry.meta,
                                    self.stage.caches)
        if self.stage.module.last:
            logits, hidden = out
            return logits[:call.num_logits].clone(), hidden[:call.num_tokens].clone()
        return out[:call.num_tokens].clone()
