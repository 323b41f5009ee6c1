"""DraftPolicy: which proposer drafts for a slot in a window, and how many tokens.

Every proposer's draft carries cumulative scores c_j (the probability that its first j
tokens are all right). Scaled by the request's running acceptance r for that proposer
(its recent drafts' accepted over expected tokens),
token j is worth r * c_j expected accepted tokens and costs `--spec-token-cost` (one
more token in the window, as a fraction of a one-token window). The draft is cut where
the next token is worth less than it costs, and the proposer with the larger net gain
wins. A caller may also price drafting itself (`window_cost`: what the slot loses by
carrying drafts at all, when windows are built ahead: it sits one out): a draft whose net
gain does not exceed it is not sent. With `pricing` (`--spec-pricing measured`, pricing.py)
drafting is also charged what the engine's steps show it costs now: a drafted entry's
price is added to the window cost, and a token costs the larger of its measured price and
`--spec-token-cost`. With `load` (`--spec-pricing load`, load_pricing.py) the drafts of a
window's slots are decided together (`draft_window`): their tokens, best first, as many
as make the most tokens per second given what the stages' costs and load say more tokens
in this window take. With `shared` (`--spec-pricing shared`) a draft token costs
`--spec-token-cost` once for every slot of its window: the longer window delays each
slot's next token, not only the drafting slot's. The policy also forwards each request's
lifecycle to every proposer.
"""

from __future__ import annotations

from strata.drafting.draft import Draft
from strata.drafting.load_pricing import LoadPricing
from strata.drafting.pricing import DraftPricing
from strata.drafting.proposer import Proposer
from strata.request import DraftStats, Request

FORGET = 0.8          # weight kept by a recorded draft per newer one (running acceptance)
PRIOR = 1.0           # expected tokens of trust the running acceptance starts with (at 1)
MIN_RATE = 0.02       # a proposer that keeps failing stops drafting...
RECOVERY = 0.97       # ...and forgets its record a little every time it is asked, so
                      # it is tried again now and then (about every 5-10 windows)
MAX_RATE = 2.0        # scores that prove pessimistic may be trusted up to twice as much


