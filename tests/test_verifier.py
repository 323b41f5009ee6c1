"""The verifier: greedy acceptance against a reference loop, rejection sampling of point-mass
drafts that keeps the model's processed distribution, and seeded requests.

Distribution checks use n draws and the bound |freq - p| < 3 / sqrt(n): a frequency's
standard deviation is at most 0.5 / sqrt(n), so that is 6 sigma (a false failure has
probability ~1e-9 per cell; 0.015 at n = 40k). The mistakes it must catch (accepting drafts
too often, not removing q from the residual, ignoring top-k/top-p) move some cell by >= 0.05.
"""

from __future__ import annotations

import random

import pytest
import torch

from strata.sampling.params import SamplingParams
from strata.sampling.sampler import processed_probs
from strata.sampling.verifier import Verifier, VerifyEntry, emitted, greedy_rows, greedy_table

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GREEDY = SamplingParams(temperature=0)
N = 40_000
V = 5
ROWS = torch.log(torch.tensor([[0.45, 0.25, 0.15, 0.10, 0.05],
                               [0.05, 0.10, 0.20, 0.30, 0.35],
                               [0.34, 0.07, 0.27, 0.04, 0.28]]))


def tol(n: int) -> float:
    return 3 / n ** 0.5


def expected(row: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The processed distribution of one row, written out independently of the sampler."""
    p = torch.softmax(row.double() / temperature, dim=-1)
    order = p.argsort(descending=True).tolist()
    if top_k:
        p[order[top_k:]] = 0.0
        p = p / p.sum()
    keep, mass = [], 0.0
    for token in order:
        keep.append(token)
        mass += p[token].item()
        if mass >= top_p:
            break
    p = torch.zeros_like(p).index_fill(0, torch.tensor(keep), 1.0) * p
    p = p / p.sum()
    p = torch.where(p >= min_p * p.max(), p, 0.0)
    return (p / p.sum()).float()


def greedy_reference(logits: torch.Tensor, entries: list[VerifyEntry]) -> list[list[int]]:
    out, row = [], 0
    for e in entries:
        tokens = []
        for j, d in enumerate(e.draft):
            if logits[row + j].argmax().item() != d:
                break
            tokens.append(d)
        tokens.append(logits[row + len(tokens)].argmax().item())
        out.append(tokens)
        row += len(e.draft) + 1
    return out


def frequencies(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=V).float() / len(tokens)


def run_many(rows: torch.Tensor, params: SamplingParams,
             drafts: list[list[int]]) -> list[list[int]]:
    """One verify call with one entry per draft, each entry seeing the same logits rows."""
    k = len(drafts[0])
    logits = rows[:k + 1].repeat(len(drafts), 1)
    entries = [VerifyEntry(params, f"r{i}", d) for i, d in enumerate(drafts)]
    return Verifier().verify(logits, entries)


# ---------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_all_accepted_gives_the_bonus(device):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).to(device)
    top = logits.argmax(-1).tolist()
    out = Verifier().verify(logits, [VerifyEntry(GREEDY, "a", top[:4])])
    assert out == [top]  # 4 drafts accepted, then the argmax of the last row


def test_greedy_first_draft_wrong_gives_only_the_correction():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    top = logits.argmax(-1).tolist()
    wrong = (top[0] + 1) % 50
    out = Verifier().verify(logits, [VerifyEntry(GREEDY, "a", [wrong] + top[1:3])])
    assert out == [[top[0]]]


def test_greedy_mixed_batch_of_draft_lengths():
    logits = torch.randn(1 + 3 + 4 + 2 + 1, 30, generator=torch.Generator().manual_seed(2))
    top = logits.argmax(-1).tolist()
    entries = [
        VerifyEntry(GREEDY, "k0", []),                                    # row 0
        VerifyEntry(GREEDY, "all", top[1:3]),                             # rows 1-3
        VerifyEntry(GREEDY, "mid", [top[4], top[5], (top[6] + 1) % 30]),  # rows 4-7
        VerifyEntry(GREEDY, "none", [(top[8] + 3) % 30]),                 # rows 8-9
        VerifyEntry(GREEDY, "k0b", []),                                   # row 10
    ]
    assert Verifier().verify(logits, entries) == [
        [top[0]], top[1:4], top[4:7], [top[8]], [top[10]]]


def drafted_entries(rng: random.Random, logits: torch.Tensor,
                    ks: list[int]) -> list[VerifyEntry]:
    """Greedy entries with ks[i] drafts each over `logits`' first rows, each draft the
    row's argmax three times in four (else any token)."""
    top, row, entries = logits.argmax(-1).tolist(), 0, []
    for i, k in enumerate(ks):
        draft = [top[row + j] if rng.random() < 0.75 else rng.randrange(logits.shape[1])
                 for j in range(k)]
        entries.append(VerifyEntry(GREEDY, f"r{i}", draft))
        row += k + 1
    return entries


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_matches_reference_loop(device):
    rng = random.Random(3)
    verifier = Verifier()
    for case in range(300):
        vocab = rng.choice([2, 7, 64])
        ks = [rng.randint(0, 5) for _ in range(rng.randint(1, 6))]
        logits = torch.randn(sum(k + 1 for k in ks), vocab,
                             generator=torch.Generator().manual_seed(case))
        entries = drafted_entries(rng, logits, ks)
        assert verifier.verify(logits.to(device), entries) == greedy_reference(logits, entries)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_padded_to_a_bucket_decide_as_the_reference(device):
    """What a graphed last stage computes: its bucket's rows and entries, padded with rows
    of any logits (a spare entry's) and entries that read nothing."""
    rng = random.Random(5)
    for case in range(100):
        vocab = rng.choice([2, 7, 64])
        ks = [rng.randint(0, 5) for _ in range(rng.randint(1, 6))]
        real = sum(k + 1 for k in ks)
        rows, slots = real + rng.randint(0, 6), len(ks) + 1 + rng.randint(0, 3)
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(case))
        entries = drafted_entries(rng, logits, ks)
        table = [torch.tensor(c, device=device) for c in greedy_table(entries, rows, slots)]
        decided = greedy_rows(logits.to(device), *table)
        assert decided.shape == (2, slots)
        assert (emitted(entries, decided[:, :len(ks)].tolist())
                == greedy_reference(logits[:real], entries))
    with pytest.raises(ValueError, match="4 rows of 2 entries do not fit 3 rows"):
        greedy_table([VerifyEntry(GREEDY, "a", [1]), VerifyEntry(GREEDY, "b", [2])], 3, 4)
    with pytest.raises(ValueError, match="do not fit 8 rows and 2 entries"):
        greedy_table([VerifyEntry(GREEDY, "a", [1]), VerifyEntry(GREEDY, "b", [2])], 8, 2)


