"""The HTTP router: OpenAI-compatible endpoints over an `Engine`.

    GET  /v1/models              the one model served
    POST /v1/completions         text (or token ids) -> continuation; stream or not
    POST /v1/chat/completions    messages (World chat format) -> reply; stream or not
    POST /v1/embeddings          text (or token ids) -> vectors (serving_embedding.py)
    POST /v1/rerank, /rerank     a query and documents -> relevance scores (with --reranker)
    POST /tokenize, /detokenize  text <-> token ids (llama.cpp and vLLM bodies; also under /v1/)
    GET  /tokenizer_info         vLLM's tokenizer description (lm-eval's remote tokenizer probe)
    GET  /health                 200 {"status": "ok"} while the engine runs; 503 {"status": "starting"}
                                 until its warm-up is done, 503 {"status": "unavailable"} once it stops
    GET  /metrics                Prometheus text format
    GET  /, /chat                the web chat page (webui.py; its files under /static/)

A request goes: `security.Guard` (Host and Origin checks, API key, body deadline) -> the
route's API key check -> body read (at most max_body_bytes) -> JSON -> `protocol`
model (strict) -> prompt ids and `SamplingParams` (parsing.py) -> `Engine.submit` (jobs.py) ->
the answer, whole or as server-sent events ending with `data: [DONE]`. The routes live in
serving_completion.py, serving_chat.py and serving_tokenize.py, sharing a `ServingContext`
(context.py); this module assembles them. Anything wrong with a request is an `APIError`:
a 4xx with OpenAI's error body, decided before the request reaches the engine, so it never
touches the requests that run. A client that disconnects (or cancels its stream) cancels its
request in the engine, which frees the batch slot at its next step.

Every setting comes from the server's `Config` (rwkv_engine/settings.py): the limits, the HTTP
side, and what the sampling fields a request leaves out take (`RequestDefaults`: the OpenAI API's
defaults, temperature 1, top_p 1, no penalties, unless `serve --top-p ...` says otherwise), on
both endpoints. Chat replies stop at "\\n\\n"; both routes stop at token 0 (end of
text). A completion's max_tokens defaults to 16 (as OpenAI's), a chat's to the server's cap.
"""

from __future__ import annotations

import asyncio
import sys
import traceback
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..settings import Config
from ..templates import ChatTemplate
from . import serving_chat, serving_completion, serving_embedding, serving_tokenize, webui
from .context import ServingContext
from .engine import Engine
from .errors import APIError, error_response
from .security import Guard, allowed_hosts


def create_app(engine: Engine, config: Config, template: ChatTemplate | None = None) -> FastAPI:
    """The FastAPI application serving `engine` (started and stopped with the app's lifespan).
    template: the chat template, resolved (`build` resolves it once and logs the choice); None:
    resolved here from `config.chat`."""
    ctx = ServingContext(engine, config, template)
    server = config.server

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="rwkv-engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(
        Guard,
        api_key=server.api_key,
        allowed_hosts=allowed_hosts(server.host, list(server.allowed_hosts)),
        cors_origins=tuple(server.cors_origins),
        body_timeout=server.body_timeout,
        count_error=lambda status: engine.metrics.inc("http_errors_total", status=str(status)),
    )
    add_error_handlers(app, ctx)
    app.include_router(webui.router(config.defaults.sampling, config.limits.max_tokens))

    @app.get("/health")
    async def health():
        if engine.ready:
            return {"status": "ok"}
        return JSONResponse({"status": "starting" if engine.alive else "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(
            engine.metrics.render(engine.gauges), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    for module in (serving_tokenize, serving_completion, serving_chat, serving_embedding):
        app.include_router(module.router(ctx))
    return app


def add_error_handlers(app: FastAPI, ctx: ServingContext) -> None:
    """Every error answer in OpenAI's error body, counted in http_errors_total."""

    def error(status: int, message: str, **kw) -> JSONResponse:
        ctx.metrics.inc("http_errors_total", status=str(status))
        return error_response(status, message, **kw)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error(e.status, e.message, param=e.param, code=e.code, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return error(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return error(400, str(e))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request, e: ClientDisconnect):
        return Response(status_code=499)  # (nobody reads it) a cancel: not an error, no traceback

    # Not an exception handler for Exception: Starlette calls that one, then re-raises to the
    # server, which logs the error a second time (and an in-process client gets it raised).
    app.add_middleware(_Unexpected, error=error)


class _Unexpected:
    """An error no handler took: logged once (its traceback on stderr) and answered 500."""

    def __init__(self, app, error):
        self.app, self.error = app, error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            print("rwkv-engine serve: an unexpected error in a request:", file=sys.stderr)
            traceback.print_exception(e, file=sys.stderr)
            if not started:  # (else the answer is cut short: the client sees it end early)
                await self.error(500, f"internal server error ({type(e).__name__})")(scope, receive, send)