class DraftPolicy:
    def __init__(self, proposers: list[Proposer], token_cost: float,
                 pricing: DraftPricing | None = None, load: LoadPricing | None = None,
                 shared: bool = False):
        self.proposers = proposers
        self.token_cost = token_cost
        self.shared = shared    # a token's cost is charged to every slot of the window
        self.pricing = pricing  # measured prices (None: the fixed costs alone)
        self.load = load        # prices from stage costs and load (None: per-token prices)
        # per (request, proposer): accepted and expected tokens of its drafts, decaying
        self._acceptance: dict[tuple[str, str], tuple[float, float]] = {}
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
              known: int = 0, window_tokens: int = 1, slots: int = 1) -> Draft | None:
        """The best draft for the request's next window, at most `room` tokens (each
        proposer also keeps to its own limit), if its net gain exceeds `window_cost`.
        `known`: the proposers' first tokens come anyway (a window in flight computes
        them: they guess its token), so only the tokens after them count as gain, and
        the draft holds those alone (`after_guess`; such drafts keep their own running
        acceptance, which a wrong guess lowers). `window_tokens`: the tokens the window
        carries without this draft (load prices); `slots`: the slots the window carries
        (shared prices)."""
        if room <= 0:
            return None
        if self.load is not None:
            return self.draft_window([request], [room], room, window_tokens, window_cost,
                                     known=known)[0]
        token_cost = self.token_cost * (max(slots, 1) if self.shared else 1)
        if self.pricing is not None:
            window_cost += self.pricing.entry_cost
            token_cost = max(token_cost, self.pricing.token_cost)
        best, best_gain = None, window_cost
        for p in self.proposers:
            draft = p.propose(request.request_id, room)
            if not draft or not draft.tokens:
                continue
            rate = self._rate(request, p.name, asked=True, guess=known > 0)
            worths = [min(1.0, rate * score) for score in draft.scores[:room]]
            length, gain = self._cut(worths, known, token_cost)
            if length > known and gain > best_gain:
                best = Draft(draft.tokens[known:length], draft.scores[known:length], p.name,
                             after_guess=known > 0)
                best_gain = gain
        return best

    def draft_window(self, requests: list[Request], rooms: list[int], budget: int,
                     window_tokens: int, window_cost: float = 0.0, known: int = 0,
                     group: int | None = None) -> list[Draft | None]:
        """Drafts for a window's decoding slots, decided together by load pricing: each
        slot's proposer with the most expected tokens, then the draft tokens of all the
        slots in order of worth, as many as the pricing says the window should carry (at
        most `budget`). A window's cost grows unevenly with its tokens, so slots priced
        one by one would each pay for the steep start alone. A slot's draft must be
        worth more than `window_cost`; with one slot, its first `known` tokens come
        anyway (worth nothing, and left out as `draft` leaves them). Without load
        pricing, each slot is decided alone as `draft` does."""
        if self.load is None:
            drafts = []
            for request, room in zip(requests, rooms):
                draft = self.draft(request, min(room, budget), window_cost,
                                   window_tokens=window_tokens, slots=len(requests))
                drafts.append(draft)
                if draft is not None:
                    budget -= len(draft.tokens)
                    window_tokens += len(draft.tokens)
            return drafts
        offers = [self._offer(request, room, known > 0) for request, room in zip(requests, rooms)]
        if len(offers) == 1 and offers[0] is not None:  # in its own order: `known` first
            ranked = [(0.0 if j < known else w, 0) for j, w in enumerate(offers[0][1])]
        else:
            ranked = sorted(((w, i) for i, offer in enumerate(offers) if offer is not None
                             for w in offer[1]), key=lambda t: (-t[0], t[1]))
        ranked = ranked[:max(budget, 0)]
        count = self.load.best_count([w for w, _ in ranked], window_tokens,
                                     float(window_tokens), group)
        lengths = [0] * len(offers)
        for _, i in ranked[:count]:
            lengths[i] += 1
        drafts: list[Draft | None] = []
        for offer, length in zip(offers, lengths):
            if (offer is None or length <= known
                    or sum(offer[1][known:length]) <= window_cost):
                drafts.append(None)
                continue
            draft = offer[0]
            drafts.append(Draft(draft.tokens[known:length], draft.scores[known:length],
                                draft.proposer, after_guess=known > 0))
        return drafts

    def _offer(self, request: Request, room: int,
               guess: bool = False) -> tuple[Draft, list[float]] | None:
        """The proposers' draft with the most expected tokens, and each token's worth
        (`guess`: its first token guesses one in flight)."""
        best = None
        for p in self.proposers if room > 0 else ():
            draft = p.propose(request.request_id, room)
            if not draft or not draft.tokens:
                continue
            rate = self._rate(request, p.name, asked=True, guess=guess)
            worths = [min(1.0, rate * score) for score in draft.scores[:room]]
            if best is None or sum(worths) > sum(best[1]):
                best = (draft, worths)
        return best

    def _rate(self, request: Request, proposer: str, asked: bool = False,
              guess: bool = False) -> float:
        """How far the proposer's scores held for this request lately: its drafts'
        accepted over expected tokens (recent drafts weighted most), starting from PRIOR
        expected tokens all accepted; `guess`: of its drafts after a guess of a token in
        flight, kept apart. `asked`: the proposer is asked for a window's draft (the
        record fades a little each time, so one that stopped drafting is tried again)."""
        key = (request.request_id, proposer, guess)
        got, expected = self._acceptance.get(key, (0.0, 0.0))
        if asked and expected:
            self._acceptance[key] = (RECOVERY * got, RECOVERY * expected)
        return min(max((got + PRIOR) / (expected + PRIOR), MIN_RATE), MAX_RATE)

    def _cut(self, worths: list[float], known: int, token_cost: float) -> tuple[int, float]:
        """The draft's length and net gain: each token after the first `known` is worth
        its expected acceptance and costs `token_cost`; the draft ends before the first
        token worth less (worths only fall, so no later length gains more)."""
        length, gain = 0, 0.0
        for w in worths:
            if w <= token_cost:
                break
            if length >= known:
                gain += w - token_cost
            length += 1
        return length, gain

    def record(self, request: Request, draft: Draft, accepted: int) -> None:
        """Update the request's running acceptance and its statistics."""
        key = (request.request_id, draft.proposer, draft.after_guess)
        got, expected = self._acceptance.get(key, (0.0, 0.0))
        self._acceptance[key] = (FORGET * got + accepted,
                                 FORGET * expected + (sum(draft.scores) or 1.0))
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
              known: int = 0, window_tokens: int = 1, slots: int = 1) -> Draft | None:
        length = min(room, self.max_tokens) - known
        if length <= 0:
            return None
        return Draft([request.token_ids[-1]] * length, [1.0] * length, "simulated",
                     after_guess=known > 0)

    def record(self, request: Request, draft: Draft, accepted: int) -> None:
        request.draft_stats.simulated = True
        request.draft_stats.record(draft.proposer, len(draft.tokens), accepted)
        self.stats.record(draft.proposer, len(draft.tokens), accepted)
