"""Scheduler: admits requests into slots, builds windows, commits results.

Slots are split into groups (slot i belongs to group i % G); a window carries one group's
slots, and each group has at most one window in flight (two with `ahead`, below), so up
to G windows travel the stages at once. A new request takes a free slot of the group whose window is being built.

There are no prefill and decode phases: each slot's `num_computed` chases its request's
`num_tokens`. A window takes every decoding slot's last token, followed by that slot's
drafts, then fills the rest of its token budget with prompt chunks. Drafts are ordinary
tokens: committing moves `num_computed` past the accepted ones only, so the next window
starts at the first rejected position and overwrites it. A finished request frees its
slot, its blocks and its state rows at once.

A decoding group can have a second window in flight (`ahead`), built while its first
computes. A slot that carries no drafts in the first window is one token on in the
second, its id carried over on the device from the first window's verification
(WindowHeader carry_rows). A slot that carries drafts in the first cannot know where it
goes on (which drafts pass decides that): with `hedge` it goes on in the second as a
hedge, one token on from its last known one as if every draft failed, with the token at
its first draft's position carried over (WindowHeader carry_first). If every draft fails,
that is the slot's next step; if one passes, the hedge is void: its result is dropped at
commit, and the KV it wrote is the accepted draft's again. Without `hedge` (or where no
other slot goes on, or the layers keep per-slot state) it sits the second out. Either way
it is back in the third, with its tokens known by then, and one slot's drafts never hold
up the others' windows. A draft must gain more than `window_cost` (the window its slot
may lose). A carried slot may draft in the second window too, after its token in flight:
its proposers, asked on the context it has, guess that token with their draft's first
token, and the window carries the rest after the carried one (only they count as gain;
verification checks them against the real token, so a wrong guess costs acceptance, never
fidelity). Where every slot of a window built ahead would draft on such a guess, none is
built: the next window drafts on their real tokens, and no slot waits for it. If the
first window ends a request (EOS, a stop id), the second window's entry for it is dropped
at commit, like an aborted one's.

Allocation covers every kind of layer cache (kvcache/spec.py): KV blocks as a slot's
sequence grows (counted by budget.py, which also says what happens when a pool smaller
than every slot's context runs short: wait, trim, preempt), and `state_rows_per_slot` rows
of per-slot state from admission to finish (plus a snapshot row for prefix reuse:
snapshots.py).
State rows are versions: a window reads its entry's state from the slot's current row and
writes the state after its last known token and after each draft to the slot's other rows
in order (WindowHeader.state_rows); committing j accepted drafts makes the (1 + j)-th of
those the current row. So drafts roll back by choosing a row, in every group and stage, and
a slot needs 2 + its longest draft rows (`max_drafts` caps drafts to fit). A window built
ahead reads a carried slot's state from the row its window in flight writes.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager

import torch

from strata.drafting.draft import Draft
from strata.drafting.policy import DraftPolicy
from strata.errors import StrataError
from strata.kvcache.block_pool import BlockPool, RowPool
from strata.kvcache.host import HostCache
from strata.kvcache.spec import CacheSize
from strata.request import Request, RequestStatus
from strata.sampling.verifier import VerifyEntry
from strata.scheduler.budget import BlockBudget
from strata.scheduler.slot import Slot
from strata.scheduler.snapshots import SnapshotKeeper
from strata.scheduler.window import Window, WindowHeader, num_committed

log = logging.getLogger("strata.scheduler")


class Scheduler:
    def __init__(self, num_slots: int, max_context: int, max_window_tokens: int,
                 block_size: int, drafts: DraftPolicy | None = None, mtp_drafts: int = 0,
                 num_groups: int = 1, state_rows_per_slot: int = 0, ahead: bool = False,
                 window_cost: float = 0.0, max_drafts: int | None = None,
                 prefix_cache: bool = False, kv_tokens: int | None = None,
                 host_blocks: int = 0, host_conversations: int = 32,
                 state_snapshots: int = 0, hedge: bool = False):
        """`mtp_drafts`: the longest chain the model's MTP layer drafts on the last stage
        (0: none); `state_rows_per_slot`: rows of per-slot state the model's layers keep;
        `ahead`: build a decoding group's next window while its last computes (the runner
        carries the tokens over on its device; not with MTP drafts); `window_cost`: the
        least net gain of a draft worth sending when windows go ahead; `max_drafts`: the
        most drafts one window carries for a slot (None: no cap); `prefix_cache`: a
        request starts from cached blocks of its prompt's prefix (kvcache/prefix.py);
        `kv_tokens`: the block pool's tokens (None: every slot can reach `max_context`);
        `host_blocks`: blocks of the conversation cache in host RAM, kept for the last
        `host_conversations` requests' blocks (kvcache/host.py; with the prefix cache);
        `state_snapshots`: for layers with per-slot state, finished requests' states at a
        block boundary kept for prefix reuse (kvcache/snapshots.py; 0: such models do not
        reuse prefixes); `hedge`: with `ahead`, a slot with drafts in the window in flight
        goes on in the window built ahead as if they all failed (not for per-slot state,
        whose rows that entry would write)."""
        if not 1 <= num_groups <= num_slots:
            raise ValueError(f"{num_groups} groups for {num_slots} slots")
        blocks_per_slot = -(-max_context // block_size)
        num_blocks = (-(-kv_tokens // block_size) if kv_tokens is not None
                      else num_slots * blocks_per_slot)
        if num_blocks < blocks_per_slot:
            raise StrataError(f"--kv-tokens {kv_tokens} holds fewer tokens than --max-context "
                              f"{max_context}, so one request could not reach its context; "
                              "raise --kv-tokens or lower --max-context")
        host = HostCache(host_blocks, host_conversations) if host_blocks else None
        self.pool = BlockPool(num_blocks, block_size, prefix_cache, host)
        self.preemptions = 0  # running requests whose blocks were taken back
        self._told_waiting: set[str] = set()  # requests logged as waiting for blocks
        self._arrivals = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache saved (all requests)
        snapshots = bool(state_rows_per_slot and prefix_cache and state_snapshots)
        self.state_rows = RowPool(num_slots * (state_rows_per_slot + snapshots)
                                  + (state_snapshots if snapshots else 0))
        self.state_rows_per_slot = state_rows_per_slot
        self.keeper = (SnapshotKeeper(state_snapshots, self.state_rows, block_size,
                                      lag=1 if mtp_drafts else 0) if snapshots else None)
        self.max_drafts = max_drafts
        drafting = drafts is not None and drafts.enabled
        if state_rows_per_slot:
            longest = (max_drafts if max_drafts is not None else max_window_tokens) \
                if drafting else 0
            if state_rows_per_slot < 2 + longest:
                raise ValueError(f"{state_rows_per_slot} state rows per slot cannot hold the "
                                 f"states of {longest} drafts (2 + drafts rows needed)")
        self.slots = [Slot(i, self.pool, self.state_rows, state_rows_per_slot, snapshots)
                      for i in range(num_slots)]
        self.max_context, self.max_window_tokens = max_context, max_window_tokens
        self.drafts = drafts if drafts is not None and drafts.enabled else None
        self.mtp_drafts = mtp_drafts
        self.budget = BlockBudget(self.pool, max_context, mtp_drafts)
        self.cache_size = CacheSize(self.pool.num_blocks, block_size, self.state_rows.size,
                                    blocks_per_slot,
                                    self.pool.host.num_blocks if self.pool.host is not None else 0)
        self.waiting: deque[Request] = deque()
        self.num_groups = num_groups
        self.groups = [self.slots[g::num_groups] for g in range(num_groups)]
        self.in_flight: dict[int, int] = {}  # group -> its windows not committed yet
        self.ahead = ahead and not mtp_drafts
        self.window_cost = window_cost if self.ahead else 0.0
        self.hedge = hedge and self.ahead and not state_rows_per_slot
        self.hedges_taken = self.hedges_void = 0  # hedges committed, and dropped as void
        self._latest: dict[int, Window] = {}  # each group's last window scheduled
        self._next_group = 0  # round robin over idle groups
        self.failed: list[Request] = []  # failed while drafting; the next commit reports them

    # -- requests -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._arrivals += 1
        request.arrival = self._arrivals
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self._told_waiting.discard(request.request_id)
                request.finish("abort")
                if request.num_preemptions:  # its proposers still know it
                    self._forget(request)
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
        self._price_load()
        for i in range(self.num_groups):
            group = (self._next_group + i) % self.num_groups
            if group in self.in_flight:
                continue
            window = self._schedule_group(group)
            if window is not None:
                self._next_group = (group + 1) % self.num_groups
                self._launched(window)
                return window
        return None

    def schedule_ahead(self) -> Window | None:
        """A decoding group's next window, built while its window in flight computes: each
        slot without drafts in that window one token on, that token carried over on the
        device (and maybe drafts after a guess of it), beside the slots that sat that
        window out (their tokens known here). None where no group has exactly one window
        in flight with a slot to carry on from."""
        if not self.ahead:
            return None
        self._price_load()
        for group, count in self.in_flight.items():
            if count == 1 and (window := self._schedule_ahead(group)) is not None:
                self._launched(window)
                return window
        return None

    def _price_load(self) -> None:
        """Tell load pricing how many groups have work: the requests in slots, and those
        waiting for a free one."""
        load = self.drafts.load if self.drafts is not None else None
        if load is not None:
            busy = sum(any(not s.free for s in group) for group in self.groups)
            free = sum(all(s.free for s in group) for group in self.groups)
            load.load(busy + min(len(self.waiting), free))

    def _launched(self, window: Window) -> None:
        group = window.header.group
        self.in_flight[group] = self.in_flight.get(group, 0) + 1
        self._latest[group] = window

    def _schedule_ahead(self, group: int) -> Window | None:
        last = self._latest[group]
        header = last.header
        if header.logits_all or not all(header.samples):
            return None  # prompt chunks in flight: the next window depends on them
        busy = [s for s in self.groups[group] if not s.free]
        if self.waiting and len(busy) < len(self.groups[group]):
            return None  # a request to admit: the next window takes it
        in_last = {index: (e, request, count, drafted) for e, (index, request, count, drafted)
                   in enumerate(zip(header.slots, last.requests, header.query_lens,
                                    header.num_drafts))
                   if not self._void_hedge(last, e)}
        # (A hedge in flight that is void already leaves its slot's tokens known here, as
        # if it had sat that window out.)
        budget = self.max_window_tokens
        entries: list[tuple[Slot, int]] = []
        ahead: list[tuple[int, int] | None] = []
        hedges: list[bool] = []
        for slot in busy:
            if slot.index in in_last:
                e, request, count, drafted = in_last[slot.index]
                if slot.request is not request:
                    return None
                if drafted and not self.hedge:
                    continue  # which drafts pass decides its next tokens: it sits this one out
                if slot.num_computed + count - drafted != request.num_tokens:
                    return None
                if not self._continues(request):
                    return None
                if drafted:  # a hedge: one token on from its last known one, no drafts
                    slot.draft, tokens = None, 1
                else:
                    tokens = self._on_a_guess(slot, budget, len(busy), len(busy))
                    if tokens is None:
                        continue
                entries.append((slot, tokens))
                ahead.append((e, count - drafted))
                hedges.append(bool(drafted))
            elif slot.num_pending == 1:  # it sat out the window in flight: its token is known
                tokens = self._with_draft(slot, budget, len(busy), len(busy))
                if tokens is None:
                    continue
                entries.append((slot, tokens))
                ahead.append(None)
                hedges.append(False)
            else:
                return None  # a prompt to prefill: the next window takes it
            budget -= entries[-1][1]
            if budget <= 0:
                break
        guessing = all(carried and slot.draft for (slot, _), carried in zip(entries, ahead))
        if (not any(a is not None and not h for a, h in zip(ahead, hedges)) or guessing
                or self.budget.needed(entries, ahead) > self.pool.num_free):
            for slot, _ in entries:
                slot.draft = None
            # Nothing depends on the window in flight but hedges (a window of them alone
            # would cost the host as much as any), or every slot would draft on a guess of
            # its token (their next window drafts on the real one, and no slot waits for
            # it), or the pool is short (the next window finds room or makes it).
            return None
        return self._build(group, entries, ahead=ahead, hedges=hedges)

    def _void_hedge(self, window: Window, entry: int) -> bool:
        """Is the window's entry a hedge made void by a draft before it that passed (its
        slot's committed length is past the hedge's start)?"""
        return bool(window.hedges) and window.hedges[entry] and (
            window.header.starts[entry] != self.slots[window.header.slots[entry]].num_computed)

    def _on_a_guess(self, slot: Slot, budget: int, window_tokens: int,
                    slots: int) -> int | None:
        """A carried slot's tokens in the window built ahead: the token in flight, then
        the drafts the policy picks after its proposers' guess of that token (their
        draft's first token, on the context the slot has here): only the tokens after it
        count, and they must gain more than `window_cost` (the slot sits out the window
        built ahead of this one). Lossless: the window computes the real token, and each
        draft is verified against it. None if its proposer failed (the request failed
        with it)."""
        slot.draft = None
        if self.drafts is None:
            return 1
        with self._isolated(slot):
            slot.draft = self.drafts.draft(slot.request, 1 + self._room(slot, budget - 1, 1),
                                           self.window_cost, known=1,
                                           window_tokens=window_tokens, slots=slots)
        if slot.free:
            return None
        return 1 + slot.num_drafted

    def _continues(self, request: Request) -> bool:
        """Can the request take two more tokens (the window in flight's, and one more)?"""
        params = request.params
        if (params.max_tokens is not None
                and params.max_tokens - request.num_output_tokens < 2):
            return False
        return request.num_tokens + 2 <= self.max_context

    def _schedule_group(self, group: int) -> Window | None:
        self._admit(self.groups[group])
        busy = [s for s in self.groups[group] if s.num_pending > 0]
        busy.sort(key=lambda s: s.num_pending > 1)  # decoding slots first, then prompts
        budget = self.max_window_tokens
        entries: list[tuple[Slot, int]] = []
        tokens = sum(s.num_pending == 1 for s in busy)  # the window's, before any draft
        together = self.drafts is not None and self.drafts.load is not None
        if together:  # load pricing: the decoding slots' drafts are decided together
            self._draft_together(group, [s for s in busy if s.num_pending == 1][:budget],
                                 budget)
        for slot in busy:
            if budget == 0:
                break
            if slot.free:
                continue  # its proposer failed: the request failed with it
            if slot.num_pending == 1 and together:
                count = 1 + slot.num_drafted
            elif slot.num_pending == 1:
                count = self._with_draft(slot, budget, tokens, len(busy))
                if count is None:
                    continue
                tokens += count - 1
            else:
                slot.draft, count = None, min(slot.num_pending, budget)
                if slot.snapshot_row is not None:
                    count = self.keeper.chunk(slot, count)
            entries.append((slot, count))
            budget -= count
        preemptable = [s for g, group in enumerate(self.groups) if g not in self.in_flight
                       for s in group]
        entries = self.budget.fit(entries, preemptable, bool(self.in_flight), self._preempt)
        if not entries:
            return None
        return self._build(group, entries)

    def _with_draft(self, slot: Slot, budget: int, window_tokens: int = 1,
                    slots: int = 1) -> int | None:
        """A decoding slot's tokens in the next window: its last one and the drafts the
        policy picks (None if its proposer failed: the request failed with it). A draft
        must gain more than `window_cost`: the slot then sits out the window built ahead
        of this one. `window_tokens`: the window's tokens so far, without this draft;
        `slots`: the slots the window carries."""
        slot.draft = None
        if self.drafts is not None:
            with self._isolated(slot):
                slot.draft = self.drafts.draft(slot.request, self._room(slot, budget - 1),
                                               self.window_cost,
                                               window_tokens=window_tokens, slots=slots)
            if slot.free:
                return None
        return 1 + (len(slot.draft.tokens) if slot.draft else 0)

    def _draft_together(self, group: int, slots: list[Slot], budget: int) -> None:
        """Set the drafts of a window's decoding slots, decided together by the policy
        (load pricing); a slot whose proposer fails is freed with its request failed."""
        rooms = [self._room(slot, budget - len(slots)) for slot in slots]
        requests = [slot.request for slot in slots]
        for slot in slots:
            slot.draft = None
        try:
            drafts = self.drafts.draft_window(requests, rooms, budget - len(slots), len(slots),
                                              self.window_cost, group=group)
        except Exception:  # noqa: BLE001 - find the slot whose proposer fails, alone
            drafts = []
            for slot, room in zip(slots, rooms):
                draft = None
                with self._isolated(slot):
                    draft = self.drafts.draft_window([slot.request], [room], room, 1,
                                                     self.window_cost, group=group)[0]
                drafts.append(None if slot.free else draft)
        for slot, draft in zip(slots, drafts):
            if not slot.free:
                slot.draft = draft

    def _room(self, slot: Slot, budget: int, in_flight: int = 0) -> int:
        """Most drafts a decoding slot may carry: within the window budget, the context,
        and the tokens the request may still produce (the last one needs no draft), with
        `in_flight` tokens of it decided by a window in flight."""
        request = slot.request
        room = min(budget, self.max_context - request.num_tokens - in_flight)
        if self.max_drafts is not None:
            room = min(room, self.max_drafts)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - request.num_output_tokens - 1
                       - in_flight)
        return max(room, 0)

    def _admit(self, slots: list[Slot]) -> None:
        """Give free slots to waiting requests, oldest first, while the pool has the blocks
        for their known tokens and one more (beyond those the prefix cache holds), after
        the blocks running requests still need for theirs; the first that does not fit
        waits, and the requests behind it with it."""
        size = self.pool.block_size
        for slot in slots:
            if not self.waiting:
                return
            if not slot.free:
                continue
            request = self.waiting[0]
            hits = self.pool.cached_prefix(request.token_ids, (request.num_tokens - 1) // size) \
                if request.reuse_prefix else []
            snapshot = None
            if self.state_rows_per_slot:  # the state after the last reused block is needed
                hits, snapshot = self.keeper.reusable(hits) if self.keeper else ([], None)
            needed, free = self.budget.admits(request, hits,
                                              [s for s in self.slots if not s.free])
            if needed > free:
                if request.request_id not in self._told_waiting:
                    self._told_waiting.add(request.request_id)
                    log.info("request %s waits for KV blocks: it needs %d, %d are free "
                             "(--kv-tokens)", request.request_id, needed, self.pool.num_free)
                return
            self.waiting.popleft()
            self._told_waiting.discard(request.request_id)
            request.status = RequestStatus.RUNNING
            slot.assign(request)
            slot.reuse_prefix(hits, replay=bool(self.mtp_drafts))
            if self.keeper is not None:
                self.keeper.start(slot, snapshot)
            if request.num_preemptions:
                continue  # its proposers kept it, its cached tokens were counted
            request.num_cached_tokens = slot.num_computed
            self.cached_tokens += slot.num_computed
            if self.drafts is not None:
                with self._isolated(slot):
                    self.drafts.admitted(request)

    def _preempt(self, slot: Slot) -> None:
        """Take a running request's blocks back: it waits again, in arrival order, and
        computes its tokens again when admitted (from cached blocks where it can)."""
        request = slot.request
        request.num_preemptions += 1
        self.preemptions += 1
        log.warning("KV blocks ran out (%d of %d free, --kv-tokens %d): request %s is "
                    "preempted after %d tokens and computes them again when blocks free up",
                    self.pool.num_free, self.pool.num_blocks,
                    self.pool.num_blocks * self.pool.block_size, request.request_id,
                    request.num_tokens)
        request.status = RequestStatus.WAITING
        self._remember(slot)
        if self.keeper is not None:
            self.keeper.keep(slot)
        slot.release()
        later = next((i for i, r in enumerate(self.waiting) if r.arrival > request.arrival),
                     len(self.waiting))
        self.waiting.insert(later, request)

    def _build(self, group: int, entries: list[tuple[Slot, int]],
               ahead: list[tuple[int, int] | None] | None = None,
               hedges: list[bool] | None = None) -> Window:
        """`ahead`: a window built ahead of the group's window in flight. Per entry, None
        (its tokens are known here) or (its entry in the window in flight, the tokens it
        computes there): the entry is then the one token that window samples for it.
        `hedges`: per entry, is it a hedge (its entry in flight carries drafts: the token
        it takes is the one at the first draft's position, `carry_first`)."""
        tokens, positions, rows, tables, sample_rows = [], [], [], [], []
        samples, verify, following, mtp_rows, mtp_lens = [], [], [], [], []
        starts, carry_rows, carry_from, carry_first, state_rows = [], [], [], [], []
        offset = 0  # window row of the entry's first token
        for e, (slot, count) in enumerate(entries):
            carried = ahead[e] if ahead else None
            request = slot.request
            start = slot.num_computed + (carried[1] if carried else 0)
            num_tokens = request.num_tokens + (1 if carried else 0)
            if carried:
                carry_rows.append(offset)
                carry_from.append(carried[0])
                carry_first.append(self._latest[group].drafts[carried[0]].tokens[0]
                                   if hedges and hedges[e] else -1)
            if self.state_rows_per_slot:  # a carried slot goes on from its window in flight
                source = (self._latest[group].header.state_rows[carried[0], 1].item()
                          if carried else slot.state_current)
                state_rows.append(slot.state_order(source))
            replay = start == len(slot.keys) * self.pool.block_size - 1 and self.mtp_drafts
            if start < len(slot.keys) * self.pool.block_size and not replay:
                raise RuntimeError(f"a window would write position {start} of slot "
                                   f"{slot.index}, inside its shared or cached blocks")
            starts.append(start)
            # Positions the MTP layer may reach: the window's, then its chain of drafts.
            mtp_end = self.budget.extent(start, count)
            slot.block_table.ensure(mtp_end)
            end = start + count - slot.num_drafted  # end of the run's known tokens
            tokens.extend(request.token_ids[start:end] if not carried else [0] * (end - start))
            if slot.draft is not None:
                tokens.extend(slot.draft.tokens)
            positions.extend(range(start, start + count))
            entry_rows = slot.block_table.rows(start, start + count)
            if replay:  # the last cached token runs again for its hidden state: its KV
                entry_rows[0] = self.cache_size.padding_block * self.pool.block_size  # is cached
            rows.extend(entry_rows)
            tables.append(slot.block_table.blocks)
            sample = end == num_tokens
            samples.append(sample)
            following.append(None if sample else request.token_ids[end])
            if sample:  # the verifier reads the last known token's row and each draft's
                sample_rows.extend(range(offset + count - 1 - slot.num_drafted,
                                         offset + count))
                verify.append(VerifyEntry(request.params, request.request_id,
                                          slot.draft.tokens if slot.draft else [],
                                          position=num_tokens))
            if self.mtp_drafts:  # MTP positions p + 1: the committed ones, then its chain
                mtp_rows.append(slot.block_table.rows(start + 1, mtp_end))
                mtp_lens.append(mtp_end - start - 1)
            offset += count
        spills, restores = self.pool.take_moves()
        header = WindowHeader(
            group=group,
            slots=[slot.index for slot, _ in entries],
            starts=starts,
            query_lens=[count for _, count in entries],
            samples=samples,
            num_drafts=[slot.num_drafted for slot, _ in entries],
            token_ids=torch.tensor(tokens, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slot_mapping=torch.tensor(rows, dtype=torch.long),
            block_tables=_padded(tables),
            block_size=self.pool.block_size,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
            verify=verify,
            following=following,
            state_rows=(torch.tensor(state_rows, dtype=torch.long)
                        if self.state_rows_per_slot else None),
            mtp_rows=_padded(mtp_rows) if self.mtp_drafts else None,
            mtp_lens=mtp_lens if self.mtp_drafts else None,
            carry_rows=carry_rows,
            carry_from=carry_from,
            carry_first=carry_first if any(t >= 0 for t in carry_first) else [],
            spills=spills,
            restores=restores,
            state_copies=self.keeper.take_copies() if self.keeper is not None else [],
        )
        return Window(header, requests=[slot.request for slot, _ in entries],
                      drafts=[slot.draft for slot, _ in entries], hedges=hedges or [])

    def commit(self, window: Window, results: list[list[int]],
               stage_drafts: list[Draft | None] | None = None,
               errors: list[str | None] | None = None,
               logprobs: list[list | None] | None = None) -> list[Request]:
        """Advance counts by the window and append each sampling entry's tokens (accepted
        drafts plus one, with their logprobs where asked); hand the drafts the last stage
        made for each sampling entry (MTP) to the proposers. An entry that failed on the
        last stage fails its request. Returns the requests that received tokens or failed,
        with those that failed since the last commit."""
        group = window.header.group
        self.in_flight[group] -= 1
        if not self.in_flight[group]:
            del self.in_flight[group]
        produced = iter(results)
        staged = iter(stage_drafts or [])
        failed = iter(errors or [])
        scored = iter(logprobs or [])
        updated = self.take_failed()
        header = window.header
        for entry_index, (index, request, count, sample, draft) in enumerate(zip(
                header.slots, window.requests, header.query_lens, header.samples,
                window.drafts)):
            slot = self.slots[index]
            tokens = next(produced) if sample else []
            drafted_on_stage = next(staged, None) if sample else None
            error = next(failed, None) if sample else None
            token_logprobs = next(scored, None) if sample else None
            if slot.request is not request:  # aborted while the window was in flight
                continue
            if window.hedges and window.hedges[entry_index]:
                if self._void_hedge(window, entry_index):
                    self.hedges_void += 1  # its result is stale: dropped
                    continue
                self.hedges_taken += 1
            if error is not None:
                request.fail(error)
                updated.append(request)
                self._release(slot)
                continue
            drafted = len(draft.tokens) if draft is not None else 0
            accepted = max(len(tokens) - 1, 0)
            # The KV of rejected drafts stays in the cache; the next window overwrites it.
            slot.num_computed += num_committed(count, drafted, accepted)
            if header.state_rows is not None:  # the state after the last committed token
                slot.state_current = int(header.state_rows[entry_index, 1 + accepted])
                if slot.snapshot_row is not None:
                    self.keeper.committed(slot, header.state_rows[entry_index],
                                          header.starts[entry_index], count, drafted, accepted)
            slot.draft = None
            if not sample:
                if self.pool.prefix is not None:
                    slot.register_blocks()
                continue
            appended = request.extend(tokens, self.max_context)
            if self.pool.prefix is not None:  # the accepted drafts are tokens now
                slot.register_blocks()
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
        self._forget(slot.request)
        self._remember(slot)
        if self.keeper is not None:
            self.keeper.keep(slot)
        slot.release()

    def _remember(self, slot: Slot) -> None:
        """Keep the slot's full committed blocks for its conversation's next turn: in the
        host cache when the device needs them (kvcache/host.py)."""
        if self.pool.host is not None:
            self.pool.host.remember(slot.keys)

    def _forget(self, request: Request) -> None:
        """The proposers let go of a finished request."""
        if self.drafts is not None:
            try:
                self.drafts.finished(request)
            except Exception:  # noqa: BLE001 - the slot is freed regardless
                log.exception("a proposer failed to forget %s", request.request_id)


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """Lists of ints as one [len(rows), longest] tensor, padded with 0."""
    width = max(len(r) for r in rows)
    return torch.tensor([[*r, *[0] * (width - len(r))] for r in rows], dtype=torch.long)
