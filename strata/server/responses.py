"""From requests' token streams to OpenAI's response shapes: incremental text with stop
strings (`text_stream`), whole responses (`whole`) and SSE chunks (`sse`), for one choice
or n, with logprobs where asked.

A whole response stops its engine requests as soon as its client goes away; a stream does
so when Starlette cancels it. A stream that waits (for a slot, or a long prompt) sends an
SSE comment line every --sse-keepalive seconds, so proxies and clients keep it open.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from strata.server.async_engine import AsyncEngine, RequestHandle
from strata.server.errors import APIError, error_body
from strata.tokenizer.detokenize import IncrementalDetokenizer

log = logging.getLogger("strata.server")

MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM reports the same floor)


@dataclass
class Piece:
    text: str
    finish: str | None        # "stop" or "length" on the last piece
    completion_tokens: int    # so far
    drafts: dict | None = None  # draft statistics, on the last piece
    logprobs: list | None = None  # TokenLogprob of the tokens that came with this piece


async def text_stream(handle: RequestHandle, engine: AsyncEngine, tokenizer, stop,
                      keepalive: float | None = None) -> AsyncIterator[Piece | None]:
    """Pieces of text as tokens arrive (None: `keepalive` seconds passed with nothing).
    Ends the engine request early on a stop string, and on any other exit (a client gone).
    A failed request raises APIError."""
    detok = IncrementalDetokenizer(tokenizer, stop=list(stop))
    tokens, start, first = 0, time.perf_counter(), None
    finish, drafts, error = None, None, None
    try:
        async for update in handle.updates(keepalive):
            if update is None:
                yield None
                continue
            if update.error is not None:
                error = update.error
                raise APIError(update.error_status, update.error)
            tokens += len(update.token_ids)
            first = first or time.perf_counter()
            text = detok.feed(update.token_ids)
            finish = "stop" if detok.stopped else update.finish_reason
            if finish is not None:
                drafts = update.drafts
                logprobs = update.logprobs
                if logprobs and update.finish_reason == "stop" and not detok.stopped:
                    logprobs = logprobs[:-1]  # the end-of-turn token: not part of the text
                yield Piece(text + detok.flush(), "length" if finish == "length" else "stop",
                            tokens, drafts, logprobs)
                return
            if text or update.logprobs:
                yield Piece(text, None, tokens, logprobs=update.logprobs)
    finally:
        if finish is None or detok.stopped:  # client gone, or a stop string ended it early
            engine.abort(handle.request_id)
        seconds = time.perf_counter() - (first or start)
        accepted = (f" {'SIMULATED ' if drafts.get('simulated') else ''}"
                    f"drafts={drafts['accepted']}/{drafts['drafted']}"
                    if drafts and drafts["drafted"] else "")
        log.info("%s prompt=%d completion=%d %.1f tok/s%s finish=%s", handle.request_id,
                 handle.prompt_tokens, tokens, (tokens - 1) / seconds if tokens > 1 else 0.0,
                 accepted, finish or ("error: " + error if error else "disconnected"))


@dataclass
class Choice:
    """One choice of a whole response, gathered from its pieces."""
    index: int
    text: list[str] = field(default_factory=list)
    last: Piece | None = None
    logprobs: list | None = None

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.last = piece
        if piece.logprobs is not None:
            self.logprobs = (self.logprobs or []) + piece.logprobs


class ResponseShape:
    """OpenAI's JSON for one response: chat or text completion, whole or in chunks."""

    def __init__(self, model: str, chat: bool, tokenizer, logprobs: bool = False):
        self.model, self.chat, self.tokenizer = model, chat, tokenizer
        self.logprobs = logprobs  # the request asked for them
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # completions' text_offset so far, per choice

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt: int, lasts: list[Piece | None], cached: int = 0) -> dict:
        """OpenAI's usage (`cached`: prompt tokens the prefix cache saved), with Strata's
        draft statistics."""
        completion = sum(last.completion_tokens for last in lasts if last)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        drafts = [last.drafts for last in lasts if last is not None and last.drafts is not None]
        if drafts:
            usage["drafts"] = drafts[0] if len(drafts) == 1 else _sum_drafts(drafts)
        return usage

    def full(self, choices: list[Choice], prompt: int, cached: int = 0) -> dict:
        out = []
        for c in choices:
            text, finish = "".join(c.text), c.last.finish if c.last else "stop"
            logprobs = self._logprobs(c.index, c.logprobs or [], text) if self.logprobs else None
            if self.chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": finish})
            else:
                out.append({"index": c.index, "text": text, "logprobs": logprobs,
                            "finish_reason": finish})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._base(obj), "choices": out,
                "usage": self.usage(prompt, [c.last for c in choices], cached)}

    def chunk(self, index: int, text: str | None, finish: str | None, first: bool = False,
              logprobs: list | None = None) -> dict:
        lp = self._logprobs(index, logprobs, text or "") if self.logprobs and logprobs else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt: int, lasts: list[Piece | None], cached: int = 0) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": self.usage(prompt, lasts, cached)}

    # -- logprobs -------------------------------------------------------------------------
    def _token(self, token_id: int) -> tuple[str, list[int]]:
        data = self.tokenizer.token_bytes(token_id)
        return data.decode("utf-8", errors="replace"), list(data)

    def _logprobs(self, index: int, items: list, text: str) -> dict:
        """OpenAI's logprobs object for these tokens: chat's `content` list, or
        completions' parallel lists with each token's offset in the choice's text."""
        if self.chat:
            content = []
            for token_id, logprob, top in items:
                token, data = self._token(token_id)
                content.append({"token": token, "logprob": max(logprob, MIN_LOGPROB),
                                "bytes": data, "top_logprobs": [
                                    {"token": t, "logprob": max(lp, MIN_LOGPROB), "bytes": b}
                                    for (t, b), lp in ((self._token(i), lp) for i, lp in top)]})
            return {"content": content, "refusal": None}
        tokens, logprobs, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        for token_id, logprob, top in items:
            token = self._token(token_id)[0]
            tokens.append(token)
            logprobs.append(max(logprob, MIN_LOGPROB))
            tops.append({self._token(i)[0]: max(lp, MIN_LOGPROB) for i, lp in top})
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
                "text_offset": offsets}