def test_greedy_entries_mixed_with_sampled_ones_stay_exact():
    logits = torch.randn(3 + 3 + 2, 40, generator=torch.Generator().manual_seed(4))
    top = logits.argmax(-1).tolist()
    entries = [VerifyEntry(GREEDY, "g", [top[0], (top[1] + 1) % 40]),
               VerifyEntry(SamplingParams(temperature=1.0), "s", [top[3], top[4]]),
               VerifyEntry(GREEDY, "h", [top[6]])]
    out = Verifier().verify(logits, entries)
    assert out[0] == [top[0], top[1]] and out[2] == [top[6], top[7]]
    assert 1 <= len(out[1]) <= 3 and out[1][:len(out[1]) - 1] == [top[3], top[4]][:len(out[1]) - 1]


def test_wrong_row_count_is_an_error():
    with pytest.raises(ValueError):
        Verifier().verify(torch.zeros(3, 5), [VerifyEntry(GREEDY, "a", [1])])


# ------------------------------------------------------------------- processed distribution


@pytest.mark.parametrize("kwargs", [dict(), dict(temperature=0.7), dict(top_k=3),
                                    dict(top_p=0.8), dict(min_p=0.3), dict(temperature=1.5,
                                                                           top_k=4, top_p=0.9)])
def test_processed_probs_match_the_written_out_processing(kwargs):
    probs = processed_probs(ROWS, [SamplingParams(**kwargs)] * len(ROWS))
    for row, got in zip(ROWS, probs):
        assert torch.allclose(got, expected(row, **kwargs), atol=1e-6)
    one_hot = processed_probs(ROWS, [GREEDY] * len(ROWS))
    assert one_hot.tolist() == torch.eye(V)[ROWS.argmax(-1)].tolist()


# -------------------------------------------------------------- rejection sampling: k = 0


def test_no_drafts_is_plain_sampling_with_min_p():
    torch.manual_seed(10)
    params = SamplingParams(temperature=1.0, min_p=0.3)
    out = run_many(ROWS, params, [[]] * N)
    assert all(len(t) == 1 for t in out)
    freq = frequencies([t[0] for t in out])
    assert (freq - expected(ROWS[0], min_p=0.3)).abs().max() < tol(N)
    assert freq[3] == 0 and freq[4] == 0


# ---------------------------------------------------------- rejection sampling: point masses


