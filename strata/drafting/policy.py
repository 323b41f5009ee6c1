"""DraftPolicy: which proposer drafts for a slot in a window, and how many tokens.

Every proposer's draft carries cumulative scores c_j (the probability that its first j
tokens are all right). Scaled by the request's running acceptance r for that proposer,
token j is worth r * c_j expected accepted tokens and costs `--spec-token-cost` (one
more token in the window, as a fraction of a one-token window). The draft is cut where
the next token is worth less than it costs, and the proposer with the larger net gain
wins. A caller may also price drafting itself (`window_cost`: what the slot loses by
carrying drafts at all, when windows are built ahead: it sits one out): a draft whose net
gain does not exceed it is not sent. With `pricing` (`--spec-pricing measured`, pricing.py)
drafting is also charged what the engine's steps show it costs now: a drafted entry's
price is added to the window cost, and a token costs the larger of its measured price and
`--spec-token-cost`. The policy also forwards each request's lifecycle to every proposer.
"""

from __future__ import annotations

from strata.drafting.draft import Draft
from strata.drafting.pricing import DraftPricing
from strata.drafting.proposer import Proposer
from strata.request import DraftStats, Request

EMA = 0.5             # weight of the newest window in the running acceptance
MIN_RATE = 0.02       # a proposer that keeps failing stops drafting...
RECOVERY = 0.003      # ...and is trusted a little more every window it sits out, so it
                      # is tried again now and then (about every 5-10 windows)
MAX_RATE = 2.0        # scores that prove pessimistic may be trusted up to twice as much


class DraftPolicy:
    def __init__(self, proposers: list[Proposer], token_cost: float,
                 pricing: DraftPricing | None = None):
        self.proposers = proposers
        self.token_cost = token_cost
        self.pricing = pricing  # measured prices (None: the fixed costs alone)
        self._acceptance: dict[tuple[str, str], float] = {}
        self.stats = DraftStats()  # all requests together

    @property
    def on_last_stage(self) -> bool:
        """Some proposer's drafts are made by the model's last stage (its MTP layer)."""
        return any(p.on_last_stage for p in self.proposers)

    @property
    def enabled(self) -> bool:
        return bool(self.proposers)

    # -- lifecycle ------------------------------------------------------------------------
    def admitted(self, request: Request) -> None:
        for p in self.proposers:
            p.start(request.request_id, request.token_ids)

    def committed(self, request: Request, token_ids: list[int],
                  stage_drafts: Draft | None = None) -> None:
        """`stage_drafts`: what the window's last stage drafted for the next window."""
        for p in self.proposers:
            p.extend(request.request_id, token_ids,
                     stage_drafts if p.on_last_stage else None)

    def finished(self, request: Request) -> None:
        for p in self.proposers:
            p.finish(request.request_id)
        for key in [k for k in self._acceptance if k[0] == request.request_id]:
            del self._acceptance[key]

    # -- drafting -------------------------------------------------------------------------
    def draft(self, request: Request, room: int, window_cost: float = 0.0,
              known: int = 0) -> Draft | None:
        """The best draft for the request's next window, at most `room` tokens (each
        proposer also keeps to its own limit), if its net gain exceeds `window_cost`.
        `known`: the draft's first tokens come anyway (a window in flight computes them:
        the draft is a guess of its token), so only the tokens after them count as gain."""
        if room <= 0:
            return None
        token_cost = self.token_cost
        if self.pricing is not None:
            window_cost += self.pricing.entry_cost
            token_cost = max(token_cost, self.pricing.token_cost)
        best, best_gain = None, window_cost
        for p in self.proposers:
            draft = p.propose(request.request_id, room)
            if not draft or not draft.tokens:
                continue
            key = (request.request_id, p.name)
            rate = self._acceptance.get(key, 1.0)
            if rate < 1.0:
                self._acceptance[key] = min(1.0, rate + RECOVERY)
            length, gain = 0, 0.0
            for score in draft.scores[:room]:
                worth = min(1.0, rate * score)
                if worth <= token_cost:
                    break
                if length >= known:
                    gain += worth - token_cost
                length += 1
            if length > known and gain > best_gain:
                best = Draft(draft.tokens[:length], draft.scores[:length], p.name)
                best_gain = gain
        return best

    def record(self, request: Request, draft: Draft, accepted: int) -> None:
        """Update the request's running acceptance and its statistics."""
        key = (request.request_id, draft.proposer)
        rate = self._acceptance.get(key, 1.0)
        expected = sum(draft.scores) or 1.0
        observed = min(accepted / expected, MAX_RATE)
        self._acceptance[key] = max(MIN_RATE, (1 - EMA) * rate + EMA * observed)
        request.draft_stats.record(draft.proposer, len(draft.tokens), accepted)
        self.stats.record(draft.proposer, len(draft.tokens), accepted)


class SimulatedPolicy(DraftPolicy):
    """`--simulate-acceptance P`: every decoding slot carries `--spec` draft tokens in every
    window (copies of its last token); the verifier accepts each with probability P.
    For speed studies on random-weight models, whose own drafts never match."""

    def __init__(self, max_tokens: int, probability: float):
        super().__init__([], 0.0)
        self.max_tokens, self.probability = max_tokens, probability
        self.stats.simulated = True

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def draft(self, request: Request, room: int, window_cost: float = 0.0,
              known: int = 0) -> Draft | None:
        length = min(room, self.max_tokens)
        if length <= 0:
            return None
        return Draft([request.token_ids[-1]] * length, [1.0] * length, "simulated")

    def record(self, request: Request, draft: Draft, accepted: int) -> None:
        request.draft_stats.simulated = True
        request.draft_stats.record(draft.proposer, len(draft.tokens), accepted)
        self.stats.record(draft.proposer, len(draft.tokens), accepted)
