"""The Proposer interface: what every drafting method implements (suffix_tree.py's tries,
lookup.py's n-grams, mtp.py's last-stage drafts). The DraftPolicy calls these methods
only; adding a proposer is its own file and one line in registry.py."""

from __future__ import annotations

from typing import Protocol

from strata.drafting.draft import Draft


class Proposer(Protocol):
    name: str             # `--spec-type` name, and the label of its statistics
    on_last_stage: bool   # its drafts are made by the model's last stage (MTP) and come
                          # back with each window's result

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        """A request took a slot: index its prompt (replacing any state under its id)."""

    def extend(self, request_id: str, token_ids: list[int],
               stage_drafts: Draft | None = None) -> None:
        """Tokens were committed to the request; `stage_drafts` are the drafts its window's
        last stage made for the next window (on_last_stage proposers only)."""

    def propose(self, request_id: str, max_tokens: int) -> Draft | None:
        """The draft for the request's next window, at most `max_tokens` (and at most the
        proposer's own limit) tokens long; None when it has nothing."""

    def finish(self, request_id: str) -> None:
        """The request finished: free what the proposer holds for it."""
