"""StageGraphs: one stage's forward captured as a CUDA graph per window bucket, replayed.

A graphed window's metadata, padded to its bucket (buckets.py), is written straight into
the bucket's staging arrays on the host (on the first stage its token ids and the rows it
carries over too, on the last the greedy table of its entries), and a single
host-to-device copy moves them into the bucket's static buffers: views of one block of
device memory (staging.py), in stream order, so a window prepared while the previous one
still runs never disturbs it. Then the graph is replayed: one launch for
the whole stage instead of several per layer; the last stage's ends with every entry's
greedy decision (`greedy_rows`), which the WindowVerifier takes for plain greedy windows,
so their verification costs the host no launches. The outputs are copied out of
the graph's buffers at once, so a later replay cannot overwrite a window not yet read.
Windows larger than the largest bucket run eagerly. Capturing needs an attention backend
whose metadata has static shapes (`capturable = True`, with `prepare_host(batch)`: the
metadata on the host, and `write_host`: a window's, padded, into a bucket's host arrays)
and layers without host reads.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from strata.attention.backend import AttentionBatch, write_padded
from strata.layers.forward_meta import ForwardMeta
from strata.layers.state_meta import StateMeta
from strata.sampling.verifier import VerifyEntry, greedy_rows, greedy_table
from strata.scheduler.window import WindowHeader
from strata.stage.buckets import PaddedWindow, WindowShape, pad_window, pick_bucket
from strata.stage.staging import StagingBuffer, tensor_fields, with_views

log = logging.getLogger("strata.engine")


@dataclass(frozen=True)
class GraphCall:
    """A window prepared for replay: its bucket's static buffers hold its metadata."""
    tokens: int      # the bucket
    num_tokens: int  # real tokens
    num_logits: int  # real logits rows
    token_ids: torch.Tensor | None  # [bucket] on the host (the first stage's input), where
                                    # they did not come with the staged metadata
    meta: ForwardMeta | None = None  # the window's own metadata, where the backend's
                                     # shapes are not static (padding checked eagerly)
    num_verify: int = 0      # the window's sampling entries (the last stage's decisions)
    num_carried: int = 0     # first stage: its rows whose ids the group's window in flight
                             # decides (replay's x: those decisions, on the device)
    carried_in_order: bool = False  # ...and they are its first rows, from its entries in order


@dataclass(frozen=True)
class _Staged:
    """A bucket's staged metadata in staging order: as device views (what its graph reads)
    or as one ring slot's host arrays (what a window is written into)."""
    positions: Any
    logits_idx: Any
    attention: Any       # the backend's metadata
    state: Any           # StateMeta, for stages with per-slot state
    ids: Any = None      # first stage: [T] token ids
    carry: Any = None    # first stage: [2, T] the carried rows, the entries they come from
    table: Any = None    # last stage: [2, R] greedy targets, their entries (greedy_table)
    start: Any = None    # last stage: [N] each entry's first row

    @classmethod
    def of(cls, views: Iterator, attention: Any, state: StateMeta | None, first: bool,
           last: bool) -> _Staged:
        """The layout over `views` (a staging buffer's, in order), with the shapes of the
        templates `attention` and `state`."""
        positions, logits_idx = next(views), next(views)
        attention = with_views(attention, views)
        state = with_views(state, views) if state is not None else None
        ids, carry = (next(views), next(views)) if first else (None, None)
        table, start = (next(views), next(views)) if last else (None, None)
        return cls(positions, logits_idx, attention, state, ids, carry, table, start)


