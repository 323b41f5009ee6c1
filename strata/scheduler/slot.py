"""Slot: one of the P places a running request occupies, with its KV blocks."""

from __future__ import annotations

from strata.request import Request
from strata.kvcache.block_pool import BlockPool, BlockTable
from strata.drafting.draft import Draft


class Slot:
    def __init__(self, index: int, pool: BlockPool):
        self.index = index
        self.block_table = BlockTable(pool)
        self.request: Request | None = None
        self.num_computed = 0  # tokens of the request whose KV is in the cache
        self.draft: Draft | None = None  # drafts carried by the slot's window in flight

    @property
    def free(self) -> bool:
        return self.request is None

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model (the last known token included)."""
        return 0 if self.request is None else self.request.num_tokens - self.num_computed

    @property
    def num_drafted(self) -> int:
        return len(self.draft.tokens) if self.draft is not None else 0

    def assign(self, request: Request) -> None:
        self.request, self.num_computed = request, 0

    def release(self) -> None:
        self.block_table.clear()
        self.request, self.num_computed, self.draft = None, 0, None
