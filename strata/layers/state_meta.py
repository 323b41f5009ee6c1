"""StateMeta: where a window's layers with per-slot state (layers/deltanet.py) read and
write their rows, as a few index tensors built on the host once per window.

Per entry: its first token in the window, its length, the row holding the state before its
run (column 0 of the scheduler's `state_rows`), and whether it starts afresh (its run
begins at position 0, or it is padding). Per token: its entry, its index in the entry's
run, and the row that receives the state after it, or -1: the state after an entry's last
known token goes to the entry's column 1, after its j-th draft to column 1 + j (the
verifier's choice among them is the scheduler's, see scheduler.py). Nothing here depends
on the model, so a window padded to a CUDA-graph bucket (stage/buckets.py) only adds
tokens and entries that read nothing and write nothing: the layers' kernels read these
tensors on the device, and a graph replays any window of its bucket's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateMeta:
    entry_start: torch.Tensor   # [E] first token of each entry's run in the window
    entry_len: torch.Tensor     # [E] its tokens (0: an unused entry of a padded window)
    entry_source: torch.Tensor  # [E] row of the state before its run (read unless fresh)
    entry_fresh: torch.Tensor   # [E] 1: the run starts from a zero state
    token_entry: torch.Tensor   # [T] each token's entry
    token_index: torch.Tensor   # [T] its index in the entry's run
    token_row: torch.Tensor     # [T] the row receiving the state after it, -1: none

    @classmethod
    def build(cls, query_lens: Sequence[int], starts: Sequence[int],
              num_drafts: Sequence[int], state_rows: torch.Tensor | None,
              num_tokens: int | None = None, num_entries: int | None = None) -> StateMeta:
        """On the host, from the window header's lists and `state_rows` [B, rows per slot]
        (None: no entry reads or writes a row, as in a window captured blank). A padded
        window has `num_tokens` tokens (the extra ones: one more fresh entry that writes
        nothing) and `num_entries` entries (the extra ones empty)."""
        real = sum(query_lens)
        num_tokens = real if num_tokens is None else num_tokens
        lens = list(query_lens) + ([num_tokens - real] if num_tokens > real else [])
        num_entries = len(lens) if num_entries is None else num_entries
        if num_tokens < real or num_entries < len(lens):
            raise ValueError(f"{real} tokens in {len(lens)} entries do not fit "
                             f"{num_tokens} tokens and {num_entries} entries")
        lens += [0] * (num_entries - len(lens))
        first = torch.tensor([0, *lens[:-1]]).cumsum(0)
        source = torch.zeros(num_entries, dtype=torch.long)
        fresh = torch.ones(num_entries, dtype=torch.long)
        token_row = torch.full((num_tokens,), -1, dtype=torch.long)
        for e, (count, start, drafts) in enumerate(zip(query_lens, starts, num_drafts)):
            if state_rows is None:
                continue
            rows = state_rows[e]
            source[e], fresh[e] = rows[0], int(start == 0)
            kept = drafts + 1  # the last known token and each draft
            end = int(first[e]) + count
            token_row[end - kept:end] = rows[1:1 + kept]
        lens_t = torch.tensor(lens, dtype=torch.long)
        token_entry = torch.repeat_interleave(torch.arange(num_entries), lens_t)
        return cls(entry_start=first, entry_len=lens_t, entry_source=source, entry_fresh=fresh,
                   token_entry=token_entry,
                   token_index=torch.arange(num_tokens) - first[token_entry],
                   token_row=token_row)

    def to(self, device: torch.device | str) -> StateMeta:
        return StateMeta(*(getattr(self, name).to(device, non_blocking=True)
                           for name in self.__dataclass_fields__))
