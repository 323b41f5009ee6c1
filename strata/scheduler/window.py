"""Window: one forward unit for one group, built by the scheduler.

For each entry (a slot) a run of tokens with explicit positions and cache rows. The part
every stage needs travels as a WindowHeader: token ids, positions, KV rows and block
tables, each entry's slot, committed length and state rows, and for the last stage the
logits rows the verifier reads and the rows the MTP layer writes. Everything in it was
decided by the scheduler; stages only read it. The Window keeps, beside its header, the
scheduler's own references (requests, drafts), which never leave the scheduler's process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.drafting.draft import Draft
from strata.request import Request
from strata.sampling.verifier import VerifyEntry


def num_committed(query_len: int, num_drafts: int, accepted: int) -> int:
    """Tokens of an entry's run whose KV stays valid once the verifier has accepted
    `accepted` of its `num_drafts` drafts: its known tokens and the accepted drafts. The
    scheduler commits this many; the last stage's MTP layer runs over the same positions."""
    return query_len - num_drafts + accepted


@dataclass
class WindowHeader:
    group: int
    slots: list[int]               # slot of each entry
    starts: list[int]              # each entry's committed length before the window (its
                                   # first position)
    query_lens: list[int]          # tokens of each entry
    samples: list[bool]            # does the entry end at its request's last token (+ drafts)
    num_drafts: list[int]          # drafts each entry carries after its last known token
    token_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    slot_mapping: torch.Tensor     # [T] KV-cache row each token writes
    block_tables: torch.Tensor     # [B, max_blocks]
    block_size: int
    sample_rows: torch.Tensor      # [S] window rows whose logits the verifier reads, in order
    verify: list[VerifyEntry]      # one per sampling entry, in entry order
    following: list[int | None]    # per entry: the known token after a non-sampling entry's run
    state_rows: torch.Tensor | None = None  # [B, rows per slot] each entry's slot state rows
    mtp_rows: torch.Tensor | None = None    # [B, W] MTP-cache row of position start + 1 + j
    mtp_lens: list[int] | None = None       # per entry: how many of its mtp_rows exist
    logits_all: bool = False       # logits for every token (scoring), not only sampling entries
    # A window built ahead: token_ids[carry_rows[i]] is a placeholder for the token the
    # group's previous window decides for its entry carry_from[i] (on the device).
    carry_rows: list[int] = field(default_factory=list)
    carry_from: list[int] = field(default_factory=list)
    # Per carried entry of a hedge (Scheduler, `hedge`), the first draft of its entry in
    # the previous window, else -1: a hedge takes the token at that draft's position,
    # which is the draft where the previous window accepts it and the token decided there
    # where it does not (so a void hedge rewrites the KV the previous window wrote).
    carry_first: list[int] = field(default_factory=list)
    # KV blocks to copy before the window computes, on every stage (the conversation
    # cache, kvcache/host.py): (device block, host block) out, then (host block, device
    # block) back.
    spills: list[tuple[int, int]] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    # Rows of per-slot state to copy before it computes, in order (a slot's state at a
    # block boundary to its snapshot row, a snapshot to a reusing slot: kvcache/snapshots.py).
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def carry(self) -> bool:
        """Some of the window's input tokens come from the group's previous window."""
        return bool(self.carry_rows)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def logits_idx(self) -> torch.Tensor:
        """Rows whose logits the last stage computes."""
        return torch.arange(self.num_tokens) if self.logits_all else self.sample_rows


@dataclass
class Window:
    header: WindowHeader
    requests: list[Request]       # request of each entry
    drafts: list[Draft | None]    # drafts the entry carries after its last known token
    hedges: list[bool] = field(default_factory=list)  # per entry (or none): a hedge, one
                                  # token on as if every draft of its slot in flight failed
