"""Window: one forward unit for one group, built by the scheduler.

For each entry (a slot) a run of tokens with explicit positions and cache rows. The
part every stage needs travels as a WindowHeader (small: token ids, positions, cache rows,
block tables, and for the last stage what the verifier needs); the Window keeps, beside its
header, the scheduler's own references (slots, requests, drafts), which never leave the
scheduler's process. Only the scheduler interprets a window; stages execute its header.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.request import Request
from strata.layers.forward_meta import ForwardMeta
from strata.drafting.draft import Draft
from strata.sampling.verifier import VerifyEntry


@dataclass
class WindowHeader:
    group: int
    query_lens: list[int]          # tokens of each entry
    samples: list[bool]            # does the entry end at its request's last token (+ drafts)
    num_drafts: list[int]          # drafts each entry carries after its last known token
    token_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    slot_mapping: torch.Tensor     # [T]
    block_tables: torch.Tensor     # [B, max_blocks]
    block_size: int
    verify: list[VerifyEntry]      # one per sampling entry, in entry order
    following: list[int | None]    # per entry: the known token after a non-sampling entry's run
    logits_all: bool = False       # logits for every token (scoring), not only sampling entries
    _metas: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def num_rows(self, entry: int) -> int:
        """Logits rows of a sampling entry: its last known token and each draft."""
        return 1 + self.num_drafts[entry]

    def logits_idx_of_samples(self) -> torch.Tensor:
        """Rows of the window whose logits the verifier reads, entry by entry."""
        ends = torch.cumsum(torch.tensor(self.query_lens), 0)
        rows = [torch.arange(end - self.num_rows(i), end)
                for i, end in enumerate(ends.tolist()) if self.samples[i]]
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)

    def logits_idx(self) -> torch.Tensor:
        if self.logits_all:
            return torch.arange(self.num_tokens)
        return self.logits_idx_of_samples()

    def meta(self, device: torch.device) -> ForwardMeta:
        """ForwardMeta on `device`, built once per device and window."""
        key = str(device)
        if key not in self._metas:
            self._metas[key] = ForwardMeta.build(
                query_lens=self.query_lens, positions=self.positions,
                slot_mapping=self.slot_mapping, block_tables=self.block_tables,
                block_size=self.block_size, logits_idx=self.logits_idx(), device=device)
        return self._metas[key]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_metas"] = {}  # device tensors are rebuilt where the header lands
        return state


@dataclass
class Window:
    header: WindowHeader
    slots: list[int]              # slot index of each entry
    requests: list[Request]       # request of each entry
    drafts: list[Draft | None]    # drafts the entry carries after its last known token
