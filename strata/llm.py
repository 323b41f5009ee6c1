"""LLM: the text front of the engine for one process: tokenizer, chat template, stop
strings and incremental detokenisation around an Engine that only knows tokens.

Used by `strata generate` and by tests; the server drives the engine the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.request import DraftStats, Request
from strata.sampling.params import SamplingParams
from strata.stage.runner import check_device
from strata.tokenizer import Tokenizer
from strata.tokenizer.detokenize import IncrementalDetokenizer
from strata.weights.checkpoint import open_checkpoint

log = logging.getLogger("strata")


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    drafts: DraftStats


@dataclass
class TextStream:
    """One request's text side: its detokenizer and how many output ids it has seen.
    Whoever drives the engine ends the request when `stopped` (a stop string appeared)."""
    request: Request
    detok: IncrementalDetokenizer
    fed: int = field(default=0)

    def advance(self) -> str:
        """Detokenize the request's new output ids; the text they complete."""
        ids = self.request.token_ids[self.request.num_prompt_tokens + self.fed:]
        self.fed += len(ids)
        return self.detok.feed(ids) if ids else ""

    @property
    def stopped(self) -> bool:
        return self.detok.stopped

    def completion(self) -> Completion:
        self.detok.flush()
        reason = "stop" if self.stopped else self.request.finish_reason
        return Completion(self.detok.text, self.request.output_ids, reason,
                          self.request.num_prompt_tokens, self.request.draft_stats)


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], raw: bool = False) -> list[int]:
    """Token ids of a plain prompt (`raw`) or of chat messages through the template.
    A string that is not raw becomes one user message."""
    if raw:
        return tokenizer.encode(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.encode_chat(messages, add_generation_prompt=True)


class LLM:
    def __init__(self, config: EngineConfig, checkpoint=None, tokenizer: Tokenizer | None = None):
        start = time.perf_counter()
        checkpoint = (checkpoint if checkpoint is not None
                      else open_checkpoint(config.model, config.mtp_model))
        # NOTE: devices and the split first, then the tokenizer: both fail before any loading
        ranges = config.stage_ranges(checkpoint.config.num_layers)
        devices = [config.stage_device(i) for i in range(len(ranges))]
        for device in devices:
            check_device(device)
        self.tokenizer: Tokenizer = tokenizer or checkpoint.load_tokenizer()
        where = (f"on {devices[0]}" if len(set(map(str, devices))) == 1 and not
                 config.stage_processes else "on " + ", ".join(map(str, devices)))
        log.info("loading %s: %d layers, %d stage%s %s%s", checkpoint.path.name,
                 checkpoint.config.num_layers, len(ranges), "s" if len(ranges) > 1 else "",
                 where, " (one process each)" if config.stage_processes else "")
        self.engine = Engine(config, checkpoint)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | self.engine.eos_token_ids
        log.info("ready in %.1f s", time.perf_counter() - start)

    def close(self) -> None:
        """Stop the stage processes, if the engine runs any."""
        self.engine.close()

    def encode_prompt(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, raw)

    def add(self, prompt_ids: list[int], params: SamplingParams) -> TextStream:
        request = self.engine.add_request(prompt_ids, params, eos_token_ids=self.eos_token_ids)
        return TextStream(request, IncrementalDetokenizer(self.tokenizer, stop=list(params.stop)))

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        """Run one request to completion, yielding its text as it is produced; the
        finished Completion is left in `self.last`."""
        job = self.add(prompt_ids, params)
        try:
            while not job.request.finished:
                self.engine.step()
                piece = job.advance()
                if job.stopped:
                    self.engine.abort(job.request.request_id)
                if piece:
                    yield piece
            tail = job.detok.flush()
            if tail:
                yield tail
        finally:
            if not job.request.finished:
                self.engine.abort(job.request.request_id)
        if job.request.finish_reason == "error":
            raise StrataError(job.request.error)
        self.last = job.completion()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Run many prompts together to completion."""
        jobs = [self.add(p, params) for p in prompts]
        while any(not job.request.finished for job in jobs):
            self.engine.step()
            for job in jobs:
                job.advance()
                if job.stopped and not job.request.finished:
                    self.engine.abort(job.request.request_id)
        return [job.completion() for job in jobs]
