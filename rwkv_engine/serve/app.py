"""The HTTP router: OpenAI-compatible endpoints over an `Engine`.

    GET  /v1/models              the one model served
    POST /v1/completions         text (or token ids) -> continuation; stream or not
    POST /v1/chat/completions    messages (World chat format) -> reply; stream or not
    POST /tokenize, /detokenize  text <-> token ids (llama.cpp and vLLM bodies; also under /v1/)
    GET  /tokenizer_info         vLLM's tokenizer description (lm-eval's remote tokenizer probe)
    GET  /health                 200 {"status": "ok"} while the engine runs; 503 {"status": "starting"}
                                 until its warm-up is done, 503 {"status": "unavailable"} once it stops
    GET  /metrics                Prometheus text format
    GET  /, /chat                the web chat page (webui.py; its files under /static/)

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
import dataclasses
import json
import sys
import traceback
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import tool_calls
from ..chat_format import TURN_SEPARATOR, ReplyText, render_chat
from ..errors import InputError, RWKVEngineError, StateError
from ..sampling import SamplingParams
from ..state import State
from ..structured import grammar_for
from . import protocol as p
from . import webui
from .engine import Delta, Engine, EngineStopped, Finished, Prompt, QueueFull, Request
from .logprobs import CompletionLogprobs, TokenLogprob, TokenText, chat_content
from .security import Guard, key_matches, quoted

EOS_TOKEN_ID = 0

CHAT_DEFAULTS = SamplingParams(
    temperature=1.0,
    top_p=0.3,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    penalty_decay=0.996,
    stop_token_ids=(EOS_TOKEN_ID,),
)
COMPLETION_DEFAULTS = SamplingParams(
    temperature=1.0,
    top_p=0.85,
    presence_penalty=0.2,
    frequency_penalty=0.2,
    penalty_decay=0.996,
    stop_token_ids=(EOS_TOKEN_ID,),
)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "penalty_decay", "seed")


@dataclass
class AppSettings:
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

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
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


class _Job:
    """The engine requests behind one API request: one per prompt, each with n choices. Their
    events (from the engine thread) go to one asyncio queue, re-indexed to the API's choice
    index, prompt * n + choice, as OpenAI numbers the choices of a list of prompts."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles: list = []
        self.choices = 0

    def sink(self, offset: int) -> Callable[[object], None]:
        def put(event) -> None:
            if offset:
                event = dataclasses.replace(event, index=event.index + offset)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

        return put

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()


