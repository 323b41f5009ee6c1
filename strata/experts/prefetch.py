"""Prefetch one layer ahead (--expert-prefetch): a MoE layer applies the next MoE layer's
router to its own input, and the experts it predicts that the next layer would read from
host RAM are copied into VRAM slots while this layer computes, so that the next layer
reads them from VRAM (pre-gated MoE: Hwang et al., ISCA 2024).

Everything happens on the device, inside the window (CUDA graphs capture it): the host
lends the window some free slots before it runs (policy.lend; `lend` holds a counter and
the slots), and per predicted layer, on a side stream:
  1. the predicted experts that miss (their rows point at host RAM), at most `per_layer`
     of them, most predicted first (by how many of the window's tokens chose them);
  2. each takes the next lent slot, while any are left (the counter advances);
  3. their rows point at the slots (nothing reads them until the next layer, which waits
     for the prefetch), and a copy kernel moves their bytes from host RAM (read by
     address, as the fused MoE kernels read misses) into the slots;
  4. what it did goes to `record` [layers, 2, per_layer] (experts, slots; -1: none).
The next layer's compute waits for its prefetch on the GPU (`join`); a late copy stalls
it, a wrong prediction costs PCIe bytes that no kernel reads. After the window the host
reads `record` and `predicted` (the counts of predicted experts) with the window's usage
counts: filled slots become their experts' (readable at once), the rest return free, and
recall (of the experts a predicted layer used, the share that was predicted) is counted.
Steps 1-3 are one Triton kernel (prefetch_triton.select) and the copy another: two
launches on the side stream per layer. On a CPU stage the same steps run at once in
PyTorch (`select_torch`), the copy as plain tensor copies.
"""

from __future__ import annotations

import numpy as np
import torch


class Prefetch:
    """One ExpertCache's prefetch state: its buffers on the device, and their host side."""

    def __init__(self, cache, per_layer: int):
        self.cache, self.per_layer = cache, per_layer
        layers, experts, device = len(cache.hosts), cache.num_experts, cache.device
        self.capacity = max(1, min(cache.policy.num_slots, per_layer * layers))
        self.lend = torch.empty(1 + self.capacity, dtype=torch.int64, device=device)
        self._set_lend([])
        self.record = torch.full((layers, 2, per_layer), -1, dtype=torch.int64, device=device)
        self.source = torch.full((layers, per_layer), -1, dtype=torch.int64, device=device)
        self.predicted = torch.zeros(layers, experts, dtype=torch.int32, device=device)
        self.host_rows = torch.from_numpy(cache.host_rows).to(device)
        self.layers = np.zeros(layers, dtype=bool)  # layers with a prediction (recall)
        self.lent: list[int] = []  # slots lent to the window about to run
        self._stream = torch.cuda.Stream(device) if cache.cuda else None
        self._pending: set[int] = set()  # layers whose prefetch the compute has not joined

    # -- the host, per window ---------------------------------------------------------

    def lend_slots(self) -> None:
        """Lend the next window what free slots there are (up to the capacity), unless
        slots are lent already to a window that has not handed them back (`take`): a
        before_window that a full ring of counts calls from after_window."""
        if self.lent:
            return
        self.lent = self.cache.policy.lend(self.capacity)
        self._set_lend(self.lent)

    def _set_lend(self, slots: list[int]) -> None:
        """`lend` on the device: the counter at 0, then `slots`, then -1."""
        values = np.full(1 + self.capacity, -1, dtype=np.int64)
        values[0] = 0
        values[1:1 + len(slots)] = slots
        # NOTE: from pageable memory, staged before the call returns; in stream order
        self.lend.copy_(torch.from_numpy(values), non_blocking=True)

    def take(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The window's record and predicted counts on their way to the host (pinned; read
        once the caller's event is done), its lent slots, and the buffers reset."""
        pin = self.cache.cuda
        record = torch.empty(self.record.shape, dtype=torch.int64, pin_memory=pin)
        record.copy_(self.record, non_blocking=True)
        predicted = torch.empty(self.predicted.shape, dtype=torch.int32, pin_memory=pin)
        predicted.copy_(self.predicted, non_blocking=True)
        self.record.fill_(-1)
        self.predicted.zero_()
        lent, self.lent = self.lent, []
        return record, predicted, lent

    def reset(self) -> None:
        """Forget what windows that were not real did (graph capture): nothing lent."""
        self.record.fill_(-1)
        self.predicted.zero_()
        self._set_lend([])
        self.cache.policy.returned(self.lent)
        self.lent = []

    # -- the device, per predicted layer ----------------------------------------------

    def issue(self, layer: int, experts: torch.Tensor) -> None:
        """Prefetch for MoE layer `layer` of the cache the experts predicted for it
        (`experts` [T, k], computed on the compute stream)."""
        flat = experts.reshape(-1)
        self.predicted[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        if self._stream is None:
            self._select_and_copy(layer)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(self._stream):
            self._select_and_copy(layer)
        self._pending.add(layer)

    def join(self, layer: int) -> None:
        """The compute stream waits for `layer`'s prefetch (no host sync), if one runs."""
        if layer in self._pending:
            self._pending.discard(layer)
            torch.cuda.current_stream(self.cache.device).wait_stream(self._stream)

    def _select_and_copy(self, layer: int) -> None:
        args = (self.predicted[layer], self.cache.rows[layer], self.host_rows[layer],
                self.lend, self.record[layer], self.source[layer])
        if self.cache.cuda:
            from strata.experts.prefetch_triton import copy_rows, select
            select(*args)
            copy_rows(self.cache.pool, self.source[layer], self.record[layer, 1])
            return
        select_torch(*args)
        for expert, slot in zip(*self.record[layer].tolist()):
            if slot >= 0:
                self.cache.pool[slot].copy_(self.cache.hosts[layer][expert])


def select_torch(predicted: torch.Tensor, rows: torch.Tensor, host_rows: torch.Tensor,
                 lend: torch.Tensor, record: torch.Tensor, source: torch.Tensor) -> None:
    """Steps 1 and 2 of the module, and the rows of the taken experts pointed at their
    slots (the compute waits for the copy: `join`): `predicted` [E] counts, `rows` and
    `host_rows` [E] a layer's; `lend` [1 + capacity] the window's counter and slots;
    writes `record` [2, N] (experts, slots; -1: none) and `source` [N] (the rows the
    experts are copied from; -1: none). Ties go to the lower expert id.
    prefetch_triton.select is this as one Triton kernel."""
    wanted = predicted * (rows == host_rows)
    n = min(record.shape[1], wanted.shape[0])
    expert = torch.argsort(-wanted, stable=True)[:n]
    chosen = (wanted[expert] > 0).long()
    capacity = lend.shape[0] - 1
    place = lend[0] + torch.cumsum(chosen, 0) - chosen  # each chosen's lent slot
    slot = torch.where((chosen > 0) & (place < capacity),
                       lend[1 + place.clamp(max=capacity - 1)], -1)
    took = slot >= 0  # lent slots come first in `lend`, then -1: a prefix of chosen
    lend[:1] += took.sum()
    record.fill_(-1)
    source.fill_(-1)
    record[0, :n] = torch.where(took, expert, -1)
    record[1, :n] = slot
    source[:n] = torch.where(took, rows[expert], -1)
    rows.scatter_(0, expert, torch.where(took, slot, rows[expert]))
