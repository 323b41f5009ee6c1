"""WindowResult and the last stage's duties after its layers.

The last stage, wherever it runs (this process or a stage process), turns a window's
logits into its result: the Verifier decides each sampling entry's accepted drafts plus
one token, then the MTP layer (when the model has one) drafts each entry's next window.
Only the small WindowResult travels back to the scheduler, which commits it.

A failure while verifying one entry (its sampling parameters, its logit bias) fails that
entry only: the window is verified again entry by entry, and the failing entries come back
with an error instead of tokens, which the scheduler turns into a failed request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from strata.config import EngineConfig
from strata.drafting.draft import Draft
from strata.sampling.logprobs import TokenLogprob, token_logprobs
from strata.sampling.verifier import Verifier, VerifyEntry
from strata.scheduler.window import WindowHeader
from strata.stage.mtp_drafter import MTPDrafter
from strata.stage.stage import Stage

log = logging.getLogger("strata.engine")


@dataclass
class WindowResult:
    tokens: list[list[int]]           # per sampling entry: accepted drafts, then one token
    stage_drafts: list[Draft] | None = None  # per sampling entry: the MTP layer's drafts
    logits: torch.Tensor | None = None  # [T, vocab] on the host, for logits_all windows only
    stage_seconds: list[float] = field(default_factory=list)  # each stage's compute time
    errors: list[str | None] | None = None  # per sampling entry: why it failed, or None
    logprobs: list[list[TokenLogprob] | None] | None = None  # per sampling entry, if asked


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
        try:
            tokens, logprobs = self._decide(logits, entries)
            errors = None
        except Exception:  # noqa: BLE001 - find the entries that fail; the others go on
            tokens, logprobs, errors = self._decide_apart(logits, entries)
        drafts = None
        if self.mtp is not None:
            try:
                drafts = self.mtp.draft(header, tokens, hidden)
            except Exception:  # noqa: BLE001 - drafts are optional; this window has none
                log.exception("MTP drafting failed for a window; it goes on without drafts")
        return WindowResult(tokens, drafts, full, errors=errors,
                            logprobs=logprobs if any(logprobs) else None)

    def _decide(self, logits: torch.Tensor, entries: list[VerifyEntry]):
        """Each entry's tokens, and their logprobs where asked."""
        if not entries:
            return [], []
        if self.simulate_acceptance is not None:
            tokens = self.verifier.simulate(logits, entries, self.simulate_acceptance)
        else:
            tokens = self.verifier.verify(logits, entries)  # NOTE: host sync
        return tokens, token_logprobs(logits, entries, tokens)

    def _decide_apart(self, logits: torch.Tensor, entries: list[VerifyEntry]):
        """`_decide` entry by entry; a failing entry gets an error and a placeholder token
        (its request is finished with the error, so the token is never used)."""
        tokens, logprobs, errors = [], [], []
        start = 0
        for entry in entries:
            rows = logits[start:start + len(entry.draft) + 1]
            start += len(entry.draft) + 1
            try:
                [entry_tokens], [entry_logprobs] = self._decide(rows, [entry])
                error = None
            except Exception as e:  # noqa: BLE001 - this entry's request fails, alone
                log.exception("sampling failed for %s", entry.request_id)
                entry_tokens, entry_logprobs = [int(rows[0].argmax())], None
                error = f"sampling this request's next token failed ({type(e).__name__})"
            tokens.append(entry_tokens)
            logprobs.append(entry_logprobs)
            errors.append(error)
        return tokens, logprobs, errors
