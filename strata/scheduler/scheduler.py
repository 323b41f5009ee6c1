"""Scheduler: admits requests into slots, builds windows, commits results.

There are no prefill and decode phases: each slot's `num_computed` chases its request's
`num_tokens`. A window takes one token from every slot that is decoding, then fills
the rest of its token budget with prompt chunks. Committing advances the counts and
appends sampled tokens; a finished request frees its slot and blocks at once.
"""

from __future__ import annotations

from collections import deque

import torch

from strata.engine.request import Request, RequestStatus
from strata.kvcache.block_pool import BlockPool
from strata.scheduler.slot import Slot
from strata.scheduler.window import Window


class Scheduler:
    def __init__(self, num_slots: int, max_context: int, max_window_tokens: int,
                 block_size: int):
        blocks_per_slot = -(-max_context // block_size)
        # NOTE: every slot can always grow to max_context, so no request is ever preempted.
        self.pool = BlockPool(num_slots * blocks_per_slot, block_size)
        self.slots = [Slot(i, self.pool) for i in range(num_slots)]
        self.max_context, self.max_window_tokens = max_context, max_window_tokens
        self.blocks_per_slot = blocks_per_slot
        self.waiting: deque[Request] = deque()

    # -- requests -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                request.finish("abort")
                return request
        for slot in self.slots:
            if slot.request is not None and slot.request.request_id == request_id:
                request = slot.request
                request.finish("abort")
                slot.release()
                return request
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(not s.free for s in self.slots)

    @property
    def num_running(self) -> int:
        return sum(not s.free for s in self.slots)

    # -- windows --------------------------------------------------------------------------
    def schedule(self) -> Window | None:
        self._admit()
        busy = [s for s in self.slots if s.num_pending > 0]
        busy.sort(key=lambda s: s.num_pending > 1)  # decoding slots first, then prompts
        budget = self.max_window_tokens
        entries: list[tuple[Slot, int]] = []
        for slot in busy:
            if budget == 0:
                break
            count = min(slot.num_pending, budget)
            entries.append((slot, count))
            budget -= count
        if not entries:
            return None
        return self._build(entries)

    def _admit(self) -> None:
        for slot in self.slots:
            if not self.waiting:
                return
            if slot.free:
                request = self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                slot.assign(request)

    def _build(self, entries: list[tuple[Slot, int]]) -> Window:
        tokens, positions, rows, tables = [], [], [], []
        for slot, count in entries:
            start = slot.num_computed
            slot.block_table.ensure(start + count)
            tokens.extend(slot.request.token_ids[start:start + count])
            positions.append(torch.arange(start, start + count))
            rows.append(slot.block_table.rows(start, start + count))
            tables.append(slot.block_table.blocks)
        width = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), width, dtype=torch.long)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = torch.tensor(table)
        return Window(
            group=0,
            slots=[slot.index for slot, _ in entries],
            requests=[slot.request for slot, _ in entries],
            query_lens=[count for _, count in entries],
            samples=[slot.num_computed + count == slot.request.num_tokens
                     for slot, count in entries],
            token_ids=torch.tensor(tokens, dtype=torch.long),
            positions=torch.cat(positions),
            slot_mapping=torch.cat(rows),
            block_tables=block_tables,
            block_size=self.pool.block_size,
        )

    def commit(self, window: Window, sampled: list[int]) -> list[Request]:
        """Advance counts by the window and append sampled tokens (one per sampling
        entry, in order). Returns the requests that received a token."""
        tokens = iter(sampled)
        updated = []
        for index, request, count, sample in zip(window.slots, window.requests,
                                                 window.query_lens, window.samples):
            slot = self.slots[index]
            if slot.request is not request:  # aborted while the window was in flight
                if sample:
                    next(tokens)
                continue
            slot.num_computed += count
            if sample:
                request.append(next(tokens), self.max_context)
                updated.append(request)
                if request.finished:
                    slot.release()
        return updated
