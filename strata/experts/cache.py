"""ExpertCache: one stage's routed experts in host RAM, a VRAM pool of slots caching them,
and the per-window protocol that keeps the two consistent while windows are in flight.

Layout. Each MoE layer's experts are one host tensor [E, B] (B: an expert's gate, up and
down weights end to end, dense or in their GGUF blocks), pinned on a CUDA stage; the pool
is one device tensor [slots, B] shared by all of the stage's MoE layers. A layer's
projections, as its kernels see them, are views of the pool ([slots, I, H], ...), and a
rows table [layers, E] (int64, on the device) says where each expert's bytes are: its
slot, or the row of the pool's views that lands on the expert's bytes in host memory
(each host tensor is placed so that its distance from the pool is a whole number of rows).
So the fused kernels (layers/moe_triton.py) read hits from VRAM and misses straight from
host RAM over PCIe, with no host sync and nothing that changes shape: CUDA graphs capture
them, and a miss costs its bytes over PCIe once, overlapped with the hits' compute.

Per window (Stage.move_blocks calls before_window, Stage.forward after_window):
  after_window   the window's pair counts per expert (added up on the device by the
                 layers) are copied to host memory behind an event, and zeroed.
  before_window  counts whose copy is done are observed at the residency that window ran
                 with (hits, misses), and the misses admitted (policy.py), at most
                 --pcie-frac of the window's expert reads:
                 - into a free slot (no window reads it): copied at once on a side stream,
                   and this window's compute waits for the copy on the GPU (no host sync;
                   it overlaps the window still computing) and reads it;
                 - into a victim's slot: the victim's row points home at once; the copy
                   runs on the side stream after an event recorded behind every window
                   launched so far (those may still read the victim), and the next
                   before_window points the expert at its slot, the compute stream
                   waiting for the copy.
                 Experts are evicted ahead (policy.reserve: as many as the last window
                 missed, at most an eighth of the slots, at least one), their slots free once the
                 windows reading them are done, so that most misses take a free slot and
                 hit from the window after the one that observed them. The rows table
                 goes to the device when it changed, in one copy, in stream order.
Windows larger than the fused path (prompt chunks) and CPU stages take the grouped path
(layers/moe.py), the routed experts gathered from their slots and host rows.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import nn

from strata.experts.policy import ExpertCachePolicy
from strata.experts.prefetch import Prefetch

log = logging.getLogger("strata.engine")

USAGE_RING = 4  # windows whose counts may be on their way to the host at once


@dataclass
class ExpertStats:
    """What a stage's expert cache did (counts since start-up, or a delta)."""
    hits: float = 0          # distinct (layer, expert) reads from VRAM, per window
    misses: float = 0        # ... from host RAM (over PCIe, by the kernels themselves)
    read_bytes: float = 0    # bytes the misses read over PCIe
    upload_bytes: float = 0  # bytes uploaded into slots (side stream)
    upload_seconds: float = 0.0  # side-stream time of those uploads
    exposed_seconds: float = 0.0  # ... of it that the compute stream waited for
    prefetched: float = 0      # experts uploaded one layer ahead (prefetch.py)
    prefetch_used: float = 0   # ... that their window then read
    predicted_hits: float = 0  # distinct experts a predicted layer read that were predicted
    predicted_reads: float = 0  # distinct experts predicted layers read (recall's base)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def vector(self) -> list[float]:
        return [float(getattr(self, n)) for n in self.names()]

    def add(self, values) -> None:
        for name, value in zip(self.names(), values):
            setattr(self, name, getattr(self, name) + value)

    @property
    def hit_rate(self) -> float:
        reads = self.hits + self.misses
        return self.hits / reads if reads else 1.0

    @property
    def recall(self) -> float | None:
        """Of the experts that layers with a prediction read, the share predicted."""
        return self.predicted_hits / self.predicted_reads if self.predicted_reads else None

    def summary(self, tokens: int) -> str:
        """One line: hit rate, PCIe bytes per generated token, and prefetch."""
        per = max(tokens, 1) * 2**20
        line = (f"{100 * self.hit_rate:.1f}% of expert reads from VRAM; over PCIe per "
                f"token {self.read_bytes / per:.1f} MiB read, {self.upload_bytes / per:.1f} "
                f"MiB uploaded ({self.upload_seconds:.2f} s of uploads on a side stream, "
                f"{self.exposed_seconds:.2f} s that the compute waited for)")
        if self.recall is not None:
            used = self.prefetch_used / self.prefetched if self.prefetched else 0.0
            line += (f"; prefetch recall {100 * self.recall:.0f}%, {self.prefetched:.0f} "
                     f"experts prefetched ({100 * used:.0f}% of them read)")
        return line


