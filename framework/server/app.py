"""The FastAPI application: OpenAI-compatible routes over an :class:`~framework.server.loop.EngineLoop`.

Routes: POST /v1/completions, POST /v1/chat/completions (both with ``stream``), GET /v1/models, GET /health,
GET /metrics. With an API key set, every /v1 route needs ``Authorization: Bearer <key>``; /health and /metrics
stay open (for load balancers and scrapers). Errors are OpenAI-style JSON bodies.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from framework.config import SamplingConfig
from framework.server import protocol, responses
from framework.server.events import Event
from framework.server.loop import EngineLoop
from framework.server.protocol import APIError, ParsedRequest


def create_app(loop: EngineLoop, served_model: str, sampling_defaults: SamplingConfig,
               api_key: Optional[str] = None) -> FastAPI:
    """Build the app; ``loop`` must be started (its engine built) before the app serves requests."""
    app = FastAPI(title="train-free-serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            loop.metrics.on_reject(401)
            raise APIError("missing or wrong API key: send the header \"Authorization: Bearer <api key>\"",
                           status=401, code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.to_json(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {err.detail}"
        return JSONResponse(APIError(message, status=err.status_code).to_json(), status_code=err.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive:
            return JSONResponse(APIError("the engine loop is not running", status=503,
                                         type="server_error").to_json(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await asyncio.to_thread(loop.metrics.render)  # (an engine process renders its own)
        return Response(body, media_type=content_type)

    def model_card() -> dict[str, Any]:
        return {"id": served_model, "object": "model", "created": created, "owned_by": "train-free-serve",
                "max_model_len": loop.max_context}

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(check_api_key)])
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != served_model:
            raise APIError(f"model={model_id!r} is not served here; the model is {served_model!r}", param="model",
                           status=404, code="model_not_found")
        return model_card()

    async def handle(request: Request, parse: Callable[..., ParsedRequest], prefix: str) -> Response:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        try:
            body = protocol.parse_json(await request.body(), request.headers.get("content-type", ""))
            parsed = parse(body, served_model, sampling_defaults)
            prepared = await loop.prepare(rid, parsed)
        except ClientDisconnect:  # gone before its body arrived: nobody reads an answer
            return Response(status_code=499)
        except APIError as err:
            loop.metrics.on_reject(err.status)
            raise
        events = loop.submit(rid, parsed, prepared)
        if parsed.stream:
            try:
                first = await events.get()
            except BaseException:
                loop.abort(rid)
                raise
            if first.kind == "error":
                raise first.error  # type: ignore[misc]
            return StreamingResponse(stream_events(loop, rid, parsed, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        final = await wait_final(loop, rid, request, events)
        if final is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        shape = responses.chat_completion if parsed.kind == "chat" else responses.completion
        return JSONResponse(shape(rid, parsed.model, final.text, final.finish_reason or "stop", final.prompt_tokens,
                                  final.completion_tokens))

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)])
    async def completions(request: Request) -> Response:
        return await handle(request, protocol.parse_completion, "cmpl")

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
    async def chat_completions(request: Request) -> Response:
        return await handle(request, protocol.parse_chat, "chatcmpl")

    return app


async def wait_final(loop: EngineLoop, rid: str, request: Request, events: asyncio.Queue) -> Optional[Event]:
    """The request's "finish" event, or None (and the request aborted) if the client disconnects first;
    raises the request's error."""
    disconnected = asyncio.ensure_future(_client_gone(request))
    getter: Optional[asyncio.Future] = None
    done = False
    try:
        while True:
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait({getter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                return None
            event: Event = getter.result()
            if event.kind == "error":
                done = True
                raise event.error  # type: ignore[misc]
            if event.kind == "finish":
                done = True
                return event
    finally:
        disconnected.cancel()
        if getter is not None:
            getter.cancel()
        if not done:
            loop.abort(rid)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _coalesce(event: Event, events: asyncio.Queue) -> tuple[str, Optional[Event]]:
    """``event`` and the deltas queued behind it as one: (their text, the finish or error that ends them, else None).
    A client that reads slower than the engine writes gets one chunk for what piled up, not one per token, so the
    server's work per token does not grow when it falls behind (vLLM's output collector does the same)."""
    text = ""
    while event.kind == "delta":
        text += event.text
        if events.empty():
            return text, None
        event = events.get_nowait()
    return text, event


async def stream_events(loop: EngineLoop, rid: str, parsed: ParsedRequest,
                        events: asyncio.Queue) -> AsyncIterator[str]:
    """SSE chunks of one streaming request, ending with ``data: [DONE]``; aborts the request if the client goes
    away (Starlette cancels this generator on disconnect)."""
    writer = responses.ChunkWriter(parsed.kind, rid, parsed.model)
    done = False
    try:
        start = writer.start()
        if start:
            yield start
        while True:
            event: Event = await events.get()
            text, end = _coalesce(event, events)
            if end is None or (text and end.kind != "finish"):
                yield writer.text(text)
                text = ""
            if end is None:
                continue
            event = end
            if event.kind == "finish":
                done = True
                yield writer.text(text + event.text, event.finish_reason)
                if parsed.include_usage:
                    yield writer.usage(event.prompt_tokens, event.completion_tokens)
                yield responses.SSE_DONE
                return
            elif event.kind == "error":
                done = True
                yield responses.sse(event.error.to_json())  # type: ignore[union-attr]
                yield responses.SSE_DONE
                return
    finally:
        if not done:
            loop.abort(rid)
