"""The FastAPI application: OpenAI routes, health and metrics.

Handlers turn HTTP bodies into prompt token ids and SamplingParams, submit them to the
AsyncEngine, and turn the token stream back into text (stop strings included) in
OpenAI's response or SSE chunk shape.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from strata.errors import StrataError
from strata.server.async_engine import AsyncEngine, QueueFull, RequestHandle
from strata.server.config import ServerConfig
from strata.server.errors import APIError, BodyLimit, error_response, parse_json, validation_message
from strata.server.metrics import Metrics
from strata.server.protocol import ChatRequest, CompletionRequest
from strata.tokenizer.detokenize import IncrementalDetokenizer

log = logging.getLogger("strata.server")


def build_app(engine: AsyncEngine, config: ServerConfig, model_name: str,
              metrics: Metrics) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="Strata", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_request, err: APIError):
        if err.status in (429, 503):
            metrics.rejected.labels(str(err.status)).inc()
        return error_response(err)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if config.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {config.api_key}":
                return error_response(APIError(401, "missing or wrong API key: send "
                                                    "'Authorization: Bearer KEY'"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if engine.ready:
            return {"status": "ok"}
        return JSONResponse({"status": engine.status, "error": engine.error}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()),
            "owned_by": "strata",
            "max_model_len": engine.llm.engine.max_context if engine.ready else None}]}

    def parse(body: bytes, cls):
        try:
            req = cls.model_validate(parse_json(body))
        except ValidationError as e:
            message, param = validation_message(e)
            raise APIError(400, message, param) from None
        if req.model != model_name:
            raise APIError(404, f"model '{req.model}' not found; this server serves "
                                f"'{model_name}'", "model")
        if not engine.ready:
            raise APIError(503, f"the model is not ready ({engine.status})",
                           headers={"Retry-After": "5"})
        return req

    def submit(prompt_ids: list[int], params) -> RequestHandle:
        try:
            return engine.submit(prompt_ids, params)
        except StrataError as e:
            raise APIError(400, str(e)) from None
        except QueueFull:
            raise APIError(429, "too many requests: every slot is busy and the queue is full",
                           headers={"Retry-After": "1"}) from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(await request.body(), ChatRequest)
        tokenizer = engine.llm.tokenizer
        try:
            text = req.prompt_text(tokenizer)
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
            params = req.sampling_params(req.max_new_tokens)
        except StrataError as e:
            raise APIError(400, str(e)) from None
        handle = submit(prompt_ids, params)
        return await respond(request, handle, params.stop, req, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(await request.body(), CompletionRequest)
        prompt = req.prompt
        try:
            if isinstance(prompt, list) and isinstance(prompt[0], int):
                prompt_ids = list(prompt)
            else:
                text = prompt[0] if isinstance(prompt, list) else prompt
                prompt_ids = engine.llm.tokenizer.encode(text)
            params = req.sampling_params(req.max_tokens)
        except StrataError as e:
            raise APIError(400, str(e)) from None
        handle = submit(prompt_ids, params)
        return await respond(request, handle, params.stop, req, chat=False)

    async def respond(http: Request, handle: RequestHandle, stop, req, chat: bool):
        shape = ResponseShape(model_name, chat)
        texts = text_stream(handle, engine, stop)
        if req.stream:
            return StreamingResponse(sse(shape, handle, texts, req.include_usage),
                                     media_type="text/event-stream")
        pieces, result = [], None
        try:
            async for piece, finish, completion_tokens in texts:
                if await http.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; the request is aborted
                pieces.append(piece)
                result = (finish, completion_tokens)
        finally:
            await texts.aclose()
        return shape.full("".join(pieces), result[0], handle.prompt_tokens, result[1])

    return app


async def text_stream(handle: RequestHandle, engine: AsyncEngine, stop) -> AsyncIterator:
    """(text piece, finish_reason or None, completion tokens so far) as tokens arrive.
    Ends the engine request early on a stop string, and on any exit (a client gone)."""
    detok = IncrementalDetokenizer(engine.llm.tokenizer, stop=list(stop))
    tokens, start, first = 0, time.perf_counter(), None
    finish = None
    try:
        async for update in handle.updates():
            if update.error is not None:
                raise APIError(503, update.error)
            tokens += len(update.token_ids)
            first = first or time.perf_counter()
            piece = detok.feed(update.token_ids)
            finish = update.finish_reason
            if detok.stopped:
                finish = "stop"
            if finish is not None:
                piece += detok.flush()
                yield piece, ("length" if finish == "length" else "stop"), tokens
                return
            if piece:
                yield piece, None, tokens
    finally:
        if finish is None or detok.stopped:  # client gone, or a stop string ended it early
            engine.abort(handle.request_id)
        seconds = time.perf_counter() - (first or start)
        log.info("%s prompt=%d completion=%d %.1f tok/s finish=%s", handle.request_id,
                 handle.prompt_tokens, tokens, (tokens - 1) / seconds if tokens > 1 else 0.0,
                 finish or "disconnected")


class ResponseShape:
    """OpenAI's JSON for one response: chat or text completion, whole or in chunks."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def full(self, text: str, finish: str, prompt: int, completion: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = self._base("text_completion")
        return {**body, "choices": [choice], "usage": self.usage(prompt, completion)}

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt: int, completion: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": self.usage(prompt, completion)}


async def sse(shape: ResponseShape, handle: RequestHandle, texts: AsyncIterator,
              include_usage: bool) -> AsyncIterator[str]:
    def event(data: dict) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    completion = 0
    try:
        if shape.chat:
            yield event(shape.chunk(None, None, first=True))
        async for piece, finish, completion in texts:
            if piece:
                yield event(shape.chunk(piece, None))
            if finish is not None:
                yield event(shape.chunk(None, finish))
    except APIError as e:
        yield event({"error": {"message": e.message, "type": "server_error", "code": e.status}})
    finally:
        await texts.aclose()
    if include_usage:
        yield event(shape.usage_chunk(handle.prompt_tokens, completion))
    yield "data: [DONE]\n\n"
