"""Scheduler: admits requests into slots, builds windows, commits results.

Slots are split into groups (slot i belongs to group i % G); a window carries one group's
slots, and each group has at most one window in flight, so up to G windows travel the
stages at once. A new request takes a free slot of the group whose window is being built.

There are no prefill and decode phases: each slot's `num_computed` chases its request's
`num_tokens`. A window takes every decoding slot's last token, followed by that slot's
drafts, then fills the rest of its token budget with prompt chunks. Drafts are ordinary
tokens: committing moves `num_computed` past the accepted ones only, so the next window
starts at the first rejected position and overwrites it. A finished request frees its
slot and blocks at once.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager

import torch

from strata.request import Request, RequestStatus
from strata.kvcache.block_pool import BlockPool
from strata.scheduler.slot import Slot
from strata.scheduler.window import Window, WindowHeader
from strata.drafting.draft import Draft
from strata.drafting.policy import DraftPolicy
from strata.sampling.verifier import VerifyEntry

log = logging.getLogger("strata.scheduler")


class Scheduler:
    def __init__(self, num_slots: int, max_context: int, max_window_tokens: int,
                 block_size: int, drafts: DraftPolicy | None = None, lookahead: int = 0,
                 num_groups: int = 1):
        if not 1 <= num_groups <= num_slots:
            raise ValueError(f"{num_groups} groups for {num_slots} slots")
        blocks_per_slot = -(-max_context // block_size)
        # NOTE: every slot can always grow to max_context, so no request is ever preempted.
        self.pool = BlockPool(num_slots * blocks_per_slot, block_size)
        self.slots = [Slot(i, self.pool) for i in range(num_slots)]
        self.max_context, self.max_window_tokens = max_context, max_window_tokens
        self.drafts = drafts if drafts is not None and drafts.enabled else None
        self.lookahead = lookahead  # positions past a window the MTP layer writes
        self.waiting: deque[Request] = deque()
        self.num_groups = num_groups
        self.groups = [self.slots[g::num_groups] for g in range(num_groups)]
        self.in_flight: set[int] = set()  # groups whose window has not been committed yet
        self._next_group = 0  # round robin over idle groups
        self.failed: list[Request] = []  # failed while drafting; the next commit reports them

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
                self._release(slot)
                return request
        return None

    @property
    def has_work(self) -> bool:
        return (bool(self.waiting) or bool(self.in_flight)
                or any(not s.free for s in self.slots))

    @property
    def num_running(self) -> int:
        return sum(not s.free for s in self.slots)

    # -- windows --------------------------------------------------------------------------
    def schedule(self) -> Window | None:
        """The next window of an idle group with work (round robin), or None. The group
        stays in flight until its window is committed."""
        for i in range(self.num_groups):
            group = (self._next_group + i) % self.num_groups
            if group in self.in_flight:
                continue
            window = self._schedule_group(group)
            if window is not None:
                self._next_group = (group + 1) % self.num_groups
                self.in_flight.add(group)
                return window
        return None

    def _schedule_group(self, group: int) -> Window | None:
        self._admit(self.groups[group])
        busy = [s for s in self.groups[group] if s.num_pending > 0]
        busy.sort(key=lambda s: s.num_pending > 1)  # decoding slots first, then prompts
        budget = self.max_window_tokens
        entries: list[tuple[Slot, int]] = []
        for slot in busy:
            if budget == 0:
                break
            count = min(slot.num_pending, budget)
            slot.draft = None
            if slot.num_pending == 1 and self.drafts is not None:
                with self._isolated(slot):
                    slot.draft = self.drafts.draft(slot.request, self._room(slot, budget - 1))
                if slot.free:  # its proposer failed: the request failed with it
                    continue
                count += len(slot.draft.tokens) if slot.draft else 0
            entries.append((slot, count))
            budget -= count
        if not entries:
            return None
        return self._build(group, entries)

    def _room(self, slot: Slot, budget: int) -> int:
        """Most drafts a decoding slot may carry: within the window budget, the context,
        and the tokens the request may still produce (the last one needs no draft)."""
        request = slot.request
        room = min(budget, self.max_context - request.num_tokens)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - request.num_output_tokens - 1)
        return max(room, 0)

    def _admit(self, slots: list[Slot]) -> None:
        for slot in slots:
            if not self.waiting:
                return
            if slot.free:
                request = self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                slot.assign(request)
                if self.drafts is not None:
                    with self._isolated(slot):
                        self.drafts.admitted(request)

    def _build(self, group: int, entries: list[tuple[Slot, int]]) -> Window:
        tokens, positions, rows, tables = [], [], [], []
        samples, verify, following = [], [], []
        for slot, count in entries:
            request, start = slot.request, slot.num_computed
            slot.block_table.ensure(min(self.max_context, start + count + self.lookahead))
            end = start + count - slot.num_drafted  # end of the run's known tokens
            tokens.extend(request.token_ids[start:end])
            if slot.draft is not None:
                tokens.extend(slot.draft.tokens)
            positions.append(torch.arange(start, start + count))
            rows.append(slot.block_table.rows(start, start + count))
            tables.append(slot.block_table.blocks)
            sample = end == request.num_tokens
            samples.append(sample)
            following.append(None if sample else request.token_ids[end])
            if sample:
                verify.append(VerifyEntry(request.params, request.request_id,
                                          slot.draft.tokens if slot.draft else [],
                                          position=request.num_tokens))
        width = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), width, dtype=torch.long)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = torch.tensor(table)
        header = WindowHeader(
            group=group,
            query_lens=[count for _, count in entries],
            samples=samples,
            num_drafts=[slot.num_drafted for slot, _ in entries],
            token_ids=torch.tensor(tokens, dtype=torch.long),
            positions=torch.cat(positions),
            slot_mapping=torch.cat(rows),
            block_tables=block_tables,
            block_size=self.pool.block_size,
            verify=verify,
            following=following,
        )
        return Window(header, slots=[slot.index for slot, _ in entries],
                      requests=[slot.request for slot, _ in entries],
                      drafts=[slot.draft for slot, _ in entries])

    def commit(self, window: Window, results: list[list[int]],
               stage_drafts: list[Draft | None] | None = None,
               errors: list[str | None] | None = None,
               logprobs: list[list | None] | None = None) -> list[Request]:
        """Advance counts by the window and append each sampling entry's tokens (accepted
        drafts plus one, with their logprobs where asked); hand the drafts the last stage
        made for each sampling entry (MTP) to the proposers. An entry that failed on the
        last stage fails its request. Returns the requests that received tokens or failed,
        with those that failed since the last commit."""
        self.in_flight.discard(window.header.group)
        produced = iter(results)
        staged = iter(stage_drafts or [])
        failed = iter(errors or [])
        scored = iter(logprobs or [])
        updated = self.take_failed()
        for index, request, count, sample, draft in zip(
                window.slots, window.requests, window.header.query_lens, window.header.samples, window.drafts):
            slot = self.slots[index]
            tokens = next(produced) if sample else []
            drafted_on_stage = next(staged, None) if sample else None
            error = next(failed, None) if sample else None
            token_logprobs = next(scored, None) if sample else None
            if slot.request is not request:  # aborted while the window was in flight
                continue
            if error is not None:
                request.fail(error)
                updated.append(request)
                self._release(slot)
                continue
            drafted = len(draft.tokens) if draft is not None else 0
            accepted = len(tokens) - 1 if drafted else 0
            # The KV of rejected drafts stays in the cache; the next window overwrites it.
            slot.num_computed += count - (drafted - accepted)
            slot.draft = None
            if not sample:
                continue
            appended = request.extend(tokens, self.max_context)
            if token_logprobs is not None and request.logprobs is not None:
                request.logprobs.extend(token_logprobs[:len(appended)])
            updated.append(request)
            if self.drafts is not None:
                with self._isolated(slot):
                    if draft is not None:
                        self.drafts.record(request, draft, accepted)
                    self.drafts.committed(request, appended, drafted_on_stage)
            if request.finished and not slot.free:
                self._release(slot)
        self.failed = [r for r in self.failed if r not in updated]  # reported already
        return updated

    def take_failed(self) -> list[Request]:
        """Requests failed outside a commit (their proposer raised) not reported yet."""
        failed, self.failed = self.failed, []
        return failed

    @contextmanager
    def _isolated(self, slot: Slot):
        """A proposer that raises for a slot's request fails that request only: it is
        finished with the error, its slot freed, and reported by the next commit."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - one request's drafts must not stop the rest
            log.exception("drafting failed for %s", slot.request.request_id)
            request = slot.request
            if not request.finished:
                request.fail(f"drafting for this request failed ({type(e).__name__})")
                self.failed.append(request)
            self._release(slot)

    def _release(self, slot: Slot) -> None:
        if self.drafts is not None:
            try:
                self.drafts.finished(slot.request)
            except Exception:  # noqa: BLE001 - the slot is freed regardless
                log.exception("a proposer failed to forget %s", slot.request.request_id)
        slot.release()
