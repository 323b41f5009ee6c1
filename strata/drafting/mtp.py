"""MTPProposer: the scheduler's side of MTP drafts. The drafts themselves are made on the
last stage by the model's MTP layer (stage/mtp_drafter.py) and come back with each
window's result; this proposer holds them until the slot's next window."""

from __future__ import annotations

from strata.drafting.draft import Draft


class MTPProposer:
    """The scheduler's side of MTP: it holds the drafts that came back with each slot's
    last window results and proposes them for the slot's next window."""

    name = "mtp"
    on_last_stage = True

    def __init__(self):
        self._drafts: dict[str, Draft] = {}

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self._drafts.pop(request_id, None)

    def extend(self, request_id: str, token_ids: list[int],
               stage_drafts: Draft | None = None) -> None:
        """Keep the drafts the last stage made after this commit (older ones are stale)."""
        if stage_drafts is None:
            self._drafts.pop(request_id, None)
        else:
            self._drafts[request_id] = Draft(stage_drafts.tokens, stage_drafts.scores, self.name)

    def propose(self, request_id: str, max_tokens: int) -> Draft | None:
        draft = self._drafts.get(request_id)
        if draft is None or not draft.tokens:
            return None
        return Draft(draft.tokens[:max_tokens], draft.scores[:max_tokens], self.name)

    def finish(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
