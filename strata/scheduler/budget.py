"""BlockBudget: the scheduler's count of KV blocks against a pool that may be smaller than
every slot's --max-context (--kv-tokens): which positions a window entry writes, how many
new blocks a window needs, whether a waiting request fits, and how a window is trimmed
when the pool is short.

When blocks run short: a request waits to be admitted until the pool has blocks for its
known tokens and one more (beyond those the prefix cache holds for it, and those running
requests still need for theirs); a window being built first loses the newest request's
drafts (they are guesses), then shrinks its newest prompt chunk, then the newest running
request of a group with no window in flight is preempted — unless that is one of this
window's own while other groups' windows are in flight: then the window waits for them.
A window in flight never loses a block, and the oldest request always progresses, since
the pool holds at least one --max-context.
"""

from __future__ import annotations

from collections.abc import Callable

from strata.kvcache.block_pool import BlockPool
from strata.request import Request
from strata.scheduler.slot import Slot

Entries = list[tuple[Slot, int]]  # (slot, tokens) of a window being built


class BlockBudget:
    def __init__(self, pool: BlockPool, max_context: int, mtp_drafts: int):
        self.pool, self.max_context, self.mtp_drafts = pool, max_context, mtp_drafts

    def extent(self, start: int, count: int) -> int:
        """End of the positions a window entry of `count` tokens from `start` may write:
        its own, then the MTP layer's chain of drafts after them."""
        if not self.mtp_drafts:
            return start + count
        return min(self.max_context, start + count + self.mtp_drafts + 1)

    def _blocks(self, positions: int) -> int:
        return -(-positions // self.pool.block_size)

    def needed(self, entries: Entries, ahead: list[tuple[int, int] | None] | None = None) -> int:
        """New blocks the entries' slots need for a window (`ahead`: a window built ahead,
        as in Scheduler._build)."""
        total = 0
        for e, (slot, count) in enumerate(entries):
            carried = ahead[e] if ahead else None
            start = slot.num_computed + (carried[1] if carried else 0)
            total += max(0, self._blocks(self.extent(start, count)) - len(slot.block_table.blocks))
        return total

    def admits(self, request: Request, hits: list[tuple[bytes, int | None]],
               running: list[Slot]) -> tuple[int, int]:
        """(blocks the request needs, blocks it can have) if admitted with the cached
        `hits`: the request fits when the first is at most the second."""
        on_device = [block for _, block in hits if block is not None]
        needed = self._blocks(self.extent(request.num_tokens, 1)) - len(on_device)
        promised = sum(max(0, self._blocks(self.extent(s.request.num_tokens, 1))
                           - len(s.block_table.blocks)) for s in running)
        return needed, self.pool.num_free - self.pool.num_idle(on_device) - promised

    def fit(self, entries: Entries, preemptable: list[Slot], others_in_flight: bool,
            preempt: Callable[[Slot], None]) -> Entries:
        """The window's entries trimmed to the blocks the pool can give (the module's
        docstring says how); `preemptable`: the slots of groups with no window in flight.
        No entries: the window waits."""
        size = self.pool.block_size
        while (short := self.needed(entries) - self.pool.num_free) > 0:
            newest = sorted(range(len(entries)), key=lambda i: -entries[i][0].request.arrival)
            drafted = [i for i in newest if entries[i][0].num_drafted]
            chunks = [i for i in newest
                      if entries[i][0].num_pending > 1 and self.needed([entries[i]])]
            if drafted:
                slot = entries[drafted[0]][0]
                slot.draft = None
                entries[drafted[0]] = (slot, 1)
            elif chunks:
                slot, count = entries[chunks[0]]
                keep = len(slot.block_table.blocks) + max(0, self.needed([(slot, count)]) - short)
                count = min(count, keep * size - self.extent(slot.num_computed, 0))
                if count > 0:
                    entries[chunks[0]] = (slot, count)
                else:
                    del entries[chunks[0]]
            else:
                victim = max((s for s in preemptable if not s.free),
                             key=lambda s: s.request.arrival, default=None)
                mine = any(s is victim for s, _ in entries)
                if victim is None or (mine and others_in_flight):
                    for slot, _ in entries:
                        slot.draft = None
                    return []
                entries = [(s, c) for s, c in entries if s is not victim]
                preempt(victim)
        return entries
