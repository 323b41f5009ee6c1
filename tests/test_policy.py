"""DraftPolicy: a draft is cut where a token is worth less than it costs, the proposer with
the larger expected gain wins, and a proposer that keeps failing backs off and is retried."""

from __future__ import annotations

from strata.drafting.draft import Draft
from strata.drafting.policy import DraftPolicy
from strata.request import Request
from strata.sampling.params import SamplingParams


class Fixed:
    def __init__(self, name, tokens, scores):
        self.name, self.tokens, self.scores = name, tokens, scores

    name: str
    on_last_stage = False

    def start(self, rid, prompt): pass
    def extend(self, rid, tokens, stage_drafts=None): pass
    def finish(self, rid): pass

    def propose(self, rid, max_tokens):
        return Draft(self.tokens[:max_tokens], self.scores[:max_tokens], self.name)


def request() -> Request:
    return Request([1, 2, 3], SamplingParams(temperature=0))


def test_cut_at_the_token_cost_and_best_gain_wins():
    long = Fixed("long", [5, 6, 7, 8], [0.9, 0.5, 0.1, 0.04])
    short = Fixed("short", [9], [0.99])
    policy = DraftPolicy([short, long], token_cost=0.2)
    draft = policy.draft(request(), room=8)
    assert draft.proposer == "long" and draft.tokens == [5, 6]  # 0.1 and 0.04 cost more
    assert policy.draft(request(), room=1).proposer == "short"  # one token: 0.99 > 0.9


def test_a_failing_proposer_backs_off_and_is_retried():
    bad = Fixed("bad", list(range(10, 42)), [1.0] * 32)
    policy = DraftPolicy([bad], token_cost=0.05)
    r = request()
    sent = []
    for _ in range(60):
        draft = policy.draft(r, room=8)
        sent.append(draft is not None)
        if draft is not None:
            policy.record(r, draft, accepted=0)
    assert sent[:3] == [True, True, True]
    assert sum(sent[30:]) < 15        # mostly sits out...
    assert any(sent[30:])             # ...but is tried again now and then
    assert r.draft_stats.by_proposer["bad"].accepted == 0
