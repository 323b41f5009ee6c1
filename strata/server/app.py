"""The FastAPI application: OpenAI routes, health and metrics.

Handlers turn HTTP bodies into prompt token ids and SamplingParams (one per choice) and
submit them to the AsyncEngine; responses.py turns the token streams back into OpenAI's
shapes. Every error is OpenAI-shaped (errors.py); the Guard middleware checks Host, Origin,
the API key and the body before any route runs.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from strata.errors import StrataError
from strata.server.async_engine import AsyncEngine, NotReady, QueueFull, RequestHandle
from strata.server.config import ServerConfig
from strata.server.errors import APIError, install_error_handlers, parse_json, validation_message
from strata.server.guard import Guard
from strata.server.metrics import Metrics
from strata.server.protocol import ChatRequest, CompletionRequest
from strata.server.responses import ResponseShape, sse, text_stream, whole


def build_app(engine: AsyncEngine, config: ServerConfig, model_name: str,
              metrics: Metrics) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="Strata", lifespan=lifespan)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    app.add_middleware(Guard, config=config)  # NOTE: outermost: refusals come before CORS
    install_error_handlers(app, on_refused=lambda status: metrics.rejected.labels(
        str(status)).inc())
    _document_bodies(app)

    @app.get("/health")
    async def health():
        status, error = engine.health
        if status == "ready":
            return {"status": "ok"}
        return JSONResponse({"status": status, "error": error}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        info = engine.info
        return {"id": model_name, "object": "model", "created": int(time.time()),
                "owned_by": "strata",
                "max_model_len": info.max_context if info is not None else None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"model '{model_id}' not found; this server serves "
                                f"'{model_name}'", "model")
        return model_card()

    def parse(body: bytes, cls):
        try:
            req = cls.model_validate(parse_json(body))
        except ValidationError as e:
            message, param = validation_message(e)
            raise APIError(400, message, param) from None
        if req.model != model_name:
            raise APIError(404, f"model '{req.model}' not found; this server serves "
                                f"'{model_name}'", "model")
        tokenizer = engine.tokenizer
        if not engine.ready or tokenizer is None:
            status, reason = engine.health
            raise APIError(503, f"the model is not ready ({status}"
                                f"{': ' + reason if reason else ''})",
                           headers={"Retry-After": "5"})
        return req, tokenizer

    def submit(prompt_ids: list[int], params: list) -> list[RequestHandle]:
        try:
            return engine.submit(prompt_ids, params)
        except StrataError as e:
            raise APIError(400, str(e)) from None
        except NotReady as e:
            raise APIError(503, str(e), headers={"Retry-After": "5"}) from None
        except QueueFull as e:
            raise APIError(429, "too many requests: every slot is busy and the queue is full; "
                                f"retry in about {e.retry_after} s",
                           headers={"Retry-After": str(e.retry_after)}) from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req, tokenizer = parse(await request.body(), ChatRequest)
        try:
            prompt_ids = tokenizer.encode_chat(req.template_messages(),
                                               add_generation_prompt=True,
                                               **req.template_options(tokenizer))
            params = req.sampling_params(req.max_new_tokens, req.top_logprob_count)
        except StrataError as e:
            raise APIError(400, str(e)) from None
        handles = submit(prompt_ids, req.choices(params))
        return await respond(request, handles, params, req, tokenizer, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, tokenizer = parse(await request.body(), CompletionRequest)
        try:
            prompt = req.prompt
            prompt_ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
            params = req.sampling_params(req.max_tokens, req.logprobs)
        except StrataError as e:
            raise APIError(400, str(e)) from None
        handles = submit(prompt_ids, req.choices(params))
        return await respond(request, handles, params, req, tokenizer, chat=False)

    async def respond(http: Request, handles: list[RequestHandle], params, req, tokenizer,
                      chat: bool):
        shape = ResponseShape(model_name, chat, tokenizer, logprobs=params.logprobs is not None)
        keepalive = config.sse_keepalive if req.stream else None
        streams = [text_stream(h, engine, tokenizer, params.stop, keepalive) for h in handles]
        if req.stream:
            return StreamingResponse(sse(shape, handles, streams, req.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(http, shape, streams, handles[0])

    return app


def _document_bodies(app: FastAPI) -> None:
    """Put the request bodies into /openapi.json (the handlers parse them by hand, for
    OpenAI-shaped errors and the limits in errors.py)."""
    bodies = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest}

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {
                        "$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
