"""An API request in the engine: its engine requests (`Job`), and their events gathered into a
whole answer (`collect`) or sent as server-sent events (`stream_events`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ..errors import InputError
from ..sampling import SamplingParams
from ..state import State
from . import protocol as p
from .engine import Delta, Engine, EngineStopped, Finished, InputsRequest, Prompt, QueueFull, Read, Request
from .errors import APIError, failure_status
from .logprobs import TokenLogprob


class Job:
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
class Choice:
    """What one choice of a non-streamed request received."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    events: list[Delta] = field(default_factory=list)
    prompt: Prompt | None = None
    finished: Finished | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


def submit(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    state: State | None,
    state_key: str,
    n: int = 1,
    logprobs: int | None = None,
    echo: bool = False,
    constraint=None,
    speculative: str | None = None,
) -> Job:
    """One engine request per prompt (n choices each); all or none are queued. `constraint`:
    a fresh grammar Constraint per call (structured.py), for each choice."""
    job = Job(asyncio.get_running_loop())
    requests = [
        (
            Request(
                ids,
                params,
                state,
                state_key,
                n=n,
                logprobs=logprobs,
                echo=echo,
                constraint=constraint,
                speculative=speculative,
            ),
            job.sink(i * n),
        )
        for i, ids in enumerate(prompts)
    ]
    with _refusals():
        job.handles = engine.submit_all(requests)  # all or none, and a set that can never fit is an InputError
    job.choices = len(prompts) * n
    return job


@contextmanager
def _refusals():
    """The engine's refusals of a request as API errors: 429 (queue full), 503, 400."""
    try:
        yield
    except QueueFull as e:
        raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
    except EngineStopped as e:
        raise APIError(503, str(e), code="unavailable") from None
    except InputError as e:
        raise APIError(400, str(e)) from None


def submit_inputs(engine: Engine, request: InputsRequest) -> Job:
    """An embedding or rerank request queued (`Engine.submit_inputs`); `read` awaits its result."""
    job = Job(asyncio.get_running_loop())
    with _refusals():
        job.handles = [engine.submit_inputs(request, job.sink(0))]
    return job


async def read(request: HTTPRequest, job: Job) -> Read | None:
    """The result of a `submit_inputs` job; None if it was cancelled (the client left)."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        event = await job.queue.get()
        if isinstance(event, Read):
            return event
        if event.reason == "cancelled":
            return None
        raise APIError(failure_status(event), event.message or "the request failed", code="engine_error")
    finally:
        watcher.cancel()
        job.cancel()


async def _watch_disconnect(request: HTTPRequest, job: Job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def collect(request: HTTPRequest, job: Job) -> list[Choice] | None:
    """Every choice's events, when all have finished; None if the request was cancelled."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    choices = [Choice() for _ in range(job.choices)]
    left = job.choices
    try:
        while left:
            event = await job.queue.get()
            choice = choices[event.index]
            if isinstance(event, Delta):
                choice.parts.append(event.text)
                choice.logprobs += event.logprobs
                choice.events.append(event)
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


@dataclass(frozen=True)
class Burst:
    """Deltas of one choice that were waiting together when the stream was read (a client that
    reads slower than tokens come): sent as one event. What a Delta has, of all of them: their
    text joined, their log-probabilities in order, the last count of generated tokens."""

    deltas: tuple[Delta, ...]

    @property
    def index(self) -> int:
        return self.deltas[0].index

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        return tuple(lp for d in self.deltas for lp in d.logprobs)

    @property
    def generated(self) -> int:
        return self.deltas[-1].generated


def coalesce(events: list) -> list:
    """The events in order, each choice's Deltas that no other event of that choice separates
    joined into one `Burst` (where the first of them stood). Events of different choices may
    pass each other; each choice's events keep their order."""
    out: list = []
    open_: dict[int, int] = {}  # choice -> the position in out of its Deltas still open for more
    for event in events:
        i = event.index
        if not isinstance(event, Delta):
            open_.pop(i, None)
            out.append(event)
        elif i in open_:
            at = open_[i]
            before = out[at].deltas if isinstance(out[at], Burst) else (out[at],)
            out[at] = Burst((*before, event))
        else:
            open_[i] = len(out)
            out.append(event)
    return out


def sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def stream_events(
    job: Job,
    on_event: Callable[[object], str | None],
    usage_chunk: Callable[[list[Finished]], str] | None,
    opening: tuple[str, ...] = (),
) -> AsyncIterator[str]:
    """The server-sent events of a streamed request, completion or chat.

    `opening` first; then `on_event(event)` for each engine event (`Prompt`, `Delta` or `Burst`,
    and the `Finished` of each choice that ends normally; nothing where it gives None); when
    every choice has finished, `usage_chunk(finished events)` (if the client asked for usage),
    then `data: [DONE]`. An error in any choice gives an error event and `[DONE]`; a cancelled
    request's stream just ends. Whenever the stream ends (the client gone too) the request
    is cancelled in the engine.

    A client that reads slower than the tokens come holds the stream at its `yield` (the server
    waits for the socket); the events that arrive meanwhile are read together at the next turn
    and each choice's Deltas among them go out as one event (`coalesce`): the client catches up
    in a few events instead of working through one queued event per token.
    """
    try:
        for piece in opening:
            yield piece
        finished: list[Finished] = []
        while len(finished) < job.choices:
            events = [await job.queue.get()]
            while not job.queue.empty():
                events.append(job.queue.get_nowait())
            for event in coalesce(events):
                if isinstance(event, Finished):
                    if event.reason == "cancelled":
                        return
                    if event.reason == "error":
                        yield sse(
                            p.error_body(
                                failure_status(event), event.message or "the request failed", code="engine_error"
                            )
                        )
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