@dataclass(frozen=True)
class _Part:
    """One projection of an expert within its row of B values: columns [start, end)."""
    name: str
    shape: tuple[int, int]
    start: int
    end: int
    qtype: str | None


class ExpertCache:
    def __init__(self, layers: list[nn.Module], device: torch.device, num_slots: int,
                 policy: str = "lfu", pcie_frac: float = 1.0, prefetch: int = 0):
        """`layers`: the stage's GroupedExperts, their weights loaded in host memory.
        Takes them over: their projections become views of the host tensors, and each
        gets `offload` (CachedExperts) through which it computes. `prefetch`: experts per
        layer and window uploaded one layer ahead (prefetch.py; 0: none)."""
        self.device, self.cuda = device, device.type == "cuda"
        self.pcie_frac = pcie_frac
        first = layers[0]
        self.parts, start = [], 0
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = getattr(first, name)
            size = w[0].numel()
            self.parts.append(_Part(name, tuple(w.shape[1:]), start, start + size,
                                    getattr(w, "qtype", None)))
            start += size
        self.row_size, self.dtype = start, first.gate_proj.dtype
        self.num_experts = first.gate_proj.shape[0]
        if len({kind_of(layer) for layer in layers}) != 1:
            raise ValueError("an ExpertCache holds experts of one kind (shapes, dtype, "
                             "format): ExpertCaches groups layers by kind")
        element = torch.empty(0, dtype=self.dtype).element_size()
        self.expert_bytes = self.row_size * element
        self.pool = torch.empty(max(1, num_slots), self.row_size, dtype=self.dtype,
                                device=device)
        self.hosts, deltas = [], []
        for layer in layers:
            host, delta = self._host_rows(layer, element)
            self.hosts.append(host)
            deltas.append(delta)
        self.host_rows = np.array(deltas, dtype=np.int64)[:, None] + np.arange(self.num_experts)
        self.rows_host = self.host_rows.copy()  # where each expert is read from, now
        self.rows = torch.from_numpy(self.rows_host).to(device)
        self.usage = torch.zeros(len(layers), self.num_experts, dtype=torch.int32, device=device)
        self.policy = ExpertCachePolicy(len(layers), self.num_experts, num_slots, policy)
        self.stats = ExpertStats()
        self._reported = ExpertStats()
        self._counts: deque = deque()    # (host counts, event, residency it ran with)
        self._uploads: list = []         # (keys, done event): copies into victims' slots
        self._draining: deque = deque()  # (slots, event after the windows reading them)
        self._timing: deque = deque()    # (start, done) events of uploads, for the stats
        self._stalls: deque = deque()    # events around the compute's waits for uploads
        self._resident_now = self.policy.resident.copy()
        self._side = torch.cuda.Stream(device) if self.cuda else None
        self.projections = self._projections()  # made once: the pool never moves
        self._fill()
        self.prefetch = Prefetch(self, prefetch) if prefetch > 0 and pcie_frac > 0 else None
        for index, layer in enumerate(layers):
            layer.offload = CachedExperts(self, index)

    # -- start-up ---------------------------------------------------------------------

    def _host_rows(self, layer: nn.Module, element: int) -> tuple[torch.Tensor, int]:
        """The layer's experts as one host tensor [E, B] (pinned on CUDA), placed a whole
        number of rows away from the pool, and that number; the layer's projections become
        views of it."""
        raw = torch.empty((self.num_experts + 1) * self.row_size, dtype=self.dtype,
                          pin_memory=self.cuda)
        gap = (self.pool.data_ptr() - raw.data_ptr()) // element
        offset = gap % self.row_size
        host = raw[offset:offset + self.num_experts * self.row_size].view(
            self.num_experts, self.row_size)
        distance = host.data_ptr() - self.pool.data_ptr()
        assert distance % self.expert_bytes == 0
        for part in self.parts:
            w = getattr(layer, part.name)
            view = host[:, part.start:part.end].view(self.num_experts, *part.shape)
            view.copy_(w.data)
            param = nn.Parameter(view, requires_grad=False)
            param.spec = getattr(w, "spec", None)
            if part.qtype is not None:
                param.qtype = part.qtype
            setattr(layer, part.name, param)
        return host, distance // self.expert_bytes

    def _fill(self) -> None:
        """Every slot given an expert before the first window, each layer an equal share."""
        admissions = self.policy.fill()
        for a in admissions:
            self.pool[a.slot].copy_(self._host_row(a.key))
        self.policy.uploaded([a.key for a in admissions])
        self._point([a.key for a in admissions])
        self._push_rows()
        log.info("expert cache on %s: %d of %d experts resident (%.0f%%), %.2f GiB of VRAM, "
                 "%.2f GiB of host RAM", self.device, len(admissions), self.total_experts,
                 100 * len(admissions) / self.total_experts,
                 self.pool.numel() * self.pool.element_size() / 2**30,
                 self.total_experts * self.expert_bytes / 2**30)

    @property
    def total_experts(self) -> int:
        return len(self.hosts) * self.num_experts

    # -- per window -------------------------------------------------------------------

    def before_window(self) -> None:
        """Observe finished windows and admit their misses; commit uploads (see the
        module); send the rows table once; start the uploads that wait for victims."""
        observed, wanted, spare = [], 0, []
        while self._counts and self._done(self._counts[0][1]):
            reads, limit = self._observe(*self._counts.popleft(), spare)
            observed.append((reads.missed, limit))
            wanted = max(wanted, reads.misses)
        while self._draining and self._done(self._draining[0][1]):
            self.policy.drained(self._draining.popleft()[0])
        if self.prefetch is not None:  # free slots go to the next window's prefetch first
            self.prefetch.lend_slots()
        admissions = [a for missed, limit in observed for a in self.policy.admit(missed, limit)]
        self._time_uploads()
        commits = [keys for keys, done in self._uploads]
        waits = [done for _, done in self._uploads]  # uploads into drained victims' slots
        self._uploads.clear()
        free = [a for a in admissions if a.victim < 0]
        later = [a for a in admissions if a.victim >= 0]
        if free:  # into slots no window reads: now, the window waits for them on the GPU
            waits.append(self._copy(free, after=None))
            commits.append([a.key for a in free])
        self._gpu_wait(waits)
        # slots for the next window's misses, evicted ahead (free once no window reads them)
        ahead = min(wanted, max(1, self.policy.num_slots // 8))
        draining = spare + self.policy.reserve(ahead)
        for keys in commits:
            self.policy.uploaded(keys)
            self._point([k for k in keys if self.policy.slot.reshape(-1)[k] >= 0])
        self._point_evicted()  # the victims, of admissions and of the reserve
        if self._stale or not np.array_equal(self.rows_host, self._pushed):
            self._push_rows()
        if later or draining:
            freed = self._event()  # after every window launched so far
            if later:
                self._uploads.append(([a.key for a in later], self._copy(later, after=freed)))
            if draining:
                self._draining.append((draining, freed))
        self._resident_now = self.policy.resident.copy()

    def after_window(self) -> None:
        """The window's counts on their way to the host (read by a later before_window)."""
        resident = self._resident_now  # what this window ran with
        if len(self._counts) >= USAGE_RING:  # NOTE: waits for the oldest window's copy
            self._wait(self._counts[0][1])
            before = len(self._counts)
            self.before_window()
            assert len(self._counts) < before
        counts = torch.empty(self.usage.shape, dtype=torch.int32, pin_memory=self.cuda)
        counts.copy_(self.usage, non_blocking=True)
        self.usage.zero_()
        ahead = self.prefetch.take() if self.prefetch is not None else None
        event = torch.cuda.Event() if self.cuda else None
        if event is not None:
            event.record()
        self._counts.append((counts, event, resident, ahead))

    def reset_usage(self) -> None:
        """Forget counts (and prefetches) of windows that were not real (graph capture)."""
        self.usage.zero_()
        if self.prefetch is not None:
            self.prefetch.reset()
            self._push_rows()

    def take_stats(self) -> list[float]:
        """What the cache did since the last call (ExpertStats' fields, in order)."""
        now = self.stats.vector()
        delta = [a - b for a, b in zip(now, self._reported.vector())]
        self._reported = ExpertStats(*now)
        return delta

    def _observe(self, counts: torch.Tensor, event, resident_then: np.ndarray, ahead,
                 spare: list[int]):
        """What the window read (policy.Reads) and how many of its misses may be admitted;
        its prefetches applied first (slots to drain added to `spare`)."""
        used = counts.numpy()
        if ahead is not None:
            resident_then = resident_then | self._prefetches(*ahead, used, spare)
        reads = self.policy.observe(used, resident_then)
        self.stats.hits += reads.hits
        self.stats.misses += reads.misses
        self.stats.read_bytes += reads.misses * self.expert_bytes
        return reads, int(self.pcie_frac * (reads.hits + reads.misses))

    def _prefetches(self, record: torch.Tensor, predicted: torch.Tensor, lent: list[int],
                    used: np.ndarray, spare: list[int]) -> np.ndarray:
        """A window's prefetches (prefetch.py) taken over: each filled slot its expert's
        (or, if the expert holds a slot by now, drained: added to `spare`), the lent slots
        it left empty free; recall counted. The experts it made resident, [layers, E]."""
        record, predicted = record.numpy(), predicted.numpy()
        layers, _, cols = np.nonzero(record[:, 1:, :] >= 0)
        experts, slots = record[layers, 0, cols], record[layers, 1, cols]
        made = np.zeros(self.policy.ready.shape, dtype=bool)
        for layer, expert, slot in zip(layers, experts, slots):
            key = int(layer) * self.num_experts + int(expert)
            if self.policy.prefetched(key, int(slot)):
                made[layer, expert] = True
                self.rows_host[layer, expert] = slot
            else:
                spare.append(int(slot))
        self.policy.returned(sorted(set(lent) - {int(s) for s in slots}))
        self.stats.prefetched += int(made.sum())
        self.stats.prefetch_used += int((made & (used > 0)).sum())
        read = (used > 0)[self.prefetch.layers]
        self.stats.predicted_hits += int((read & (predicted[self.prefetch.layers] > 0)).sum())
        self.stats.predicted_reads += int(read.sum())
        self.stats.upload_bytes += len(slots) * self.expert_bytes
        self._stale |= len(slots) > 0  # the device's rows table changed under the host
        return made

    def _copy(self, admissions, after):
        """Copy the admitted experts from host RAM into their slots, on the side stream
        once event `after` is done (None: at once), or at once on the CPU; the copies'
        done event (None on the CPU)."""
        self.stats.upload_bytes += len(admissions) * self.expert_bytes
        if not self.cuda:
            for a in admissions:
                self.pool[a.slot].copy_(self._host_row(a.key))
            return None
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._side):
            if after is not None:
                self._side.wait_event(after)
            start.record()
            for a in admissions:
                self.pool[a.slot].copy_(self._host_row(a.key), non_blocking=True)
            done.record()
        self._timing.append((start, done))
        return done

    def _host_row(self, key: int) -> torch.Tensor:
        """Expert `key`'s (flat: layer * experts + expert) row in host RAM."""
        layer, expert = divmod(key, self.num_experts)
        return self.hosts[layer][expert]

    def _event(self):
        """An event after everything queued on the compute stream so far (None on CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _gpu_wait(self, events: list) -> None:
        """The compute stream waits for `events` (no host sync), timed: events recorded
        before and after the waits measure how long it stood still for them (the work
        queued before it done, the uploads not yet): the exposed upload time."""
        events = [e for e in events if e is not None]
        if not events:
            return
        stream = torch.cuda.current_stream(self.device)
        before, after = (torch.cuda.Event(enable_timing=True),
                         torch.cuda.Event(enable_timing=True))
        before.record(stream)
        for event in events:
            stream.wait_event(event)
        after.record(stream)
        self._stalls.append((before, after))

    def _time_uploads(self) -> None:
        while self._timing and self._timing[0][1].query():
            start, done = self._timing.popleft()
            self.stats.upload_seconds += start.elapsed_time(done) / 1e3
        while self._stalls and self._stalls[0][1].query():
            before, after = self._stalls.popleft()
            self.stats.exposed_seconds += before.elapsed_time(after) / 1e3

    def _point_evicted(self) -> None:
        """Rows of experts that hold no slot any more point at host RAM."""
        flat_rows, flat_slot = self.rows_host.reshape(-1), self.policy.slot.reshape(-1)
        gone = (flat_rows != self.host_rows.reshape(-1)) & (flat_slot < 0)
        flat_rows[gone] = self.host_rows.reshape(-1)[gone]

    def _point(self, keys) -> None:
        flat = self.rows_host.reshape(-1)
        for key in keys:
            flat[key] = self.policy.slot.reshape(-1)[key]

    def _push_rows(self) -> None:
        # NOTE: from pageable memory: the copy stages the table before returning, so the
        # host may change it at once; no device sync.
        self._pushed = self.rows_host.copy()  # what the device's table holds
        self._stale = False
        self.rows.copy_(torch.from_numpy(self._pushed), non_blocking=True)

    @staticmethod
    def _done(event) -> bool:
        return event is None or event.query()

    @staticmethod
    def _wait(event) -> None:
        if event is not None:
            event.synchronize()

    # -- the grouped path -------------------------------------------------------------

    def gather(self, layer: int, experts: list[int]) -> list[torch.Tensor]:
        """MoE layer `layer`'s experts `experts` as stacked weights on the device, one
        [E, out, in] tensor per projection (the others' rows left unset): resident ones
        gathered from their slots, the rest copied from host RAM."""
        rows = self.rows_host[layer]
        resident = [e for e in experts if rows[e] != self.host_rows[layer, e]]
        missed = [e for e in experts if rows[e] == self.host_rows[layer, e]]
        into = torch.tensor(resident, dtype=torch.long, device=self.device)
        slots = torch.tensor(rows[resident], dtype=torch.long, device=self.device)
        views = []
        for p in self.parts:
            stacked = torch.empty(self.num_experts, *p.shape, dtype=self.dtype,
                                  device=self.device)
            if resident:
                stacked[into] = self.pool[slots, p.start:p.end].view(len(resident), *p.shape)
            for e in missed:
                stacked[e].copy_(self.hosts[layer][e, p.start:p.end].view(*p.shape),
                                 non_blocking=True)
            if p.qtype is not None:
                stacked.qtype = p.qtype  # NOTE: read by grouped_mm
            views.append(stacked)
        return views

    def _projections(self) -> list:
        """The pool's views as the fused kernels take them: a [slots, out, in] tensor per
        projection, or (blocks, qtype) pairs."""
        views = []
        for p in self.parts:
            view = self.pool[:, p.start:p.end].view(self.pool.shape[0], *p.shape)
            views.append(view if p.qtype is None else (view, p.qtype))
        return views


def kind_of(layer: nn.Module) -> tuple:
    """What one cache holds one of: each projection's shape, dtype and GGUF format."""
    return tuple((tuple(w.shape), w.dtype, getattr(w, "qtype", None))
                 for w in (layer.gate_proj, layer.up_proj, layer.down_proj))


class ExpertCaches:
    """A stage's routed experts: one ExpertCache per kind of expert (a GGUF file may keep
    some layers' experts in other formats than the rest: Q4_K_M stores half the layers'
    down projections in Q6_K), the VRAM shared out in proportion to their bytes."""

    def __init__(self, layers: list[nn.Module], device: torch.device, size: tuple[str, float],
                 policy: str = "lfu", pcie_frac: float = 1.0, prefetch: int = 0,
                 predictors: list | None = None):
        """`size`: EngineConfig.expert_cache_size(), ("share", f), ("bytes", n) or
        ("auto", 0): 90% of the device's free memory (a CPU stage: everything).
        `predictors[i]`: layer i's router as a function of a hidden state -> expert ids
        [T, k]; with `prefetch` > 0 each layer predicts the next one's experts with it."""
        kinds: dict[tuple, list[nn.Module]] = {}
        for layer in layers:
            kinds.setdefault(kind_of(layer), []).append(layer)
        bytes_of = {k: sum(w[0].nbytes for w in (g[0].gate_proj, g[0].up_proj, g[0].down_proj))
                    for k, g in kinds.items()}  # one expert's bytes, per kind
        total = sum(bytes_of[k] * len(g) * g[0].num_experts for k, g in kinds.items())
        how, value = size
        if how == "auto":
            how, value = (("bytes", 0.9 * torch.cuda.mem_get_info(device)[0])
                          if device.type == "cuda" else ("share", 1.0))
        self.caches = []
        for k, group in kinds.items():
            experts = len(group) * group[0].num_experts
            if how == "share":
                slots = round(value * experts)
            else:  # this kind's part of the bytes, by its share of the experts' bytes
                slots = int(value * bytes_of[k] * experts / total // bytes_of[k])
            self.caches.append(ExpertCache(group, device, min(slots, experts), policy,
                                           pcie_frac, prefetch))
        if predictors is not None:
            for here, there, predict in zip(layers, layers[1:], predictors[1:]):
                if there.offload.cache.prefetch is not None:
                    there.offload.cache.prefetch.layers[there.offload.index] = True
                    here.offload.ahead = (there.offload, predict)

    def before_window(self) -> None:
        for cache in self.caches:
            cache.before_window()

    def after_window(self) -> None:
        for cache in self.caches:
            cache.after_window()

    def reset_usage(self) -> None:
        for cache in self.caches:
            cache.reset_usage()

    def take_stats(self) -> list[float]:
        """What the caches did since the last call, summed (ExpertStats' fields)."""
        return [sum(values) for values in zip(*(c.take_stats() for c in self.caches))]

    @property
    def pool_bytes(self) -> int:
        return sum(c.pool.nbytes for c in self.caches)


class CachedExperts:
    """One MoE layer's view of the stage's ExpertCache (GroupedExperts.offload)."""

    def __init__(self, cache: ExpertCache, index: int):
        self.cache, self.index = cache, index
        self.ahead = None  # (the next MoE layer's CachedExperts, its router), to prefetch

    def before(self, x: torch.Tensor) -> None:
        """At the layer's experts (x: their input): wait for this layer's prefetch, and
        start the next layer's from its router applied to x (prefetch.py)."""
        if self.cache.prefetch is not None:
            self.cache.prefetch.join(self.index)
        if self.ahead is not None:
            there, predict = self.ahead
            there.cache.prefetch.issue(there.index, predict(x))

    def fused(self, x: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
        from strata.layers import moe_triton
        cache = self.cache
        gate, up, down = cache.projections
        rows, usage = cache.rows[self.index], cache.usage[self.index]
        if cache.parts[0].qtype is not None:
            return moe_triton.fused_experts_quantized(x, experts, weights, gate, up, down,
                                                      rows=rows, usage=usage)
        return moe_triton.fused_experts(x, experts, weights, gate, up, down, rows=rows,
                                        usage=usage)

    def gathered(self, counts: torch.Tensor) -> list[torch.Tensor]:
        """The grouped path's weights: per projection a device tensor [E, out, in] (with
        its `qtype` if quantized) holding the experts that `counts` (pairs per expert)
        routes to, as the layer's own stacked weights would: the same products follow.
        Counts the pairs."""
        self.cache.usage[self.index] += counts.to(torch.int32)
        return self.cache.gather(self.index, counts.nonzero().flatten().tolist())
