"""The FastAPI application: OpenAI routes, health and metrics.

Handlers turn HTTP bodies into prompt token ids and SamplingParams and submit them to the
AsyncEngine; responses.py turns the token stream back into OpenAI's shapes.
"""

from __future__ import annotations

import logging
import time
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
from strata.server.responses import ResponseShape, sse, text_stream

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
        text, last = [], None
        try:
            async for last in texts:
                if await http.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; the request is aborted
                text.append(last.text)
        finally:
            await texts.aclose()
        return shape.full("".join(text), last, handle.prompt_tokens)

    return app