@dataclass
class _Choice:
    """What one choice of a non-streamed request received."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt: Prompt | None = None
    finished: Finished | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


def create_app(engine: Engine, settings: AppSettings) -> FastAPI:
    """The FastAPI application serving `engine` (started and stopped with the app's lifespan)."""
    metrics = engine.metrics
    tokenizer = engine.tokenizer
    model = engine.model
    loaded_states: OrderedDict[tuple, State] = OrderedDict()
    token_text = TokenText(tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="rwkv-engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(
        Guard,
        api_key=settings.api_key,
        allowed_hosts=settings.allowed_hosts,
        cors_origins=settings.cors_origins,
        body_timeout=settings.body_timeout,
        count_error=lambda status: metrics.inc("http_errors_total", status=str(status)),
    )

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
            raise APIError(
                401, "missing or incorrect API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
            )

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

    def parse(kind: type[p._Strict], obj: dict):
        try:
            req = kind.model_validate(obj)
        except ValidationError as e:
            param, message = p.describe_validation_error(e)
            raise APIError(400, message, param=param or None) from None
        if req.model is not None and req.model != settings.model_name:  # (optional in /tokenize)
            raise APIError(
                404,
                f"the model {quoted(req.model)} does not exist; this server serves {settings.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return req

    def sampling_params(
        req,
        defaults: SamplingParams,
        max_tokens: int | None,
        default_max: int,
        extra_stop: tuple[str, ...] = (),
        max_tokens_field: str = "max_tokens",
    ) -> SamplingParams:
        if max_tokens is None:
            max_tokens = min(default_max, settings.max_tokens_cap)
        if max_tokens > settings.max_tokens_cap:
            raise APIError(
                400,
                f"{max_tokens_field} is {max_tokens}; this server allows at most {settings.max_tokens_cap}",
                param=max_tokens_field,
            )
        changes = {f: getattr(req, f) for f in _SAMPLING_FIELDS if getattr(req, f) is not None}
        changes["max_tokens"] = max_tokens
        changes["stop"] = tuple(dict.fromkeys((*extra_stop, *(req.stop or ()))))
        if req.logit_bias:
            changes["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        try:
            return defaults.replace(**changes)
        except InputError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0].rstrip(":")) from None

    async def encode_text(text: str, param: str) -> list[int]:
        try:
            if len(text) > 4096:
                return list(await asyncio.to_thread(tokenizer.encode, text))
            return list(tokenizer.encode(text))
        except (RWKVEngineError, UnicodeError) as e:  # e.g. a lone surrogate "\ud800"
            raise APIError(400, f"the {param} cannot be tokenized: {e}", param=param) from None

    async def prompt_ids(prompt: str | list[int]) -> list[int]:
        ids = await encode_text(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty: there is nothing to continue", param="prompt")
        if len(ids) > settings.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; this server accepts at most {settings.max_prompt_tokens}",
                param="prompt",
                code="context_length_exceeded",
            )
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

    def submit(
        prompts: list[list[int]],
        params: SamplingParams,
        state: State | None,
        state_key: str,
        n: int = 1,
        logprobs: int | None = None,
        echo: bool = False,
        constraint=None,
    ) -> _Job:
        """One engine request per prompt (n choices each); all or none are queued. `constraint`:
        a fresh grammar Constraint per call (structured.py), for each choice."""
        job = _Job(asyncio.get_running_loop())
        try:
            for i, ids in enumerate(prompts):
                request = Request(
                    ids, params, state, state_key, n=n, logprobs=logprobs, echo=echo, constraint=constraint
                )
                job.handles.append(engine.submit(request, job.sink(i * n)))
        except QueueFull as e:
            job.cancel()
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        except EngineStopped as e:
            job.cancel()
            raise APIError(503, str(e), code="unavailable") from None
        except InputError as e:
            job.cancel()
            raise APIError(400, str(e)) from None
        job.choices = len(prompts) * n
        return job

    async def watch_disconnect(request: HTTPRequest, job: _Job) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel()
                return

    async def collect(request: HTTPRequest, job: _Job) -> list[_Choice] | None:
        """Every choice's events, when all have finished; None if the request was cancelled."""
        watcher = asyncio.create_task(watch_disconnect(request, job))
        choices = [_Choice() for _ in range(job.choices)]
        left = job.choices
        try:
            while left:
                event = await job.queue.get()
                choice = choices[event.index]
                if isinstance(event, Delta):
                    choice.parts.append(event.text)
                    choice.logprobs += event.logprobs
                elif isinstance(event, Prompt):
                    choice.prompt = event
                elif event.reason == "error":
                    raise APIError(failure_status(event), event.message or "the request failed", code="engine_error")
                elif event.reason == "cancelled":
                    return None
                else:
                    choice.finished = event
                    left -= 1
            return choices
        finally:
            watcher.cancel()
            job.cancel()

    def usage(events: list[Finished], n: int = 1) -> p.Usage:
        """Summed over the choices; a prompt counts once however many choices it has."""
        firsts = [e for e in events if e.index % n == 0]
        prompt, completion = sum(e.prompt_tokens for e in firsts), sum(e.completion_tokens for e in events)
        return p.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(e.cached_tokens for e in firsts)),
        )

    def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    def stream_error(event: Finished) -> str:
        status = failure_status(event)
        detail = p.ErrorDetail(
            message=event.message or "the request failed", type=p.error_type(status), code="engine_error"
        )
        return _sse(p.ErrorResponse(error=detail))

    async def stream_events(
        job: _Job,
        on_event: Callable[[object], str | None],
        usage_chunk: Callable[[list[Finished]], str] | None,
        opening: tuple[str, ...] = (),
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed request, completion or chat.

        `opening` first; then `on_event(event)` for each engine event (`Prompt`, `Delta`, and the
        `Finished` of each choice that ends normally; nothing where it gives None); when every
        choice has finished, `usage_chunk(finished events)` (if the client asked for usage), then
        `data: [DONE]`. An error in any choice gives an error event and `[DONE]`; a cancelled
        request's stream just ends. Whenever the stream ends (the client gone too) the request
        is cancelled in the engine.
        """
        try:
            for piece in opening:
                yield piece
            finished: list[Finished] = []
            while len(finished) < job.choices:
                event = await job.queue.get()
                if isinstance(event, Finished):
                    if event.reason == "cancelled":
                        return
                    if event.reason == "error":
                        yield stream_error(event)
                        yield "data: [DONE]\n\n"
                        return
                    finished.append(event)
                piece = on_event(event)
                if piece is not None:
                    yield piece
            if usage_chunk is not None:
                yield usage_chunk(finished)
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()

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
        """(params, a factory of the reply's Constraint, or None) for response_format and tools;
        the grammar is compiled here, off the event loop."""
        fmt, mode = req.response_format, req.tool_mode
        if fmt is not None and fmt.type != "text":
            if mode != "none":
                raise APIError(
                    400,
                    "response_format json_object / json_schema cannot be combined with tools "
                    "(use tool_choice none, or one of the two)",
                    param="response_format",
                )
            schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
            params = params.replace(json_schema=schema, json_object=fmt.type == "json_object")
            make, param = (
                (lambda: grammar_for(params, tokenizer, model.config.vocab_size).constraint),
                "response_format",
            )
        elif mode != "none":
            tools = [t.function.model_dump() for t in req.tools]
            make, param = (
                (lambda: tool_calls.tool_constraints(tools, mode, tokenizer, model.config.vocab_size)),
                "tools",
            )
        else:
            return params, None
        try:
            return params, await asyncio.to_thread(make)
        except InputError as e:
            raise APIError(400, str(e), param=param) from None

    # --- routes ---------------------------------------------------------------------------------

    app.include_router(webui.router(CHAT_DEFAULTS, settings.max_tokens_cap))

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

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: HTTPRequest):
        authorize(request)
        req = parse(p.TokenizeRequest, await read_json(request))
        ids = await encode_text(req.text, "content" if req.content is not None else "prompt")
        if req.with_pieces:
            tokens = []
            for t in ids:
                raw = tokenizer.decode_bytes([t])
                try:
                    tokens.append({"id": t, "piece": raw.decode("utf-8")})
                except UnicodeDecodeError:
                    tokens.append({"id": t, "piece": list(raw)})
        else:
            tokens = ids
        return {"tokens": tokens, "count": len(ids), "max_model_len": settings.max_prompt_tokens}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: HTTPRequest):
        """vLLM's tokenizer description, which lm-evaluation-harness's `local-completions` probes
        to use the server's /tokenize. The World tokenizer has no end-of-text *text* (token 0 has
        none), so the special-token strings are null and `eos_token_id` is 0."""
        authorize(request)
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": None,
            "bos_token": None,
            "pad_token": None,
            "eos_token_id": EOS_TOKEN_ID,
            "vocab_size": model.config.vocab_size,
            "model_max_length": settings.max_prompt_tokens,
            "chat_template": None,
        }

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: HTTPRequest):
        authorize(request)
        req = parse(p.DetokenizeRequest, await read_json(request))
        vocab = model.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
        text = tokenizer.decode(req.tokens)
        return {"content": text, "prompt": text}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        authorize(request)
        req = parse(p.CompletionRequest, await read_json(request))
        params = sampling_params(req, COMPLETION_DEFAULTS, req.max_tokens, COMPLETION_MAX_TOKENS)
        prompts = [await prompt_ids(prompt) for prompt in req.prompt]
        state, state_key = await start_state(req.state)
        n = req.n or 1
        job = submit(prompts, params, state, state_key, n=n, logprobs=req.logprobs, echo=req.echo)
        rid, when = p.new_id("cmpl"), p.now()
        books = [CompletionLogprobs(token_text) for _ in range(job.choices)] if req.logprobs is not None else None

        def prompt_text(i: int) -> str:
            return tokenizer.decode(prompts[i // n])

        def logprobs(i: int, event: Prompt | None, entries) -> p.CompletionLogprobs | None:
            """Choice i's log-probabilities of what `event` (echo) and `entries` (tokens) add."""
            if books is None:
                return None
            if event is not None:
                books[i].add_first(prompts[i // n][0])
                books[i].add(event.logprobs)
            books[i].add(entries)
            return p.CompletionLogprobs(**books[i].take())

        def chunk(choices: list[p.CompletionChoice], use=None) -> str:
            return _sse(
                p.CompletionResponse(id=rid, created=when, model=settings.model_name, choices=choices, usage=use)
            )

        if not req.stream:
            got = await collect(request, job)
            if got is None:
                return Response(status_code=499)
            choices = [
                p.CompletionChoice(
                    index=i,
                    text=(prompt_text(i) if req.echo else "") + c.text,
                    logprobs=logprobs(i, c.prompt, c.logprobs),
                    finish_reason=c.finished.reason,
                )
                for i, c in enumerate(got)
            ]
            return p.CompletionResponse(
                id=rid,
                created=when,
                model=settings.model_name,
                choices=choices,
                usage=usage([c.finished for c in got], n),
            )

        def on_event(event) -> str:
            i = event.index
            if isinstance(event, Finished):
                return chunk([p.CompletionChoice(index=i, text="", finish_reason=event.reason)])
            if isinstance(event, Prompt):
                text, lp = prompt_text(i), logprobs(i, event, ())
            else:
                text, lp = event.text, logprobs(i, None, event.logprobs)
            return chunk([p.CompletionChoice(index=i, text=text, logprobs=lp)])

        return stream_response(
            stream_events(
                job,
                on_event,
                usage_chunk=(lambda events: chunk([], use=usage(events, n))) if req.include_usage_in_stream else None,
            )
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        authorize(request)
        req = parse(p.ChatCompletionRequest, await read_json(request))
        params = sampling_params(
            req,
            CHAT_DEFAULTS,
            req.token_limit,
            settings.max_tokens_cap,
            extra_stop=(TURN_SEPARATOR,),
            max_tokens_field=req.token_limit_field,
        )
        params, constraint = await chat_constraint(req, params)
        prompt = render_chat(chat_messages(req))
        ids = await prompt_ids(prompt)
        state, state_key = await start_state(req.state)
        n = req.n or 1
        job = submit([ids], params, state, state_key, n=n, logprobs=req.top_logprob_count, constraint=constraint)
        rid, when = p.new_id("chatcmpl"), p.now()
        calls = req.tool_mode != "none"

        def tool_call(reply: str, reason: str) -> p.ToolCall | None:
            call = tool_calls.parse_call(reply) if calls and reason == "stop" else None
            return call and p.ToolCall(id=p.new_id("call"), function=p.CalledFunction(name=call[0], arguments=call[1]))

        def logprobs(entries) -> p.ChatLogprobs | None:
            return p.ChatLogprobs(content=chat_content(token_text, entries)) if req.logprobs else None

        if not req.stream:
            got = await collect(request, job)
            if got is None:
                return Response(status_code=499)
            choices = []
            for i, c in enumerate(got):
                reply = ReplyText()(c.text)
                call = tool_call(reply, c.finished.reason)
                message = (
                    p.AssistantMessage(content=None, tool_calls=[call]) if call else p.AssistantMessage(content=reply)
                )
                choices.append(
                    p.ChatChoice(
                        index=i,
                        message=message,
                        logprobs=None if call else logprobs(c.logprobs),
                        finish_reason="tool_calls" if call else c.finished.reason,
                    )
                )
            return p.ChatCompletionResponse(
                id=rid,
                created=when,
                model=settings.model_name,
                choices=choices,
                usage=usage([c.finished for c in got], n),
            )

        def chunk(choices: list[p.ChatChunkChoice], use=None) -> str:
            return _sse(
                p.ChatCompletionChunk(id=rid, created=when, model=settings.model_name, choices=choices, usage=use)
            )

        replies = [ReplyText() for _ in range(n)]
        # With tools: each choice's reply is text or a call, sent as it grows (tool_calls.CallStream);
        # log-probabilities of held text go out with it (a call carries none).
        pieces = [tool_calls.CallStream() for _ in range(n)] if calls else None
        held_logprobs: list[list] = [[] for _ in range(n)]
        call_ids = [p.new_id("call") for _ in range(n)]

        def sent(i: int, parts: list[tuple[str, str]]) -> str | None:
            out = []
            for kind, value in parts:
                lp = None
                if kind == "content":
                    d = p.Delta(content=value)
                    lp, held_logprobs[i] = logprobs(held_logprobs[i]), []
                elif kind == "call":
                    fn = p.FunctionDelta(name=value, arguments="")
                    d = p.Delta(tool_calls=[p.ToolCallDelta(id=call_ids[i], type="function", function=fn)])
                else:
                    d = p.Delta(tool_calls=[p.ToolCallDelta(function=p.FunctionDelta(arguments=value))])
                out.append(chunk([p.ChatChunkChoice(index=i, delta=d, logprobs=lp)]))
            return "".join(out) or None

        def on_event(event) -> str | None:
            i = event.index
            if isinstance(event, Finished):
                reason, before = event.reason, ""
                if pieces is not None:
                    called = tool_call(pieces[i].held, reason) is not None
                    before, reason = sent(i, pieces[i].finish()) or "", "tool_calls" if called else reason
                return before + chunk([p.ChatChunkChoice(index=i, delta=p.Delta(), finish_reason=reason)])
            text = replies[i](event.text)
            if pieces is not None:
                held_logprobs[i] += event.logprobs or []
                return sent(i, pieces[i].push(text))
            if not (text or event.logprobs):
                return None
            return chunk([p.ChatChunkChoice(index=i, delta=p.Delta(content=text), logprobs=logprobs(event.logprobs))])

        return stream_response(
            stream_events(
                job,
                on_event,
                usage_chunk=(lambda events: chunk([], use=usage(events, n))) if req.include_usage_in_stream else None,
                opening=tuple(
                    chunk([p.ChatChunkChoice(index=i, delta=p.Delta(role="assistant", content=""))]) for i in range(n)
                ),
            )
        )

    return app
