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
from strata.sampling.params import SamplingParams
from strata.sampling.verifier import Verifier, VerifyEntry, emitted
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
    # each stage's expert cache counts since its last report (ExpertStats' fields), where
    # a stage keeps experts in host RAM; else empty
    expert_stats: list[list[float]] = field(default_factory=list)
    errors: list[str | None] | None = None  # per sampling entry: why it failed, or None
    logprobs: list[list[TokenLogprob] | None] | None = None  # per sampling entry, if asked


@dataclass
class LaunchedWindow:
    """A window whose verification is queued on the device behind its layers; `finish`
    reads it back."""
    header: WindowHeader
    logits: torch.Tensor              # the rows header.logits_idx() asked for
    rows: torch.Tensor                # the sampling entries' rows of them
    hidden: torch.Tensor
    decided: torch.Tensor             # the Verifier's [2, N] on the device
    apart: tuple | None = None        # (tokens, logprobs, errors) when deciding the window
                                      # raised and its entries were decided one by one
    host: torch.Tensor | None = None  # `decided` copied to pinned host memory (CUDA)...
    done: torch.cuda.Event | None = None  # ...ready once this event has passed

    def __post_init__(self) -> None:
        """On CUDA, queue the copy of `decided` to the host right behind the window, so
        that reading it waits for this window only, not for windows launched after it."""
        if self.decided.is_cuda:
            with torch.cuda.device(self.decided.device):
                self.host = torch.empty(self.decided.shape, dtype=self.decided.dtype,
                                        pin_memory=True)
                self.host.copy_(self.decided, non_blocking=True)
                self.done = torch.cuda.Event()
                self.done.record()

    def wait(self) -> None:
        """Block until the window's verification has reached the host."""
        if self.done is not None:
            self.done.synchronize()

    def decisions(self) -> list[list[int]]:
        self.wait()
        return (self.host if self.host is not None else self.decided).tolist()


class WindowVerifier:
    """The last stage's Verifier and MTP drafter."""

    def __init__(self, last: Stage, config: EngineConfig):
        self.verifier = Verifier()
        self.simulate_acceptance = config.simulate_acceptance
        self.mtp = (MTPDrafter(last.module.mtp, last.mtp_cache, last.backend, config.spec,
                               config.spec_min_p) if last.mtp_cache is not None else None)
        self.warm_up(last.device, last.dtype, last.arch.config.vocab_size)

    def warm_up(self, device: torch.device, dtype: torch.dtype, vocab: int) -> torch.Tensor:
        """Verify a made-up window once, greedy and sampled entries with drafts: a device's
        first use of these kernels happens at start-up, not in the first drafted window
        (which then stalled ~0.1 s on an H200). Returns the decisions (tests)."""
        greedy = SamplingParams(temperature=0)
        sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=0)
        entries = [VerifyEntry(greedy, "warm-up", [1, 2]),
                   VerifyEntry(sampled, "warm-up", [3], position=1)]
        logits = torch.zeros(5, vocab, dtype=dtype, device=device)
        logits[:, 1] = 1.0  # greedy: d1 = 1 is accepted, d2 = 2 is not
        return self.verifier.decide(logits, entries).cpu()

    def launch(self, header: WindowHeader, logits: torch.Tensor, hidden: torch.Tensor,
               greedy: torch.Tensor | None = None) -> LaunchedWindow:
        """Queue the window's verification (no host read). logits: the rows
        header.logits_idx() asks for; hidden: final-norm [T, hidden]; greedy: the
        decisions the stage's graph made as if every entry were plain greedy (used where
        they are: no sampling, no logit bias)."""
        rows = logits[header.sample_rows.to(logits.device)] if header.logits_all else logits
        apart = None
        try:
            if greedy is not None and self._plain_greedy(header):
                decided = greedy
            else:
                decided = self._decide(rows, header.verify)
        except Exception:  # noqa: BLE001 - find the entries that fail; the others go on
            apart = self._decide_apart(rows, header.verify)  # NOTE: host reads, rare
            decided = torch.tensor([[len(t) - 1 for t in apart[0]], [t[-1] for t in apart[0]]],
                                   dtype=torch.long).to(logits.device)
        return LaunchedWindow(header, logits, rows, hidden, decided, apart)

    def finish(self, launched: LaunchedWindow) -> WindowResult:
        """Read the verification back (the window's host read, which waits for the
        device), then draft with MTP."""
        header, entries = launched.header, launched.header.verify
        full = launched.logits.float().cpu() if header.logits_all else None
        if launched.apart is not None:
            tokens, logprobs, errors = launched.apart
        else:
            tokens = emitted(entries, launched.decisions())
            try:
                logprobs, errors = token_logprobs(launched.rows, entries, tokens), None
            except Exception:  # noqa: BLE001 - find the entries that fail; the others go on
                tokens, logprobs, errors = self._decide_apart(launched.rows, entries)
        drafts = None
        if self.mtp is not None:
            try:
                drafts = self.mtp.draft(header, tokens, launched.hidden)
            except Exception:  # noqa: BLE001 - drafts are optional; this window has none
                log.exception("MTP drafting failed for a window; it goes on without drafts")
        return WindowResult(tokens, drafts, full, errors=errors,
                            logprobs=logprobs if any(logprobs) else None)

    def _plain_greedy(self, header: WindowHeader) -> bool:
        """Does `greedy_rows` decide this window as `decide` would?"""
        return (self.simulate_acceptance is None and not header.logits_all
                and all(e.params.greedy and not e.params.logit_bias for e in header.verify))

    def _decide(self, logits: torch.Tensor, entries: list[VerifyEntry]) -> torch.Tensor:
        """The Verifier's [2, N] on the device (or the simulated acceptance's)."""
        if self.simulate_acceptance is not None:
            return self.verifier.simulate(logits, entries, self.simulate_acceptance)
        return self.verifier.decide(logits, entries)

    def _decide_apart(self, logits: torch.Tensor, entries: list[VerifyEntry]):
        """`_decide` entry by entry; a failing entry gets an error and a placeholder token
        (its request is finished with the error, so the token is never used)."""
        tokens, logprobs, errors = [], [], []
        start = 0
        for entry in entries:
            rows = logits[start:start + len(entry.draft) + 1]
            start += len(entry.draft) + 1
            try:
                [entry_tokens] = emitted([entry], self._decide(rows, [entry]).tolist())
                [entry_logprobs] = token_logprobs(rows, [entry], [entry_tokens])
                error = None
            except Exception as e:  # noqa: BLE001 - this entry's request fails, alone
                log.exception("sampling failed for %s", entry.request_id)
                entry_tokens, entry_logprobs = [int(rows[0].argmax())], None
                error = f"sampling this request's next token failed ({type(e).__name__})"
            tokens.append(entry_tokens)
            logprobs.append(entry_logprobs)
            errors.append(error)
        return tokens, logprobs, errors
