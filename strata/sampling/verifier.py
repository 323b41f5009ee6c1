"""Verifier: per entry of a window, which drafts are accepted, plus one more token.

An entry is one slot's run `[last accepted token, d1..dk]` (k may be 0, which is plain
sampling). Its k+1 logits rows are contiguous; row j is the model's distribution for the
token after the entry's j-th token.

- A request's `logit_bias` is added to its rows first; greedy argmax and sampling both see
  the biased logits, so drafts stay lossless under a bias too.
- Greedy entries accept the longest prefix with d_{j+1} == argmax(row j), then add the
  argmax of the row after the last accepted draft (the correction, or the bonus).
- Sampled entries draw one token from each row's processed distribution p
  (`processed_probs`) and accept drafts while the draws equal them. Every proposer's drafts
  are point masses (MTP's chain is greedy), so this is rejection sampling with q = one-hot(d):
  a draft is accepted with probability p(d), and after a rejection the draw is distributed
  as p without d, renormalised. The output is distributed exactly as the model's own. The
  noise of the draw for the token at position t of a seeded request depends only on (seed,
  t), so a seeded request gives the same text with or without drafts.

The Verifier does not count, commit or touch the KV cache: the scheduler does. `decide`
launches its work on the logits' device and returns there; its caller makes the one host
read, so a GPU window's verification is queued behind its layers before anything waits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.sampling.params import SamplingParams
from strata.sampling.sampler import biased_logits, processed_probs

_TINY = 1e-30  # keeps p / noise finite where the noise is 0


@dataclass
class VerifyEntry:
    params: SamplingParams
    request_id: str
    draft: list[int]                          # d1..dk (k may be 0), point masses
    position: int = 0                         # position of the token row 0 decides


class Verifier:
    def verify(self, logits: torch.Tensor, entries: list[VerifyEntry]) -> list[list[int]]:
        """logits: [sum(k_i + 1), V], rows of entry i contiguous and in entry order.
        Returns per entry the accepted drafts followed by one more token (length a_i + 1)."""
        return emitted(entries, self.decide(logits, entries).tolist())  # NOTE: the host read

    def decide(self, logits: torch.Tensor, entries: list[VerifyEntry]) -> torch.Tensor:
        """`verify` without its host read: [2, N] on the logits' device, per entry the
        number of accepted drafts and the token after them (`emitted` turns it into ids)."""
        num_rows = sum(len(e.draft) + 1 for e in entries)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(f"verify: logits {tuple(logits.shape)} do not match the entries' "
                             f"{num_rows} rows (k + 1 per entry)")
        if not entries:
            return torch.zeros(2, 0, dtype=torch.long, device=logits.device)
        logits = biased_logits(logits, _row_params(entries))
        sampled = [i for i, e in enumerate(entries) if not e.params.greedy]
        if not sampled and num_rows == len(entries):  # greedy, no drafts: the argmax alone
            token = logits.argmax(dim=-1)
            return torch.stack([torch.zeros_like(token), token])
        if not sampled:
            return _greedy(logits, entries)
        if len(sampled) == len(entries):
            return torch.stack(self._sample_and_match(logits, entries,
                                                      _Layout(entries, logits.device)))
        # a mixed batch: every entry matched greedily, then the sampled entries' rows
        # verified apart and put in their places
        accepted, token = _greedy(logits, entries)
        starts = [0]
        for e in entries:
            starts.append(starts[-1] + len(e.draft) + 1)
        sub = [entries[i] for i in sampled]
        rows = [starts[i] + j for i in sampled for j in range(len(entries[i].draft) + 1)]
        index = torch.tensor(sampled).to(logits.device, non_blocking=True)
        sub_logits = logits[torch.tensor(rows).to(logits.device, non_blocking=True)]
        sub_accepted, sub_token = self._sample_and_match(sub_logits, sub,
                                                         _Layout(sub, logits.device))
        return torch.stack([accepted.index_copy(0, index, sub_accepted),
                            token.index_copy(0, index, sub_token)])

    def simulate(self, logits: torch.Tensor, entries: list[VerifyEntry],
                 probability: float) -> torch.Tensor:
        """`--simulate-acceptance`, as `decide` does it ([2, N], no host read): each draft
        is accepted with `probability` regardless of the model (a leading run of
        successes); the next token is the model's own draw at the row after the accepted
        ones."""
        if not entries:
            return torch.zeros(2, 0, dtype=torch.long, device=logits.device)
        logits = biased_logits(logits, _row_params(entries))
        layout = _Layout(entries, logits.device)
        draws = self._draws(logits, entries)
        success = torch.rand(len(entries), layout.K, device=logits.device) < probability
        accepted = (success & layout.valid).long().cumprod(dim=1).sum(dim=1)
        return torch.stack([accepted, draws[layout.starts + accepted]])

    @classmethod
    def _sample_and_match(cls, logits: torch.Tensor, entries: list[VerifyEntry],
                          layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """Point-mass drafts: one draw per row, drafts accepted while they equal the draws."""
        draws = cls._draws(logits, entries)                            # [R]
        match = (draws[layout.rows] == layout.drafts) & layout.valid
        accepted = match.long().cumprod(dim=1).sum(dim=1)            # [N]
        return accepted, draws[layout.starts + accepted]

    @staticmethod
    def _draws(logits: torch.Tensor, entries: list[VerifyEntry]) -> torch.Tensor:
        """One token per row from its processed distribution; a seeded request's row for
        position t uses noise keyed by (seed, t)."""
        probs = processed_probs(logits, _row_params(entries))         # [R, V]
        noise = torch.empty_like(probs).exponential_()
        row = 0
        for e in entries:
            for j in range(len(e.draft) + 1):
                if e.params.seed is not None:
                    noise[row].exponential_(generator=position_generator(
                        e.params.seed, e.position + j, probs.device))
                row += 1
        return (probs / noise.clamp_min(_TINY)).argmax(dim=-1)      # [R]


def greedy_table(entries: list[VerifyEntry], rows: int | None = None,
                 slots: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """What `greedy_rows` reads, on the host: per logits row the token its argmax must
    equal for the entry to go on (the next draft; -1 at the entry's last row: never equal)
    and its entry; per entry its first row. Padded to `rows` rows (entry `slots - 1`, a
    spare one, target -1) and `slots` entries (first row 0), as a CUDA-graph bucket holds."""
    target, entry, start, row = [], [], [], 0
    for e, v in enumerate(entries):
        k = len(v.draft)
        target += [*v.draft, -1]
        entry += [e] * (k + 1)
        start.append(row)
        row += k + 1
    if rows is not None:
        if row > rows or slots is None or len(entries) >= slots:
            raise ValueError(f"{row} rows of {len(entries)} entries do not fit {rows} rows "
                             f"and {slots} entries (one spare)")
        target += [-1] * (rows - row)
        entry += [slots - 1] * (rows - row)
        start += [0] * (slots - len(entries))
    return target, entry, start


def greedy_rows(logits: torch.Tensor, target: torch.Tensor, entry: torch.Tensor,
                start: torch.Tensor) -> torch.Tensor:
    """Greedy verification, every entry at once, in shapes set only by the row and entry
    counts (so a CUDA graph captures it): an entry accepts its drafts up to the first row
    whose argmax differs from its target, and that row's argmax is its next token.
    `greedy_table` gives target [R], entry [R] and start [N]; returns [2, N] as `decide`."""
    top = logits.argmax(dim=-1)                                       # [R]
    rows = torch.arange(top.shape[0], device=top.device)
    stop = torch.where(top != target, rows, top.shape[0])             # a row that stops
    first = torch.full_like(start, top.shape[0]).scatter_reduce(      # the entry's first
        0, entry, stop, reduce="amin")                                # such row
    return torch.stack([first - start, top[first.clamp(max=top.shape[0] - 1)]])


def _greedy(logits: torch.Tensor, entries: list[VerifyEntry]) -> torch.Tensor:
    """`decide` for greedy entries with drafts: their table copied to the device in one
    copy, then `greedy_rows` (a drafted window's host time is the engine's at several
    streams, so few launches)."""
    target, entry, start = greedy_table(entries)
    t = torch.tensor(target + entry + start, dtype=torch.long).to(logits.device,
                                                                   non_blocking=True)
    rows = len(target)
    return greedy_rows(logits, t[:rows], t[rows:2 * rows], t[2 * rows:])


def emitted(entries: list[VerifyEntry], decided: list[list[int]]) -> list[list[int]]:
    """Per entry its accepted drafts and one more token, from `decide`'s rows read back."""
    counts, tokens = decided
    return [e.draft[:a] + [t] for e, a, t in zip(entries, counts, tokens)]


def _row_params(entries: list[VerifyEntry]) -> list[SamplingParams]:
    return [e.params for e in entries for _ in range(len(e.draft) + 1)]


def position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """The generator of a seeded request's draw for the token at `position`."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + position) % (2 ** 63))
    return gen


class _Layout:
    """Where each entry's rows and drafts are, as small device tensors built in one copy."""

    def __init__(self, entries: list[VerifyEntry], device: torch.device):
        ks = [len(e.draft) for e in entries]
        self.K = max(ks)
        table, row = [], 0
        for e, k in zip(entries, ks):
            table.append([row, k] + e.draft + [0] * (self.K - k))
            row += k + 1
        t = torch.tensor(table, dtype=torch.long).to(device, non_blocking=True)  # [N, 2 + K]
        self.starts, self.ks = t[:, 0], t[:, 1]
        self.drafts = t[:, 2:]                                      # [N, K], padded with 0
        j = torch.arange(self.K, device=device)
        self.valid = j[None, :] < self.ks[:, None]                  # [N, K]
        self.rows = torch.where(self.valid, self.starts[:, None] + j, self.starts[:, None])
