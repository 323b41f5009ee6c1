"""LookupProposer: the most recent earlier n-gram match, longest n first."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.drafting.lookup import LookupProposer
from strata.errors import StrataError


def brute_force(tokens: list[int], lo: int, hi: int, limit: int) -> tuple[list[int], int] | None:
    """(draft, n) from a scan of every earlier position, most recent first."""
    for n in range(min(hi, len(tokens)), lo - 1, -1):
        tail = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + limit], n
    return None


def test_proposes_what_followed_the_most_recent_match():
    p = LookupProposer()  # n-grams of 2..4 tokens, 8 tokens at most
    p.start("r", [5, 1, 2, 3, 4, 6, 1, 2, 9, 7, 8, 1, 2])
    draft = p.propose("r", 3)
    assert draft.tokens == [9, 7, 8]            # after the later "1 2", not the first
    assert draft.proposer == "lookup"
    assert draft.scores == pytest.approx([0.5, 0.25, 0.125])  # c(2) = 0.5, running product


def test_prefers_the_longer_ngram():
    p = LookupProposer()
    p.start("r", [9, 1, 2, 3, 4, 5, 7, 1, 2, 6, 6, 9, 1, 2])
    draft = p.propose("r", 2)
    assert draft.tokens == [3, 4]               # "9 1 2" beats the more recent "1 2"
    assert draft.scores == pytest.approx([0.75, 0.75 ** 2])
    p.extend("r", [3])                          # "9 1 2 3": a 4-gram match now
    assert p.propose("r", 1).scores == pytest.approx([0.875])


def test_respects_max_tokens_and_max_draft_and_the_end_of_the_text():
    p = LookupProposer(max_draft=4)
    passage = list(range(100, 130))
    p.start("r", passage + passage[:3])
    assert p.propose("r", 2).tokens == passage[3:5]
    assert p.propose("r", 50).tokens == passage[3:7]
    assert p.propose("r", 0) is None
    p.start("s", [1, 2, 3, 1, 2])
    assert p.propose("s", 8).tokens == [3, 1, 2]  # the match runs into the tail itself


def test_nothing_without_a_match_and_state_freed_on_finish():
    p = LookupProposer()
    p.start("r", list(range(50)))
    assert p.propose("r", 8) is None
    p.start("short", [1])
    assert p.propose("short", 8) is None
    p.extend("r", [10, 11])                     # "10 11" seen before: followed by 12
    assert p.propose("r", 2).tokens == [12, 13]
    p.finish("r")
    with pytest.raises(KeyError):
        p.propose("r", 8)
    p.finish("r")


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
       cuts=st.lists(st.integers(0, 60), max_size=5),
       lo=st.integers(1, 3), extra=st.integers(0, 3), limit=st.integers(1, 10))
def test_incremental_index_equals_brute_force(tokens, cuts, lo, extra, limit):
    hi = lo + extra
    p = LookupProposer(min_ngram=lo, max_ngram=hi, max_draft=8)
    bounds = sorted({c for c in cuts if c < len(tokens)} | {0, len(tokens)})
    p.start("r", tokens[:bounds[1]])
    for a, b in zip(bounds[1:], bounds[2:]):
        p.extend("r", tokens[a:b])
    draft = p.propose("r", limit)
    expected = brute_force(tokens, lo, hi, min(limit, 8))
    if expected is None:
        assert draft is None
    else:
        assert draft.tokens == expected[0]
        c = 1 - 0.5 ** (expected[1] - lo + 1)
        assert draft.scores == pytest.approx([c ** (j + 1) for j in range(len(expected[0]))])


def test_settings_are_checked():
    with pytest.raises(StrataError, match="--lookup-min"):
        LookupProposer(min_ngram=3, max_ngram=2)
    with pytest.raises(StrataError, match="--lookup-min"):
        LookupProposer(min_ngram=0)
    with pytest.raises(StrataError, match="max_draft"):
        LookupProposer(max_draft=0)