@pytest.mark.parametrize("draft_token,name", [(0, "high p"), (2, "low p"), (4, "p = 0 (top_k)")])
def test_point_mass_drafts_keep_the_distribution(draft_token, name):
    torch.manual_seed(11 + draft_token)
    params = SamplingParams(temperature=0.8, top_k=3)
    p0, p1 = expected(ROWS[0], 0.8, top_k=3), expected(ROWS[1], 0.8, top_k=3)
    out = run_many(ROWS, params, [[draft_token]] * N)
    first = frequencies([t[0] for t in out])
    assert (first - p0).abs().max() < tol(N), name
    assert first[3] == 0 and first[4] == 0, "a token outside top_k was emitted"
    accepted = [t for t in out if len(t) == 2]
    assert abs(len(accepted) / N - p0[draft_token].item()) < tol(N), "accepted with p(d)"
    if accepted:
        second = frequencies([t[1] for t in accepted])
        assert (second - p1).abs().max() < tol(len(accepted))
        assert second[0] == 0 and second[1] == 0, "a token outside top_k was emitted"


def test_point_mass_k2_second_token_given_acceptance():
    torch.manual_seed(12)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    out = run_many(ROWS, params, [[0, 3]] * N)
    p0, p1, p2 = (expected(ROWS[i], top_p=0.9) for i in range(3))
    assert (frequencies([t[0] for t in out]) - p0).abs().max() < tol(N)
    after_first = [t for t in out if len(t) >= 2]
    assert (frequencies([t[1] for t in after_first]) - p1).abs().max() < tol(len(after_first))
    after_both = [t for t in out if len(t) == 3]
    assert (frequencies([t[2] for t in after_both]) - p2).abs().max() < tol(len(after_both))
    assert all(t[0] != 4 for t in out) and all(t[1] != 0 for t in after_first)  # top_p


# --------------------------------------------------------------------------------- seeds


def seeded_run(seed: int, global_seed: int, neighbours: bool, steps: int = 25) -> list[list[int]]:
    """One seeded request verified over `steps` windows, alone or among unseeded entries."""
    torch.manual_seed(global_seed)
    verifier = Verifier()
    data = torch.Generator().manual_seed(99)
    outs = []
    for _ in range(steps):
        logits = torch.randn(4, 20, generator=data) * 0.7
        top2 = logits.topk(2, dim=-1).indices
        draft = [top2[j, j % 2].item() for j in range(3)]
        entries = [VerifyEntry(SamplingParams(seed=seed), "x", draft)]
        if neighbours:
            other = torch.randn(3, 20)
            entries = [VerifyEntry(SamplingParams(), "y", [1, 2])] + entries + [
                VerifyEntry(SamplingParams(seed=seed + 1), "z", [])]
            logits = torch.cat([other, logits, torch.randn(1, 20)])
            outs.append(verifier.verify(logits, entries)[1])
        else:
            outs.append(verifier.verify(logits, entries)[0])
    return outs


def test_same_seed_reproduces_across_verifiers_and_batches():
    alone = seeded_run(7, global_seed=1, neighbours=False)
    assert alone == seeded_run(7, global_seed=2, neighbours=False)
    assert alone == seeded_run(7, global_seed=3, neighbours=True)
    assert alone != seeded_run(8, global_seed=1, neighbours=False)


def test_seeded_draw_depends_on_seed_and_position_only():
    verifier = Verifier()
    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens

    def draw(seed, position):
        return verifier.verify(logits, [VerifyEntry(SamplingParams(seed=seed), "x", [],
                                                    position=position)])[0][0]
    by_position = [draw(5, p) for p in range(6)]
    assert [draw(5, p) for p in range(6)] == by_position
    assert len(set(by_position)) > 1
    assert [draw(6, p) for p in range(6)] != by_position


def test_seeded_output_is_the_same_with_and_without_drafts():
    """A seeded request samples the token at position t from noise keyed by (seed, t):
    a draft changes only how many rows are verified at once, not the tokens."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, generator=g) * 2   # rows for positions 10..13
    params = SamplingParams(seed=11, temperature=1.0)
    verifier = Verifier()
    solo = [verifier.verify(logits[j:j + 1], [VerifyEntry(params, "x", [], position=10 + j)])[0][0]
            for j in range(4)]
    with_drafts = verifier.verify(logits, [VerifyEntry(params, "x", solo[:3], position=10)])[0]
    assert with_drafts == solo


def test_the_last_stage_verifies_a_made_up_window_at_start_up(tiny_models):
    """WindowVerifier.warm_up (run when the engine starts) takes the greedy and the sampled
    paths with drafts: a device's first use of their kernels is paid at start-up."""
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    engine = Engine(EngineConfig(model=str(tiny_models["llama"][0]), spec=0))
    decided = engine.runner.last.warm_up(torch.device("cpu"), torch.float32, 320)
    assert decided.shape == (2, 2)
    assert decided[:, 0].tolist() == [1, 1]  # d1 = 1 accepted, then row 2's argmax
    assert decided[0, 1].item() in (0, 1)
