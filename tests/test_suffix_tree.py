"""SuffixProposer and SuffixTrie: counts, drafts, the global trie's bound, and lifecycle."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.drafting.suffix_tree import SuffixProposer, SuffixTrie
from strata.errors import StrataError

A, B, C, D, E = 1, 2, 3, 4, 5


def novel(n: int, seed: int, low: int = 1000) -> list[int]:
    """n distinct tokens: text that never repeats."""
    return random.Random(seed).sample(range(low, low + 100 * n), n)


def naive_count(tokens: list[int], path: list[int]) -> int:
    k = len(path)
    return sum(tokens[i:i + k] == path for i in range(len(tokens) - k + 1))


# Tests of what the tries hold draft as far as a match goes: no cap by match length
# (test_a_short_match_drafts_a_short_guess tests that cap).
LONG = 100.0


def naive_cont(tokens: list[int], path: list[int]) -> int:
    """Occurrences of path followed by a token."""
    k = len(path)
    return sum(tokens[i:i + k] == path for i in range(len(tokens) - k))


# -- drafts from the request's own tokens ---------------------------------------------------
def test_copying_a_passage_proposes_its_continuation_up_to_max_draft():
    passage = novel(300, seed=1)
    p = SuffixProposer()  # max_depth 64, max_draft 32, spec_factor 1
    for k in (1, 5, 40, 63, 100, 200):
        p.start("r", novel(50, seed=2, low=90_000) + passage + novel(20, seed=3, low=200_000))
        p.extend("r", passage[:k])
        draft = p.propose("r", 100)
        length = min(k, 32)  # as long as the match, at most max_draft
        assert draft.proposer == "suffix"
        assert draft.tokens == passage[k:k + length]
        assert draft.scores == [1.0] * length
        assert p.propose("r", 3).tokens == passage[k:k + min(k, 3)]


@pytest.mark.parametrize("factor,expected", [(0.5, 3), (1.0, 6), (2.0, 12), (10.0, 32)])
def test_a_short_match_drafts_a_short_guess(factor, expected):
    """SuffixDecoding's rule: a draft is at most spec_factor times as long as the suffix
    it follows, here 6 tokens of a passage seen once (and never beyond max_draft)."""
    passage = novel(100, seed=6)
    p = SuffixProposer(spec_factor=factor)
    p.start("r", novel(30, seed=7, low=90_000) + passage + passage[:6])
    draft = p.propose("r", 100)
    assert draft.tokens == passage[6:6 + expected]
    with pytest.raises(StrataError, match="spec-suffix-factor"):
        SuffixProposer(spec_factor=0)


@pytest.mark.parametrize("factor", [1.0, LONG])
def test_a_small_max_depth_still_drafts_long_copies(factor):
    """A match as deep as the trie follows (max_depth - 1 tokens) is trusted as a copy,
    whatever spec_factor allows a shorter one; one token shorter, the factor caps it."""
    passage = novel(100, seed=4)
    p = SuffixProposer(max_depth=8, max_draft=40, spec_factor=factor)
    p.start("r", passage + passage[:20])
    assert p.propose("r", 40).tokens == passage[20:60]
    q = SuffixProposer(max_depth=8, max_draft=40, spec_factor=factor)
    q.start("r", novel(10, seed=5, low=90_000) + passage + novel(10, seed=6, low=80_000)
            + passage[:6])
    assert q.propose("r", 40).tokens == passage[6:6 + (6 if factor == 1.0 else 40)]


def test_the_draft_follows_the_most_frequent_continuation():
    # A B is followed by C E three times and by D once.
    tokens = [A, B, C, E, 10, A, B, C, E, 11, A, B, D, 12, A, B, C, E, 13, A, B]
    p = SuffixProposer(spec_factor=LONG, min_score=0.3)
    p.start("r", tokens)
    draft = p.propose("r", 10)
    assert draft.tokens == [C, E]
    assert draft.scores == pytest.approx([0.75, 0.75])  # then 10/11/13 at 1/3 each: 0.25 < 0.3
    low = SuffixProposer(spec_factor=LONG, min_score=0.2)
    low.start("r", tokens)
    draft = low.propose("r", 3)
    assert draft.tokens[:2] == [C, E] and draft.tokens[2] in (10, 11, 13)
    assert draft.scores == pytest.approx([0.75, 0.75, 0.25])


def test_novel_text_proposes_nothing_and_costs_one_node_per_token():
    p = SuffixProposer()
    tokens = novel(2000, seed=5)
    p.start("r", tokens)
    assert p.propose("r", 8) is None
    assert p.num_nodes("r") == len(tokens)
    assert p.propose("r", 0) is None


def test_draft_length_adapts_to_confidence():
    # After X the text went three different ways: the draft stops where the odds fall.
    tokens = [7, 8, 9, 20, 21, 7, 8, 9, 30, 31, 7, 8, 9, 40, 41, 7, 8]
    p = SuffixProposer(min_score=0.5)
    p.start("r", tokens)
    assert p.propose("r", 32).tokens == [9]   # 9 is certain; 20/30/40 each 1/3
    p.extend("r", [9, 40, 41, 7, 8, 9, 40])   # a longer context now decides: 41 is certain
    draft = p.propose("r", 32)
    assert draft.tokens[0] == 41 and draft.scores[0] == 1.0


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       max_tokens=st.integers(1, 12))
def test_draft_matches_naive_counts(tokens, max_tokens):
    """Each draft token is a most frequent continuation, scored count / continuations."""
    p = SuffixProposer(max_depth=64, max_draft=32, min_score=0.0, spec_factor=100)
    p.start("r", tokens)
    draft = p.propose("r", max_tokens)
    L = max((k for k in range(1, len(tokens))
             if naive_cont(tokens, tokens[-k:]) > 0), default=0)
    if L == 0:
        assert draft is None
        return
    path, score = tokens[-L:], 1.0
    assert draft is not None and 1 <= len(draft.tokens) <= max_tokens
    for token, got in zip(draft.tokens, draft.scores):
        counts = {t: naive_count(tokens, path + [t]) for t in set(tokens)}
        assert counts[token] == max(counts.values())
        score *= counts[token] / naive_cont(tokens, path)
        assert got == pytest.approx(score)
        path = path + [token]
    if len(draft.tokens) < max_tokens:
        assert naive_cont(tokens, path) == 0  # stopped only for want of a continuation


# -- the trie itself ----------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 2), max_size=25), min_size=1, max_size=4),
       drop=st.integers(0, 3), max_depth=st.integers(2, 6))
def test_trie_counts_equal_naive_counts_through_inserts_and_removals(seqs, drop, max_depth):
    trie = SuffixTrie(max_depth)
    for seq in seqs:
        trie.insert(seq)
    for seq in seqs[:drop]:
        trie.remove(seq)
    kept = seqs[drop:]
    grams = {tuple(s[i:i + k]) for s in kept for k in range(1, max_depth + 1)
             for i in range(len(s) - k + 1)}
    for gram in grams:
        assert trie.count(list(gram)) == sum(naive_count(s, list(gram)) for s in kept)
    for absent in ([3], [0, 1, 2, 0, 1, 2, 0][:max_depth]):
        if tuple(absent) not in grams:
            assert trie.count(absent) == 0
    fresh = SuffixTrie(max_depth)
    for seq in kept:
        fresh.insert(seq)
    assert trie.num_nodes == fresh.num_nodes  # removal leaves no dead nodes behind


# -- the global trie ------------------------------------------------------------------------
def test_a_finished_output_drafts_for_a_new_request():
    prompt, output = novel(40, seed=6), novel(120, seed=7, low=50_000)
    p = SuffixProposer(spec_factor=LONG)
    p.start("r1", prompt)
    p.extend("r1", output)
    p.finish("r1")
    assert p.global_num_tokens == len(output)  # the output only, not the prompt
    p.start("r2", novel(30, seed=8, low=150_000) + output[:10])
    assert p.propose("r2", 16).tokens == output[10:26]
    p.start("r3", novel(30, seed=9, low=250_000) + prompt[:10])
    assert p.propose("r3", 16) is None
    p.extend("r2", output[10:50])  # the cursors follow the request as it goes
    assert p.propose("r2", 8).tokens == output[50:58]


def test_a_running_request_sees_outputs_that_finish_after_it_started():
    output = novel(80, seed=10, low=50_000)
    p = SuffixProposer(spec_factor=LONG)
    p.start("reader", novel(20, seed=11, low=150_000))
    p.start("writer", novel(20, seed=12, low=250_000))
    p.extend("writer", output)
    p.finish("writer")
    p.extend("reader", output[:5])
    assert p.propose("reader", 8).tokens == output[5:13]


def test_the_global_trie_stays_bounded_and_evicts_the_oldest_outputs():
    p = SuffixProposer(spec_factor=LONG, max_depth=8, global_max_tokens=1000)
    outputs = [novel(100, seed=100 + i, low=10_000 * (i + 1)) for i in range(40)]
    peak = 0
    for i, output in enumerate(outputs):
        p.start(f"r{i}", [1, 2, 3])
        p.extend(f"r{i}", output + output[:30])  # repeats: materialised nodes to evict
        p.finish(f"r{i}")
        assert p.global_num_tokens <= 1000
        peak = max(peak, p.global_num_nodes)
    kept = [o + o[:30] for o in outputs[-7:]]  # 7 x 130 tokens fit under 1000
    assert p.global_num_tokens == sum(map(len, kept))
    fresh = SuffixTrie(8)
    for seq in kept:
        fresh.insert(seq)
    assert p.global_num_nodes == fresh.num_nodes <= peak
    p.start("old", outputs[0][:10])
    assert p.propose("old", 8) is None             # evicted
    p.start("new", outputs[-1][:10])
    assert p.propose("new", 8).tokens == outputs[-1][10:18]


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_global_drafts_stay_true_to_outputs_finishing_and_evicted_meanwhile(data):
    """A request reads along a master text while fragments of it (some altered) finish
    and are evicted; its drafts must always continue text of an output still held."""
    master = list(range(100, 140))  # distinct: the reader's own trie never proposes
    max_depth, bound = 6, data.draw(st.integers(8, 40))
    p = SuffixProposer(spec_factor=LONG, max_depth=max_depth, max_draft=8, global_max_tokens=bound,
                       min_score=0.0)
    held: list[list[int]] = []
    p.start("reader", master[:1])
    for step in range(data.draw(st.integers(1, 30))):
        if data.draw(st.booleans()):
            lo = data.draw(st.integers(0, 35))
            output = master[lo:lo + data.draw(st.integers(1, 12))]
            if data.draw(st.booleans()):
                output[data.draw(st.integers(0, len(output) - 1))] = 7  # a divergence
            p.start(f"w{step}", [1, 2])
            p.extend(f"w{step}", output)
            p.finish(f"w{step}")
            held.append(output[-bound:])  # an output over the bound keeps its end
            while sum(map(len, held)) > bound:
                held.pop(0)
        else:
            length = len(p._requests["reader"].tokens)
            p.extend("reader", master[length:length + data.draw(st.integers(1, 3))])
        length = len(p._requests["reader"].tokens)
        draft = p.propose("reader", 8)
        if draft is None:
            continue
        # some suffix of length L matched; each token continues the match (or, past the
        # depth limit, the last max_depth // 2 tokens) somewhere in a held output
        path = master[:length] + draft.tokens
        assert any(all(any(naive_count(out, path[max(length - L, j - max_depth // 2):j + 1])
                           for out in held) for j in range(length, len(path)))
                   for L in range(1, max_depth)), (path, held)


def test_a_cursor_notices_when_its_output_is_replaced_by_another():
    X, a, b, c, d, p_, q, r, s_ = range(60, 69)
    p = SuffixProposer(spec_factor=LONG, global_max_tokens=10)
    for rid, output in (("o1", [X, a, b, c, d]), ):
        p.start(rid, [1])
        p.extend(rid, output)
        p.finish(rid)
    p.start("reader", [2, X, a])
    assert p.propose("reader", 3).tokens == [b, c, d]
    for rid, output in (("o2", [X, p_, q, r, s_]), ("o3", [30, 31, 32, 33, 34])):
        p.start(rid, [1])
        p.extend(rid, output)
        p.finish(rid)  # o3 evicts o1: "X" is left with o2's occurrence only
    assert p.propose("reader", 3) is None  # "X a" is gone; o2 goes "X p"
    p.extend("reader", [X, p_])
    assert p.propose("reader", 3).tokens == [q, r, s_]


def test_a_cursor_in_an_evicted_subtree_is_dropped():
    X, a, b, c, d = range(60, 65)
    p = SuffixProposer(spec_factor=LONG, global_max_tokens=15)
    for rid, output in (("o1", [X, a, b, c, 50, X, a, b, c, 51]), ("o2", [X, a, b, d, 52])):
        p.start(rid, [1])
        p.extend(rid, output)
        p.finish(rid)
    p.start("reader", [2, X, a, b])
    draft = p.propose("reader", 1)
    assert draft.tokens == [c] and draft.scores == pytest.approx([2 / 3])
    p.start("o3", [1])
    p.extend("o3", [30, 31, 32, 33, 34])
    p.finish("o3")  # evicts o1
    assert p.propose("reader", 2).tokens == [d, 52]


def test_an_output_longer_than_the_bound_keeps_its_end():
    p = SuffixProposer(spec_factor=LONG, global_max_tokens=50)
    output = novel(200, seed=13)
    p.start("r", [1])
    p.extend("r", output)
    p.finish("r")
    assert p.global_num_tokens == 50
    p.start("s", output[-40:-30])
    assert p.propose("s", 5).tokens == output[-30:-25]


# -- lifecycle ------------------------------------------------------------------------------
def test_a_request_keeps_its_trie_until_finish_even_when_left_out_of_windows():
    passage = novel(100, seed=14)
    p = SuffixProposer(spec_factor=LONG)
    p.start("idle", passage + passage[:10])
    nodes, draft = p.num_nodes("idle"), p.propose("idle", 8)
    for step in range(200):  # others come, decode and go; "idle" gets no calls at all
        rid = f"busy{step // 20}"
        if step % 20 == 0:
            p.start(rid, novel(30, seed=step, low=500_000))
        p.extend(rid, [step, step + 1])
        p.propose(rid, 4)
        if step % 20 == 19:
            p.finish(rid)
    assert p.num_nodes("idle") == nodes
    assert p.propose("idle", 8) == draft and draft.tokens == passage[10:18]
    p.finish("idle")
    with pytest.raises(KeyError):
        p.num_nodes("idle")
    with pytest.raises(KeyError):
        p.propose("idle", 8)
    p.finish("idle")  # finishing twice is harmless


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=80),
       cuts=st.lists(st.integers(0, 80), max_size=6),
       history=st.lists(st.integers(0, 4), max_size=40),
       max_depth=st.integers(2, 10))
def test_incremental_extend_equals_building_from_scratch(tokens, cuts, history, max_depth):
    def proposer():
        p = SuffixProposer(spec_factor=LONG, max_depth=max_depth, max_draft=16, min_score=0.05)
        p.start("old", [9])
        p.extend("old", history)
        p.finish("old")
        return p

    whole, pieces = proposer(), proposer()
    whole.start("r", tokens)
    bounds = sorted({c for c in cuts if c < len(tokens)} | {0, len(tokens)})
    pieces.start("r", tokens[:bounds[1]])
    for lo, hi in zip(bounds[1:], bounds[2:]):
        pieces.extend("r", tokens[lo:hi])
    assert pieces.num_nodes("r") == whole.num_nodes("r")
    for max_tokens in (1, 4, 16):
        assert pieces.propose("r", max_tokens) == whole.propose("r", max_tokens)


def test_settings_are_checked():
    with pytest.raises(StrataError, match="--spec-suffix-max"):
        SuffixProposer(max_draft=0)
    with pytest.raises(StrataError, match="max_depth"):
        SuffixProposer(max_depth=1)
    with pytest.raises(StrataError, match="min_score"):
        SuffixProposer(min_score=1.5)
    with pytest.raises(StrataError, match="global_max_tokens"):
        SuffixProposer(global_max_tokens=-1)
