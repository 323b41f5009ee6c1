"""From a request's token stream to OpenAI's response shapes: incremental text with stop
strings (`text_stream`), whole responses and SSE chunks (`ResponseShape`, `sse`)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from strata.server.async_engine import AsyncEngine, RequestHandle
from strata.server.errors import APIError
from strata.tokenizer.detokenize import IncrementalDetokenizer

log = logging.getLogger("strata.server")


@dataclass
class Piece:
    text: str
    finish: str | None        # "stop" or "length" on the last piece
    completion_tokens: int    # so far
    drafts: dict | None = None  # draft statistics, on the last piece


async def text_stream(handle: RequestHandle, engine: AsyncEngine, stop) -> AsyncIterator[Piece]:
    """Pieces of text as tokens arrive. Ends the engine request early on a stop string,
    and on any other exit (a client gone)."""
    detok = IncrementalDetokenizer(engine.llm.tokenizer, stop=list(stop))
    tokens, start, first = 0, time.perf_counter(), None
    finish, drafts = None, None
    try:
        async for update in handle.updates():
            if update.error is not None:
                raise APIError(503, update.error)
            tokens += len(update.token_ids)
            first = first or time.perf_counter()
            text = detok.feed(update.token_ids)
            finish = "stop" if detok.stopped else update.finish_reason
            if finish is not None:
                drafts = update.drafts
                yield Piece(text + detok.flush(), "length" if finish == "length" else "stop",
                            tokens, drafts)
                return
            if text:
                yield Piece(text, None, tokens)
    finally:
        if finish is None or detok.stopped:  # client gone, or a stop string ended it early
            engine.abort(handle.request_id)
        seconds = time.perf_counter() - (first or start)
        accepted = (f" {'SIMULATED ' if drafts.get('simulated') else ''}"
                    f"drafts={drafts['accepted']}/{drafts['drafted']}"
                    if drafts and drafts["drafted"] else "")
        log.info("%s prompt=%d completion=%d %.1f tok/s%s finish=%s", handle.request_id,
                 handle.prompt_tokens, tokens, (tokens - 1) / seconds if tokens > 1 else 0.0,
                 accepted, finish or "disconnected")


class ResponseShape:
    """OpenAI's JSON for one response: chat or text completion, whole or in chunks."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt: int, last: Piece | None) -> dict:
        completion = last.completion_tokens if last else 0
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
        if last is not None and last.drafts is not None:
            usage["drafts"] = last.drafts  # extension: speculative decoding statistics
        return usage

    def full(self, text: str, last: Piece, prompt: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": last.finish}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish}
            body = self._base("text_completion")
        return {**body, "choices": [choice], "usage": self.usage(prompt, last)}

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt: int, last: Piece | None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": self.usage(prompt, last)}


async def sse(shape: ResponseShape, handle: RequestHandle, texts: AsyncIterator[Piece],
              include_usage: bool) -> AsyncIterator[str]:
    def event(data: dict) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    last = None
    try:
        if shape.chat:
            yield event(shape.chunk(None, None, first=True))
        async for last in texts:
            if last.text:
                yield event(shape.chunk(last.text, None))
            if last.finish is not None:
                yield event(shape.chunk(None, last.finish))
    except APIError as e:
        yield event({"error": {"message": e.message, "type": "server_error", "code": e.status}})
    finally:
        await texts.aclose()
    if include_usage:
        yield event(shape.usage_chunk(handle.prompt_tokens, last))
    yield "data: [DONE]\n\n"