def _sum_drafts(stats: list[dict]) -> dict:
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    by_proposer: dict[str, dict] = {}
    for s in stats:
        for name, p in s["by_proposer"].items():
            total = by_proposer.setdefault(name, {"windows": 0, "drafted": 0, "accepted": 0})
            for key in total:
                total[key] += p[key]
    for p in by_proposer.values():
        p["mean_accepted"] = round(p["accepted"] / p["windows"], 3) if p["windows"] else 0.0
    return {"simulated": any(s["simulated"] for s in stats), "drafted": drafted,
            "accepted": accepted, "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "by_proposer": by_proposer}


async def whole(http: HTTPRequest, shape: ResponseShape, streams: list[AsyncIterator],
                first: RequestHandle) -> dict | Response:
    """The whole response of n choices (`first`: the first choice's request, whose prompt
    the usage counts, read once it has run); if the client goes away first, every
    choice's engine request is aborted at once (no generation runs on for nobody)."""
    choices = [Choice(i) for i in range(len(streams))]

    async def collect(choice: Choice, texts: AsyncIterator) -> None:
        async for piece in texts:
            if piece is not None:
                choice.add(piece)

    tasks = [asyncio.ensure_future(collect(c, t)) for c, t in zip(choices, streams)]
    watcher = asyncio.ensure_future(_disconnected(http))
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending | {watcher},
                                               return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                return Response(status_code=499)  # nobody reads it; the requests are aborted
            pending.discard(watcher)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, watcher, return_exceptions=True)
    return shape.full(choices, first.prompt_tokens, first.request.num_cached_tokens)


async def _interleaved(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(choice, Piece | None | APIError) as each choice's pieces come, until every choice
    ended; a choice's APIError is its last item. Closing it closes every stream (their
    engine requests are aborted). One choice is read directly: no task per token."""
    if len(streams) == 1:
        try:
            async for piece in streams[0]:
                yield 0, piece
        except APIError as e:
            yield 0, e
        finally:
            await streams[0].aclose()
        return
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, texts: AsyncIterator) -> None:
        try:
            async for piece in texts:
                await merged.put((index, piece))
        except APIError as e:
            await merged.put((index, e))
        finally:
            await merged.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, t)) for i, t in enumerate(streams)]
    running = len(streams)
    try:
        while running:
            index, item = await merged.get()
            if item is done:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client disconnects (the body was read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def sse(shape: ResponseShape, handles: list[RequestHandle], streams: list[AsyncIterator],
              include_usage: bool) -> AsyncIterator[str]:
    """SSE events of n choices, interleaved as their tokens come; an SSE comment for a
    keepalive tick; an error event if a choice fails; the usage chunk; [DONE]."""
    def event(data: dict) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    lasts: list[Piece | None] = [None] * len(streams)
    pieces = _interleaved(streams)
    try:
        if shape.chat:
            for i in range(len(streams)):
                yield event(shape.chunk(i, None, None, first=True))
        async for index, item in pieces:
            if item is None:
                yield ": waiting\n\n"
            elif isinstance(item, APIError):
                yield event(error_body(item.status, item.message))
                break
            else:
                lasts[index] = item
                if item.text or item.logprobs:
                    yield event(shape.chunk(index, item.text, None, logprobs=item.logprobs))
                if item.finish is not None:
                    yield event(shape.chunk(index, None, item.finish))
    finally:
        await pieces.aclose()
    if include_usage:
        yield event(shape.usage_chunk(handles[0].prompt_tokens, lasts,
                                      handles[0].request.num_cached_tokens))
    yield "data: [DONE]\n\n"
