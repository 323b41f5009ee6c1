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


def test_drafts_after_a_guess_keep_their_own_running_acceptance():
    """Drafts after a guess of a token in flight fail with the guess: their record is kept
    apart from the same proposer's drafts after a known token, each learning its own."""
    policy = DraftPolicy([Fixed("fixed", [5, 6, 7, 8], [0.9, 0.8, 0.7, 0.6])], token_cost=0.05)
    r = request()
    for _ in range(2):
        after = policy.draft(r, room=8, window_cost=0.5, known=1)
        assert after.tokens == [6, 7, 8] and after.after_guess
        policy.record(r, after, accepted=0)  # the guess keeps missing
    assert policy.draft(r, room=8, window_cost=0.5, known=1) is None  # those stopped...
    known = policy.draft(r, room=8, window_cost=0.5)  # ...those after a known token did not
    assert known.tokens == [5, 6, 7, 8] and not known.after_guess
    policy.record(r, known, accepted=4)
    assert policy.draft(r, room=8, window_cost=0.5, known=1) is None
    assert r.draft_stats.by_proposer["fixed"].drafted == 2 * 3 + 4  # one proposer's stats


def test_shared_pricing_charges_a_token_to_every_slot_of_its_window():
    """`--spec-pricing shared`: a draft token delays every slot of the window, so with four
    slots it must be worth four times --spec-token-cost; alone it is priced as fixed."""
    proposer = Fixed("p", [5, 6, 7, 8], [0.95, 0.6, 0.3, 0.15])
    shared = DraftPolicy([proposer], token_cost=0.1, shared=True)
    fixed = DraftPolicy([proposer], token_cost=0.1)
    assert shared.draft(request(), room=8, slots=1).tokens == [5, 6, 7, 8]
    assert shared.draft(request(), room=8, slots=4).tokens == [5, 6]  # 0.3 < 4 x 0.1
    assert fixed.draft(request(), room=8, slots=4).tokens == [5, 6, 7, 8]
    assert shared.draft(request(), room=8, slots=10) is None          # 0.95 < 10 x 0.1


def test_the_scheduler_prices_drafts_by_the_slots_their_window_carries():
    """Through the scheduler, shared pricing sees every slot of the window: one request
    drafts all four tokens, four requests together only the two worth 0.4 or more."""
    from strata.scheduler.scheduler import Scheduler

    def drafted(users: int, ahead: bool) -> list[int]:
        policy = DraftPolicy([Fixed("p", [5, 6, 7, 8], [0.95, 0.6, 0.3, 0.15])],
                             token_cost=0.1, shared=True)
        sched = Scheduler(num_slots=4, max_context=64, max_window_tokens=64, block_size=4,
                          drafts=policy, ahead=ahead)
        for _ in range(users):
            sched.add(Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=20)))
        sched.commit(sched.schedule(), [[9]] * users)  # the prompts
        return list(sched.schedule().header.num_drafts)

    for ahead in (False, True):
        assert drafted(1, ahead) == [4]
        assert drafted(4, ahead) == [2, 2, 2, 2]
