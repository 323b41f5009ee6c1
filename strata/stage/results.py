"""WindowResult and the last stage's duties after its layers.

The last stage, wherever it runs (this process or a stage process), turns a window's
logits into its result: the Verifier decides each sampling entry's accepted drafts plus
one token, then the MTP layer (when the model has one) drafts each entry's next window.
Only the small WindowResult travels back to the scheduler, which commits it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.config import EngineConfig
from strata.drafting.draft import Draft
from strata.sampling.verifier import Verifier
from strata.scheduler.window import WindowHeader
from strata.stage.mtp_drafter import MTPDrafter
from strata.stage.stage import Stage


@dataclass
class WindowResult:
    tokens: list[list[int]]           # per sampling entry: accepted drafts, then one token
    stage_drafts: list[Draft] | None = None  # per sampling entry: the MTP layer's drafts
    logits: torch.Tensor | None = None  # [T, vocab] on the host, for logits_all windows only
    stage_seconds: list[float] = field(default_factory=list)  # each stage's compute time


class WindowVerifier:
    """The last stage's Verifier and MTP drafter."""

    def __init__(self, last: Stage, config: EngineConfig):
        self.verifier = Verifier()
        self.simulate_acceptance = config.simulate_acceptance
        self.mtp = (MTPDrafter(last.module.mtp, last.mtp_cache, last.backend, config.spec,
                               config.spec_min_p) if last.mtp_cache is not None else None)

    def finish(self, header: WindowHeader, logits: torch.Tensor,
               hidden: torch.Tensor) -> WindowResult:
        """logits: the rows header.logits_idx() asks for; hidden: final-norm [T, hidden]."""
        full = None
        if header.logits_all:
            full = logits.float().cpu()
            logits = logits[header.sample_rows.to(logits.device)]
        entries = header.verify
        if self.simulate_acceptance is not None:
            tokens = self.verifier.simulate(logits, entries, self.simulate_acceptance)
        else:
            tokens = self.verifier.verify(logits, entries) if entries else []  # NOTE: host sync
        drafts = self.mtp.draft(header, tokens, hidden) if self.mtp is not None else None
        return WindowResult(tokens, drafts, full)
