"""The HTTP router: OpenAI-compatible endpoints over an `Engine`.

    GET  /v1/models              the one model served
    POST /v1/completions         text (or token ids) -> continuation; stream or not
    POST /v1/chat/completions    messages (World chat format) -> reply; stream or not
    GET  /health                 200 {"status": "ok"} while the engine runs; 503 {"status": "starting"}
                                 until its warm-up is done, 503 {"status": "unavailable"} once it stops
    GET  /metrics                Prometheus text format

A request goes: `security.Guard` (Host and Origin checks, API key, body deadline) -> the
route's API key check -> body read (at most max_body_bytes) -> JSON -> `protocol`
model (strict) -> prompt ids and `SamplingParams` -> `Engine.submit` -> the answer, whole or as
server-sent events ending with `data: [DONE]`. Anything wrong with a request is an `APIError`:
a 4xx with OpenAI's error body, decided before the request reaches the engine, so it never
touches the requests that run. A client that disconnects (or cancels its stream) cancels its
request in the engine, which frees the batch slot at its next step.

Sampling fields a request leaves out take RWKV's usual values, not OpenAI's (whose top_p = 1
and no penalties make RWKV models ramble): chat as ChatRWKV's chat demo, completions as the
`rwkv` package's PIPELINE_ARGS (FORMATS.md section D). Chat replies stop at "\\n\\n"; both
stop at token 0 (end of text). A completion's max_tokens defaults to 16 (as OpenAI's), a
chat's to the server's cap.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import InputError, RWKVEngineError, StateError
from ..sampling import SamplingParams
from ..state import State
from . import protocol as p
from ..chat_format import TURN_SEPARATOR, ReplyText, render_chat
from .engine import Delta, Engine, EngineStopped, Finished, QueueFull, Request
from .security import Guard, key_matches, quoted
from .. import tool_calls
from ..structured import constraint_for

EOS_TOKEN_ID = 0

CHAT_DEFAULTS = SamplingParams(
    temperature=1.0, top_p=0.3, presence_penalty=0.5, frequency_penalty=0.5, penalty_decay=0.996,
    stop_token_ids=(EOS_TOKEN_ID,),
)
COMPLETION_DEFAULTS = SamplingParams(
    temperature=1.0, top_p=0.85, presence_penalty=0.2, frequency_penalty=0.2, penalty_decay=0.996,
    stop_token_ids=(EOS_TOKEN_ID,),
)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "penalty_decay", "seed")


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_prompt_tokens: int = 16384
    max_tokens_cap: int = 4096
    max_body_bytes: int = 4 << 20
    state_dir: Path | None = None
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host header (see security.Guard)
    cors_origins: tuple[str, ...] = ()
    body_timeout: float = 30.0


class APIError(Exception):
    """An error answer: HTTP status + OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def _error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    body = p.ErrorResponse(error=p.ErrorDetail(message=message, type=p.error_type(status), param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


def failure_status(event: Finished) -> int:
    """The HTTP status of a request the engine ended with an error: 503 when it was cut by a
    shutdown, 500 when a model step failed."""
    return 503 if event.message and "shutting down" in event.message else 500


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class _Receiver:
    """The sink of one request: hands engine events (engine thread) to an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """The FastAPI application serving `engine` (started and stopped with the app's lifespan)."""
    metrics = engine.metrics
    tokenizer = engine.tokenizer
    model = engine.model
    loaded_states: OrderedDict[tuple, State] = OrderedDict()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="rwkv-engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=settings.api_key, allowed_hosts=settings.allowed_hosts,
                       cors_origins=settings.cors_origins, body_timeout=settings.body_timeout,
                       count_error=lambda status: metrics.inc("http_errors_total", status=str(status)))

    # --- errors -------------------------------------------------------------------------------

    def error(status: int, message: str, **kw) -> JSONResponse:
        metrics.inc("http_errors_total", status=str(status))
        return _error_response(status, message, **kw)

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

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        traceback.print_exception(e, file=sys.stderr)
        return error(500, f"internal server error ({type(e).__name__})")

    # --- request parts ------------------------------------------------------------------------

    def authorize(request: HTTPRequest) -> None:
        if settings.api_key is None:
            return
        if not key_matches(request.headers.get("authorization", ""), settings.api_key):
            raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def read_json(request: HTTPRequest) -> dict:
        limit = settings.max_body_bytes
        too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        try:
            obj = json.loads(bytes(body), parse_constant=_reject_constant)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
            raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise APIError(400, "the request body must be a JSON object")
        return obj

    def parse(kind: type[p._SamplingFields], obj: dict):
        try:
            req = kind.model_validate(obj)
        except ValidationError as e:
            param, message = p.describe_validation_error(e)
            raise APIError(400, message, param=param or None) from None
        if req.model != settings.model_name:
            raise APIError(404, f"the model {quoted(req.model)} does not exist; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")
        return req

    def sampling_params(req, defaults: SamplingParams, max_tokens: int | None, default_max: int,
                        extra_stop: tuple[str, ...] = (), max_tokens_field: str = "max_tokens") -> SamplingParams:
        if max_tokens is None:
            max_tokens = min(default_max, settings.max_tokens_cap)
        if max_tokens > settings.max_tokens_cap:
            raise APIError(400, f"{max_tokens_field} is {max_tokens}; this server allows at most "
                                f"{settings.max_tokens_cap}", param=max_tokens_field)
        changes = {f: getattr(req, f) for f in _SAMPLING_FIELDS if getattr(req, f) is not None}
        changes["max_tokens"] = max_tokens
        changes["stop"] = tuple(dict.fromkeys((*extra_stop, *(req.stop or ()))))
        if req.logit_bias:
            changes["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        try:
            return defaults.replace(**changes)
        except InputError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0].rstrip(":")) from None

    async def prompt_ids(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                if len(prompt) > 4096:
                    ids = list(await asyncio.to_thread(tokenizer.encode, prompt))
                else:
                    ids = list(tokenizer.encode(prompt))
            except (RWKVEngineError, UnicodeError) as e:  # e.g. a lone surrogate "\ud800"
                raise APIError(400, f"the prompt cannot be tokenized: {e}", param="prompt") from None
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty: there is nothing to continue", param="prompt")
        if len(ids) > settings.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server accepts at most "
                                f"{settings.max_prompt_tokens}", param="prompt", code="context_length_exceeded")
        return ids

    async def start_state(name: str | None) -> tuple[State | None, str]:
        """The saved state a request names (extension `state`), and its key for the prompt cache."""
        if name is None:
            return None, ""
        if settings.state_dir is None:
            raise APIError(400, "this server loads no saved states (start it with --state-dir DIR)", param="state")
        outside = APIError(400, "state must name a file inside the server's state directory", param="state")
        if "\x00" in name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise outside
        root = settings.state_dir.resolve()
        try:
            path = (root / name).resolve()
            if not path.is_relative_to(root):
                raise outside
            st = path.stat()
            if not path.is_file():
                raise OSError
        except (OSError, ValueError):
            raise APIError(400, f"no saved state named {name[:200]!r}", param="state", code="state_not_found") from None
        key = (str(path), st.st_mtime_ns, st.st_size)
        state = loaded_states.get(key)
        if state is None:
            try:
                state = await asyncio.to_thread(State.load, path, model.device)
            except StateError:  # (its message names the server's path: not for clients)
                raise APIError(400, f"state {name!r} is not a file written by State.save", param="state") from None
            if state.signature != model.config.state_signature():
                raise APIError(400, f"state {name!r} belongs to another model ({state.signature})", param="state")
            if state.batch_size != 1:
                raise APIError(400, f"state {name!r} holds {state.batch_size} sequences, not one", param="state")
            layout = lambda s: {k: (t.shape, t.dtype) for k, t in s.items()}  # noqa: E731
            if layout(state) != layout(model.new_state(1)):
                raise APIError(400, f"state {name!r} does not have the shapes of this model's state", param="state")
            if not all(bool(t.isfinite().all()) for _, t in state.items()):
                raise APIError(400, f"state {name!r} holds NaN or infinite values", param="state")
            loaded_states[key] = state
            while len(loaded_states) > 8:
                loaded_states.popitem(last=False)
        loaded_states.move_to_end(key)
        return state, "file:" + ":".join(map(str, key))

    def submit(ids: list[int], params: SamplingParams, state: State | None, state_key: str, constraint=None):
        receiver = _Receiver(asyncio.get_running_loop())
        try:
            handle = engine.submit(Request(ids, params, state, state_key, constraint=constraint), receiver)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        except EngineStopped as e:
            raise APIError(503, str(e), code="unavailable") from None
        except InputError as e:
            raise APIError(400, str(e)) from None
        return handle, receiver

    async def watch_disconnect(request: HTTPRequest, handle) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                handle.cancel()
                return

    async def collect(request: HTTPRequest, handle, receiver: _Receiver) -> tuple[str, Finished]:
        watcher = asyncio.create_task(watch_disconnect(request, handle))
        parts = []
        try:
            while True:
                event = await receiver.queue.get()
                if isinstance(event, Delta):
                    parts.append(event.text)
                    continue
                if event.reason == "error":
                    raise APIError(failure_status(event), event.message or "the request failed", code="engine_error")
                return "".join(parts), event
        finally:
            watcher.cancel()
            handle.cancel()

    def usage(event: Finished) -> p.Usage:
        return p.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                       total_tokens=event.prompt_tokens + event.completion_tokens,
                       prompt_tokens_details=p.PromptTokensDetails(cached_tokens=event.cached_tokens))

    def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def stream_error(event: Finished) -> str:
        status = failure_status(event)
        detail = p.ErrorDetail(message=event.message or "the request failed", type=p.error_type(status),
                               code="engine_error")
        return _sse(p.ErrorResponse(error=detail))

    async def stream_events(handle, receiver: _Receiver, delta: Callable[[str], str | None],
                            finish: Callable[[str], str], usage_chunk: Callable[[Finished], str] | None,
                            opening: str | None = None) -> AsyncIterator[str]:
        """The server-sent events of a streamed request, completion or chat.

        `opening` first (if any); `delta(text)` for each piece of text (nothing where it gives
        None); at the end `finish(reason)` and then `usage_chunk(event)` (if the client asked for
        usage), or an error event; then `data: [DONE]`. A cancelled request's stream just ends.
        Whenever the stream ends (the client gone too) the request is cancelled in the engine.
        """
        try:
            if opening is not None:
                yield opening
            while True:
                event = await receiver.queue.get()
                if isinstance(event, Delta):
                    piece = delta(event.text)
                    if piece is not None:
                        yield piece
                    continue
                if event.reason == "cancelled":
                    return
                if event.reason == "error":
                    yield stream_error(event)
                else:
                    yield finish(event.reason)
                    if usage_chunk is not None:
                        yield usage_chunk(event)
                yield "data: [DONE]\n\n"
                return
        finally:
            handle.cancel()

    def chat_messages(req: p.ChatCompletionRequest) -> list[tuple[str, str]]:
        """(role, text) of the conversation, with the tools and tool calls written in
        (rwkv_engine/tool_calls.py)."""
        names = {}  # tool call id -> function name
        out = []
        for m in req.messages:
            text = m.text
            if m.tool_calls:
                names.update((c.id, c.function.name) for c in m.tool_calls)
                written = tool_calls.render_calls([(c.function.name, c.function.arguments) for c in m.tool_calls])
                text = f"{text}\n{written}" if text.strip() else written
            elif m.role == "tool" and m.tool_call_id in names:
                text = f"{names[m.tool_call_id]}: {text}"
            out.append((m.role, text))
        if req.tool_mode != "none":
            listed = tool_calls.render_tools([t.function.model_dump() for t in req.tools])
            if out and out[0][0] in ("system", "developer"):
                out[0] = (out[0][0], f"{out[0][1]}\n{listed}")
            else:
                out.insert(0, ("system", listed))
        return out

    async def chat_constraint(req: p.ChatCompletionRequest, params: SamplingParams):
        """(params, the reply's Constraint or None) for response_format and tools."""
        fmt, mode = req.response_format, req.tool_mode
        if fmt is not None and fmt.type != "text":
            if mode != "none":
                raise APIError(400, "response_format json_object / json_schema cannot be combined with tools "
                                    "(use tool_choice none, or one of the two)", param="response_format")
            schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
            params = params.replace(json_schema=schema, json_object=fmt.type == "json_object")
            make, param = (lambda: constraint_for(params, tokenizer, model.config.vocab_size)), "response_format"
        elif mode != "none":
            tools = [t.function.model_dump() for t in req.tools]
            make, param = (lambda: tool_calls.tool_constraint(tools, mode, tokenizer, model.config.vocab_size)), "tools"
        else:
            return params, None
        try:
            return params, await asyncio.to_thread(make)
        except InputError as e:
            raise APIError(400, str(e), param=param) from None

    # --- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if engine.ready:
            return {"status": "ok"}
        return JSONResponse({"status": "starting" if engine.alive else "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine.gauges), media_type="text/plain; version=0.0.4; charset=utf-8")

    created = p.now()

    @app.get("/v1/models")
    async def list_models(request: HTTPRequest):
        authorize(request)
        return p.ModelList(data=[p.ModelCard(id=settings.model_name, created=created)])

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: HTTPRequest):
        authorize(request)
        if name != settings.model_name:
            raise APIError(404, f"the model {quoted(name)} does not exist", param="model", code="model_not_found")
        return p.ModelCard(id=settings.model_name, created=created)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        authorize(request)
        req = parse(p.CompletionRequest, await read_json(request))
        params = sampling_params(req, COMPLETION_DEFAULTS, req.max_tokens, COMPLETION_MAX_TOKENS)
        ids = await prompt_ids(req.prompt)
        state, state_key = await start_state(req.state)
        handle, receiver = submit(ids, params, state, state_key)
        rid, when = p.new_id("cmpl"), p.now()

        def chunk(text: str, finish=None, use=None, choices=True) -> str:
            cs = [p.CompletionChoice(text=text, finish_reason=finish)] if choices else []
            return _sse(p.CompletionResponse(id=rid, created=when, model=settings.model_name, choices=cs, usage=use))

        if not req.stream:
            text, event = await collect(request, handle, receiver)
            if event.reason == "cancelled":
                return Response(status_code=499)
            return p.CompletionResponse(id=rid, created=when, model=settings.model_name, usage=usage(event),
                                        choices=[p.CompletionChoice(text=text, finish_reason=event.reason)])

        with_usage = req.include_usage_in_stream
        return stream_response(stream_events(
            handle, receiver,
            delta=chunk,
            finish=lambda reason: chunk("", finish=reason),
            usage_chunk=(lambda event: chunk("", use=usage(event), choices=False)) if with_usage else None,
        ))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        authorize(request)
        req = parse(p.ChatCompletionRequest, await read_json(request))
        params = sampling_params(req, CHAT_DEFAULTS, req.token_limit, settings.max_tokens_cap,
                                 extra_stop=(TURN_SEPARATOR,), max_tokens_field=req.token_limit_field)
        params, constraint = await chat_constraint(req, params)
        prompt = render_chat(chat_messages(req))
        ids = await prompt_ids(prompt)
        state, state_key = await start_state(req.state)
        handle, receiver = submit(ids, params, state, state_key, constraint)
        rid, when = p.new_id("chatcmpl"), p.now()
        calls = req.tool_mode != "none"

        def tool_call(reply: str, reason: str) -> p.ToolCall | None:
            call = tool_calls.parse_call(reply) if calls and reason == "stop" else None
            return call and p.ToolCall(id=p.new_id("call"), function=p.CalledFunction(name=call[0], arguments=call[1]))

        if not req.stream:
            text, event = await collect(request, handle, receiver)
            if event.reason == "cancelled":
                return Response(status_code=499)
            reply = ReplyText()(text)
            call = tool_call(reply, event.reason)
            message = p.AssistantMessage(content=None, tool_calls=[call]) if call else p.AssistantMessage(content=reply)
            return p.ChatCompletionResponse(
                id=rid, created=when, model=settings.model_name, usage=usage(event),
                choices=[p.ChatChoice(message=message, finish_reason="tool_calls" if call else event.reason)])

        def chunk(delta: p.Delta | None, finish=None, use=None) -> str:
            cs = [p.ChatChunkChoice(delta=delta, finish_reason=finish)] if delta is not None else []
            return _sse(p.ChatCompletionChunk(id=rid, created=when, model=settings.model_name, choices=cs, usage=use))

        reply, with_usage = ReplyText(), req.include_usage_in_stream
        pieces = tool_calls.CallStream() if calls else None  # with tools: text or a call, as it grows
        call_id = p.new_id("call")

        def sent(parts: list[tuple[str, str]]) -> str | None:
            out = []
            for kind, value in parts:
                if kind == "content":
                    d = p.Delta(content=value)
                elif kind == "call":
                    fn = p.FunctionDelta(name=value, arguments="")
                    d = p.Delta(tool_calls=[p.ToolCallDelta(id=call_id, type="function", function=fn)])
                else:
                    d = p.Delta(tool_calls=[p.ToolCallDelta(function=p.FunctionDelta(arguments=value))])
                out.append(chunk(d))
            return "".join(out) or None

        def delta(text: str) -> str | None:
            text = reply(text)
            if pieces is not None:
                return sent(pieces.push(text))
            return chunk(p.Delta(content=text)) if text else None

        def finish(reason: str) -> str:
            if pieces is None:
                return chunk(p.Delta(), finish=reason)
            called = tool_call(pieces.held, reason) is not None
            return (sent(pieces.finish()) or "") + chunk(p.Delta(), finish="tool_calls" if called else reason)

        return stream_response(stream_events(
            handle, receiver,
            delta=delta,
            finish=finish,
            usage_chunk=(lambda event: chunk(None, use=usage(event))) if with_usage else None,
            opening=chunk(p.Delta(role="assistant", content="")),
        ))

    return app