class _Captured:
    """A bucket: its metadata (on the device, and the host arrays of each ring slot of its
    staging buffer, where the backend's shapes are static), its graph and outputs."""

    def __init__(self, meta: ForwardMeta, graph: bool, staging: StagingBuffer | None = None,
                 device: _Staged | None = None, hosts: list[_Staged] | None = None):
        self.meta, self.staging, self.device, self.hosts = meta, staging, device, hosts
        self.graph = torch.cuda.CUDAGraph() if graph else None
        self.out: Any = None

    @property
    def verify(self) -> list[torch.Tensor] | None:
        """The greedy table's device views, as `greedy_rows` reads them (last stage)."""
        if self.device is None or self.device.table is None:
            return None
        return [*self.device.table, self.device.start]


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
                entry = self._static(pad_window(blank, tokens, self.shape), tokens)
                self.captured[tokens] = entry
                if self.graphs:
                    self._capture(entry, self._inputs(entry, tokens), pool)
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
            self._run(entry, x)
        torch.cuda.current_stream(self.stage.device).wait_stream(side)
        with torch.cuda.graph(entry.graph, pool=pool):
            entry.out = self._run(entry, x)

    def _meta(self, padded: PaddedWindow) -> ForwardMeta:
        return ForwardMeta.build(padded.batch, self.stage.backend, self.stage.device,
                                 padded.logits_idx, padded.state)

    def _templates(self, padded: PaddedWindow, tokens: int,
                   attention: Any) -> list[torch.Tensor]:
        """A blank padded window's metadata on the host (`attention`: the backend's, from
        `prepare_host`), in staging order (`_Staged`): positions, logits rows, the
        backend's tensors, the state's, then on the first stage the token ids and carried
        rows, on the last the greedy table."""
        tensors = [padded.batch.positions, padded.logits_idx, *tensor_fields(attention)]
        if padded.state is not None:
            tensors += tensor_fields(padded.state)
        if self.stage.module.first:
            tensors += [padded.token_ids, torch.zeros(2, tokens, dtype=torch.long)]
        if self.stage.module.last:
            target, entry, start = greedy_table([], self.shape.logit_rows(tokens),
                                                self.shape.num_entries)
            tensors += [torch.tensor([target, entry]), torch.tensor(start)]
        return tensors

    def _static(self, padded: PaddedWindow, tokens: int) -> _Captured:
        """A bucket's static metadata: where the backend's shapes are static, views of one
        staging block that every window of the bucket fills with one copy; else ForwardMeta
        built as eager windows build theirs."""
        if not self.static_meta:
            return _Captured(self._meta(padded), self.graphs)
        attention = self.stage.backend.prepare_host(padded.batch)
        staging = StagingBuffer(self._templates(padded, tokens, attention), self.stage.device)
        module = self.stage.module

        def staged(views: list) -> _Staged:
            return _Staged.of(iter(views), attention, padded.state, module.first, module.last)

        device = staged(staging.views)
        meta = ForwardMeta(positions=device.positions, logits_idx=device.logits_idx,
                           backend=self.stage.backend, attention=device.attention,
                           state=device.state)
        return _Captured(meta, self.graphs, staging, device,
                         [staged(host) for host in staging.hosts])

    def _write(self, host: _Staged, header: WindowHeader, tokens: int,
               verify: list[VerifyEntry]) -> None:
        """The window's metadata padded to the bucket of `tokens`, written into one ring
        slot's host arrays: numpy writes from the header's tensors and lists (a window's
        preparation is host time at every step of several streams)."""
        write_padded(host.positions, header.positions.numpy(), 0)
        write_padded(host.logits_idx, header.logits_idx().numpy(), 0)
        batch = AttentionBatch(header.query_lens, header.positions, header.slot_mapping,
                               header.block_tables, header.block_size)
        self.stage.backend.write_host(host.attention, batch,
                                      self.shape.padding(tokens, header.block_size))
        if host.state is not None:
            state = StateMeta.build(header.query_lens, header.starts, header.num_drafts,
                                    header.state_rows, tokens, self.shape.num_entries)
            for into, value in zip(tensor_fields(host.state), tensor_fields(state)):
                into[...] = value.numpy()
        if host.ids is not None:
            write_padded(host.ids, header.token_ids.numpy(), 0)
            write_padded(host.carry[0], header.carry_rows, 0)
            write_padded(host.carry[1], header.carry_from, 0)
        if host.table is not None:
            target, entry, start = greedy_table(verify, host.table.shape[1],
                                                self.shape.num_entries)
            host.table[0], host.table[1], host.start[:] = target, entry, start

    def prepare(self, header: WindowHeader) -> GraphCall | None:
        """Fill the window's bucket with its metadata; None when no bucket holds it."""
        tokens = pick_bucket(header.num_tokens, self.sizes)
        logits = header.num_tokens if header.logits_all else len(header.sample_rows)
        if (tokens is None or len(header.query_lens) >= self.shape.num_entries
                or logits > self.shape.logit_rows(tokens)):
            return None
        if not self.static_meta:
            padded = pad_window(header, tokens, self.shape)
            return GraphCall(tokens, padded.num_tokens, padded.num_logits, padded.token_ids,
                             self._meta(padded), len(header.verify))
        entry = self.captured[tokens]  # written into its host arrays, copied at once
        slot = entry.staging.claim()
        self._write(entry.hosts[slot], header, tokens,
                    [] if header.logits_all else header.verify)
        entry.staging.send(slot)
        carried, in_order = 0, False
        if self.stage.module.first and header.carry:
            carried = len(header.carry_rows)
            in_order = header.carry_rows == header.carry_from == list(range(carried))
        return GraphCall(tokens, header.num_tokens, logits, None, None, len(header.verify),
                         carried, in_order)

    def replay(self, x: torch.Tensor, call: GraphCall):
        """x: the real tokens' input; on the first stage the token ids came with the
        metadata, and x is what the group's window in flight decided, on the device, when
        the call carries some of them over (else unused). Returns the stage's outputs for
        the real rows, copied out of the graph (on the last stage with its decisions)."""
        entry = self.captured[call.tokens]
        inputs = self._inputs(entry, call.tokens)
        n = call.num_carried
        if not self.stage.module.first:
            inputs[:call.num_tokens].copy_(x, non_blocking=True)
        elif call.token_ids is not None:  # metadata of its own: the ids copied apart
            inputs.copy_(call.token_ids, non_blocking=True)
            if x.device == inputs.device:
                inputs[:call.num_tokens].copy_(x)
        elif n and call.carried_in_order:  # the ids came with the metadata, but for those
            inputs[:n].copy_(x[:n])         # the window in flight decides (header.carry)
        elif n:
            rows, source = entry.device.carry
            inputs.index_copy_(0, rows[:n], x.index_select(0, source[:n]))
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.out
        else:
            out = self._run(entry, inputs, call.meta)
        if self.stage.module.last:
            logits, hidden, decided = out
            return (logits[:call.num_logits].clone(), hidden[:call.num_tokens].clone(),
                    None if decided is None else decided[:, :call.num_verify].clone())
        return out[:call.num_tokens].clone()

    def _inputs(self, entry: _Captured, tokens: int) -> torch.Tensor:
        """The bucket's input buffer: the staged token ids on a first stage whose metadata
        is staged, else the stage's input buffer's first `tokens` rows."""
        if entry.device is not None and entry.device.ids is not None:
            return entry.device.ids
        return self.input[:tokens]

    def _run(self, entry: _Captured, x: torch.Tensor, meta: ForwardMeta | None = None):
        """The stage's forward over a bucket (what its graph captures); on the last stage
        with a greedy table, (logits, hidden, the greedy decisions of every entry)."""
        out = self.stage.module(x, meta or entry.meta, self.stage.caches)
        if not self.stage.module.last:
            return out
        logits, hidden = out
        if entry.verify is None or meta is not None:
            return logits, hidden, None
        return logits, hidden, greedy_rows(logits, *entry.verify)
