"""The expert cache's bookkeeping, without tensors: which (layer, expert) pairs hold a
VRAM slot, which of those are readable and which still wait for their upload, what each
window read, and which slot an expert that missed takes.

State is numpy arrays of shape [layers, experts] (the stage's MoE layers, counted from 0),
so one window's bookkeeping is a few vectorised passes whatever the model's size. A slot
is held by one expert; an expert whose slot is taken but whose bytes are not there yet is
`uploading` (read from host RAM until the upload is done). Two eviction policies:

    lru  the least recently used resident expert makes room; every miss is admitted.
    lfu  frequency-weighted LRU: among the EVICTION_WINDOW least recently used, the one
         of lowest decayed use count (each window multiplies the counts by DECAY and adds
         the window's uses); a miss is admitted only if its count beats that victim's,
         so a burst of one-off experts does not flush the hot ones.

Experts that the last window used are never evicted for another miss of it (a window's
union stays whole where it fits), nor are uploads in flight. A slot given up by its
expert may still be read by windows in flight: it is `draining` (owner DRAINING) until
the caller says those windows are done (`drained`), and only then free. `reserve` evicts
ahead of need, so that the next window's misses find free slots at once.

Prefetch (experts/prefetch.py) takes free slots the host `lend`s to a window (owner
LENT): the device copies the experts it predicts into some of them and points their rows
there. Once the window is observed, each slot it filled is `prefetched` (its expert's
slot, readable at once) and the rest `returned`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POLICIES = ("lru", "lfu")
FREE, DRAINING, LENT = -1, -2, -3  # `owner` of a slot that holds no expert
DECAY = 0.9           # lfu: a use count's weight per window that passes
EVICTION_WINDOW = 32  # lfu: the least recently used candidates it weighs


@dataclass(frozen=True)
class Admission:
    """Expert `key` (flat index layer * experts + expert) takes `slot`; `victim` (a flat
    key, or -1 for a free slot) gives it up."""
    key: int
    slot: int
    victim: int


@dataclass(frozen=True)
class Reads:
    """What one window read: distinct (layer, expert) pairs from VRAM and from host RAM."""
    hits: int
    misses: int
    missed: np.ndarray  # flat keys read from host RAM, most used first


class ExpertCachePolicy:
    def __init__(self, num_layers: int, num_experts: int, num_slots: int,
                 policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"unknown expert cache policy {policy!r}; choose one of "
                             f"{', '.join(POLICIES)}")
        if num_slots < 0:
            raise ValueError(f"the expert cache needs a slot count >= 0, not {num_slots}")
        self.num_layers, self.num_experts, self.num_slots = num_layers, num_experts, num_slots
        self.policy = policy
        shape = (num_layers, num_experts)
        self.slot = np.full(shape, -1, dtype=np.int64)   # the slot an expert holds, or -1
        self.ready = np.zeros(shape, dtype=bool)         # its bytes are in the slot
        self.last_use = np.zeros(shape, dtype=np.int64)  # the window that last used it
        self.count = np.zeros(shape, dtype=np.float64)   # lfu: decayed use count
        self.owner = np.full(num_slots, FREE, dtype=np.int64)  # flat key in each slot
        self.clock = 0  # windows observed

    @property
    def resident(self) -> np.ndarray:
        """[layers, experts] bool: readable from VRAM now."""
        return self.ready

    def fill(self) -> list[Admission]:
        """Start-up: every free slot given out, expert by expert across the layers (expert
        0 of each layer, then expert 1, ...), so each layer gets an equal share. The
        caller copies them before the first window and calls `uploaded`."""
        free = np.flatnonzero(self.owner == FREE)
        order = np.arange(self.num_layers * self.num_experts).reshape(
            self.num_layers, self.num_experts).T.reshape(-1)  # expert-major
        order = order[self.slot.reshape(-1)[order] < 0][:len(free)]
        return [self._take(int(key), int(slot), -1) for key, slot in zip(order, free)]

    def observe(self, used: np.ndarray, resident_then: np.ndarray) -> Reads:
        """One window's uses (`used` [layers, experts]: pairs routed to each expert) at
        the residency it ran with; updates recency and counts."""
        self.clock += 1
        hit = used > 0
        self.last_use[hit] = self.clock
        self.count *= DECAY
        self.count += used
        missed = hit & ~resident_then
        keys = np.flatnonzero(missed)
        keys = keys[np.argsort(-used.reshape(-1)[keys], kind="stable")]
        return Reads(int((hit & resident_then).sum()), int(missed.sum()), keys)

    def admit(self, missed: np.ndarray, limit: int | None = None) -> list[Admission]:
        """Slots for the experts of `missed` (flat keys, in order of preference) that hold
        none, at most `limit` of them: free slots first, then evictions (whose slots the
        caller fills once the windows reading the victims are done)."""
        flat_slot = self.slot.reshape(-1)
        wanted = [int(k) for k in missed if flat_slot[k] < 0]
        if limit is not None:
            wanted = wanted[:max(0, limit)]
        if not wanted:
            return []
        admissions = []
        free = list(np.flatnonzero(self.owner == FREE))
        victims = iter(self._victims(len(wanted) - min(len(free), len(wanted))))
        for key in wanted:
            if free:
                admissions.append(self._take(key, int(free.pop(0)), -1))
                continue
            victim = next(victims, None)
            if victim is None:
                break
            if self.policy == "lfu" and self.count.reshape(-1)[key] <= \
                    self.count.reshape(-1)[victim]:
                continue  # not used more than what it would evict
            admissions.append(self._take(key, int(flat_slot[victim]), victim))
        return admissions

    def reserve(self, n: int, floor: float | None = None) -> list[int]:
        """Evict up to n experts (lfu: only those used less than `floor`) so that n slots
        are free or draining; returns the slots now draining."""
        short = n - int((self.owner == FREE).sum()) - int((self.owner == DRAINING).sum())
        slots = []
        for victim in self._victims(short):
            if self.policy == "lfu" and floor is not None and \
                    self.count.reshape(-1)[victim] >= floor:
                continue
            slot = int(self.slot.reshape(-1)[victim])
            self.slot.reshape(-1)[victim] = -1
            self.ready.reshape(-1)[victim] = False
            self.owner[slot] = DRAINING
            slots.append(slot)
        return slots

    def drained(self, slots) -> None:
        """No window reads these draining slots any more: they are free."""
        for slot in slots:
            if self.owner[slot] == DRAINING:
                self.owner[slot] = FREE

    def lend(self, n: int) -> list[int]:
        """Up to n free slots for a window's prefetch: LENT until it is observed."""
        slots = [int(s) for s in np.flatnonzero(self.owner == FREE)[:max(0, n)]]
        self.owner[slots] = LENT
        return slots

    def prefetched(self, key: int, slot: int) -> bool:
        """A window copied expert `key` into its lent `slot`: the expert holds it, readable
        at once (True; unused by the window, it is among the first victims), unless it
        holds a slot already (False: the caller drains `slot`, which that window's rows
        table may point at)."""
        if self.owner[slot] != LENT:
            raise ValueError(f"slot {slot} was not lent for a prefetch")
        if self.slot.reshape(-1)[key] >= 0:
            self.owner[slot] = DRAINING
            return False
        self._take(key, slot, -1)
        self.ready.reshape(-1)[key] = True
        return True

    def returned(self, slots) -> None:
        """Lent slots that the window left empty (no window read them): free."""
        for slot in slots:
            if self.owner[slot] == LENT:
                self.owner[slot] = FREE

    def uploaded(self, keys) -> None:
        """The uploads of `keys` are done: they read from VRAM from now on."""
        for key in keys:
            layer, expert = divmod(int(key), self.num_experts)
            if self.slot[layer, expert] >= 0:
                self.ready[layer, expert] = True

    def _victims(self, n: int) -> list[int]:
        """Up to n resident experts to evict, best first: ready, not used by the last
        window. lru: least recently used; lfu: the lowest counts among the least recently
        used EVICTION_WINDOW (or n, if more)."""
        if n <= 0:
            return []
        ready = self.ready.reshape(-1) & (self.last_use.reshape(-1) < self.clock)
        keys = np.flatnonzero(ready)
        if not len(keys):
            return []
        recency = self.last_use.reshape(-1)[keys]
        if self.policy == "lru":
            pick = min(n, len(keys))
            order = np.argpartition(recency, pick - 1)[:pick] if pick < len(keys) else \
                np.arange(len(keys))
            order = order[np.argsort(recency[order], kind="stable")]
            return [int(k) for k in keys[order]]
        pool = min(len(keys), max(n, EVICTION_WINDOW))
        order = np.argsort(recency, kind="stable")[:pool]
        candidates = keys[order]
        counts = self.count.reshape(-1)[candidates]
        return [int(k) for k in candidates[np.argsort(counts, kind="stable")][:n]]

    def _take(self, key: int, slot: int, victim: int) -> Admission:
        if victim >= 0:
            self.slot.reshape(-1)[victim] = -1
            self.ready.reshape(-1)[victim] = False
        self.slot.reshape(-1)[key] = slot
        self.ready.reshape(-1)[key] = False
        self.owner[slot] = key
        return Admission(key, slot, victim)
