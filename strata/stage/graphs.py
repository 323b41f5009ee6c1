"""StageGraphs: one stage's forward captured as a CUDA graph per window bucket, replayed.

A graphed window is padded to its bucket (buckets.py), its metadata copied into the
bucket's static buffers (on the first stage its token ids and the rows it carries over too,
on the last the greedy table of its entries): views of one block of device memory that a
single host-to-device copy fills (staging.py), in stream order, so a window prepared while
the previous one still runs never disturbs it. Then the graph is replayed: one launch for
the whole stage instead of several per layer; the last stage's ends with every entry's
greedy decision (`greedy_rows`), which the WindowVerifier takes for plain greedy windows,
so their verification costs the host no launches. The outputs are copied out of
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

from strata.layers.forward_meta import ForwardMeta
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
    token_ids: torch.Tensor  # [bucket] on the host (the first stage's input)
    meta: ForwardMeta | None = None  # the window's own metadata, where the backend's
                                     # shapes are not static (padding checked eagerly)
    num_verify: int = 0      # the window's sampling entries (the last stage's decisions)
    num_carried: int = 0     # first stage: its rows whose ids the group's window in flight
                             # decides (replay's x: those decisions, on the device)
    carried_in_order: bool = False  # ...and they are its first rows, from its entries in order


class _Captured:
    """A bucket: its static metadata (views of `staging`'s block where the backend's
    shapes are static; the first stage's token ids too, and the last stage's greedy table),
    its graph and outputs."""

    def __init__(self, meta: ForwardMeta, graph: bool, staging: StagingBuffer | None = None,
                 ids: torch.Tensor | None = None, carry: torch.Tensor | None = None,
                 verify: list[torch.Tensor] | None = None):
        self.meta, self.staging, self.ids, self.verify = meta, staging, ids, verify
        self.carry = carry  # first stage: [2, T] the carried rows, the entries they come from
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
                entry = self._static(pad_window(blank, tokens, self.shape), tokens, blank)
                self.captured[tokens] = entry
                if self.graphs:
                    self._capture(entry, entry.ids if entry.ids is not None
                                  else self.input[:tokens], pool)
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

    def _host_tensors(self, padded: PaddedWindow, tokens: int, verify: list[VerifyEntry],
                      header: WindowHeader) -> list[torch.Tensor]:
        """A padded window's metadata on the host, in the order of a bucket's staging views:
        positions, logits rows, the backend's tensors, the state's, then on the first stage
        the token ids and the carried rows and their entries (`header.carry_rows`,
        `carry_from`), and on the last the greedy table of `verify`."""
        attention = self.stage.backend.prepare_host(padded.batch)
        tensors = [padded.batch.positions, padded.logits_idx, *tensor_fields(attention)]
        if padded.state is not None:
            tensors += tensor_fields(padded.state)
        if self.stage.module.first:
            spare = [0] * (tokens - len(header.carry_rows))
            tensors += [padded.token_ids, torch.tensor([header.carry_rows + spare,
                                                        header.carry_from + spare])]
        if self.stage.module.last:
            target, entry, start = greedy_table(verify, self.shape.logit_rows(tokens),
                                                self.shape.num_entries)
            tensors += [torch.tensor([target, entry]), torch.tensor(start)]
        return tensors

    def _static(self, padded: PaddedWindow, tokens: int, blank: WindowHeader) -> _Captured:
        """A bucket's static metadata: where the backend's shapes are static, views of one
        staging block (filled with `padded`'s values) that every window of the bucket fills
        with one copy; else ForwardMeta built as eager windows build theirs."""
        if not self.static_meta:
            return _Captured(self._meta(padded), self.graphs)
        staging = StagingBuffer(self._host_tensors(padded, tokens, [], blank), self.stage.device)
        views = iter(staging.views)
        positions, logits_idx = next(views), next(views)
        attention = with_views(self.stage.backend.prepare_host(padded.batch), views)
        state = with_views(padded.state, views) if padded.state is not None else None
        ids, carry = (next(views), next(views)) if self.stage.module.first else (None, None)
        verify = [*next(views), next(views)] if self.stage.module.last else None
        meta = ForwardMeta(positions=positions, logits_idx=logits_idx,
                           backend=self.stage.backend, attention=attention, state=state)
        return _Captured(meta, self.graphs, staging, ids, carry, verify)

    def prepare(self, header: WindowHeader) -> GraphCall | None:
        """Fill the window's bucket with its metadata; None when no bucket holds it."""
        tokens = pick_bucket(header.num_tokens, self.sizes)
        logits = header.num_tokens if header.logits_all else len(header.sample_rows)
        if (tokens is None or len(header.query_lens) >= self.shape.num_entries
                or logits > self.shape.logit_rows(tokens)):
            return None
        padded = pad_window(header, tokens, self.shape)
        meta = None
        carried, in_order = 0, False
        if self.static_meta:  # host tensors copied into the graph's buffers at once
            verify = [] if header.logits_all else header.verify
            self.captured[tokens].staging.fill(self._host_tensors(padded, tokens, verify,
                                                                  header))
            if self.stage.module.first and header.carry:
                carried = len(header.carry_rows)
                in_order = header.carry_rows == header.carry_from == list(range(carried))
        else:
            meta = self._meta(padded)
        return GraphCall(tokens, padded.num_tokens, padded.num_logits, padded.token_ids, meta,
                         len(header.verify), carried, in_order)

    def replay(self, x: torch.Tensor, call: GraphCall):
        """x: the real tokens' input; on the first stage the token ids came with the
        metadata, and x is what the group's window in flight decided, on the device, when
        the call carries some of them over (else unused). Returns the stage's outputs for
        the real rows, copied out of the graph (on the last stage with its decisions)."""
        entry = self.captured[call.tokens]
        if entry.ids is not None:  # the first stage: its ids came with the metadata...
            n = call.num_carried  # ...but those the window in flight decides (header.carry)
            if n and call.carried_in_order:
                entry.ids[:n].copy_(x[:n])
            elif n:
                rows, source = entry.carry
                entry.ids.index_copy_(0, rows[:n], x.index_select(0, source[:n]))
            inputs = entry.ids
        elif self.stage.module.first:  # metadata of its own: the ids copied apart
            inputs = self.input[:call.tokens]
            inputs.copy_(call.token_ids, non_blocking=True)
            if x.device == inputs.device:
                inputs[:call.num_tokens].copy_(x)
        else:
            inputs = self.input[:call.tokens]
            inputs[:call.num_tokens].copy_(x, non_blocking=True)
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
