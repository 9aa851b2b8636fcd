"""POST /v1/chat/completions: messages -> the server's chat template -> reply, whole or streamed.

The template (rwkv_engine/templates; `world`, `g1`, a model's own) renders the conversation and
decides where the reply starts: inside a thought or in the answer (rwkv_engine/reasoning.py).
The reply is split into `reasoning_content` and `content` as it streams; tools and
response_format go through grammar constraints (structured.py, tool_calls.py) that apply to
the answer only, after the thought (`structured.ThoughtGate`). Tool calls are read in the
template's format (World's <tool_call>, G1's ```json blocks) and sent as OpenAI tool_calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..chat_format import TURN_SEPARATOR
from ..errors import InputError
from ..reasoning import ReasoningSplitter, reply_start
from ..sampling import SamplingParams
from ..structured import ThoughtGate, grammar_for
from ..threads import releasing
from ..tool_calls import FORMATS, ToolFormat
from . import protocol as p
from .context import ServingContext
from .engine import Delta, Finished
from .errors import APIError
from .jobs import Burst, collect, sse, stream_events, stream_response, submit, usage
from .logprobs import chat_content
from .parsing import prompt_ids, read_request, sampling_params


def router(ctx: ServingContext) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await create_chat_completion(ctx, request)

    return r


async def create_chat_completion(ctx: ServingContext, request: HTTPRequest):
    req = await read_request(ctx, request, p.ChatCompletionRequest)
    params = sampling_params(
        ctx,
        req,
        ctx.config.defaults.sampling,
        req.token_limit,
        ctx.config.limits.max_tokens,
        extra_stop=(TURN_SEPARATOR,),
        max_tokens_field=req.token_limit_field,
    )
    prompt = render(ctx, req.messages, req.tools if req.tool_mode != "none" else None, True, req)
    start = reply_start(prompt, ctx.template.thinks)
    params, constraint = await chat_constraint(ctx, req, params, start)
    ids = await prompt_ids(ctx, prompt)
    state, state_key = await ctx.states.get(req.state)
    n = req.n or 1
    job = submit(
        ctx.engine,
        [ids],
        params,
        state,
        state_key,
        n=n,
        logprobs=req.top_logprob_count,
        constraint=constraint,
        speculative=req.speculative,
    )
    out = ChatOutput(ctx, req, n, start)
    if not req.stream:
        got = await collect(request, job)
        return Response(status_code=499) if got is None else out.whole(got)
    return stream_response(
        stream_events(
            job,
            out.on_event,
            usage_chunk=out.usage_chunk if req.include_usage_in_stream else None,
            opening=out.opening(),
        )
    )


def render(ctx: ServingContext, messages, tools, add_generation_prompt: bool, req: p.TemplateFields) -> str:
    """The prompt of `messages` (protocol ChatMessages) by the server's chat template."""
    try:
        return req.render(ctx.template, messages, tools, add_generation_prompt, ctx.config.chat.think)
    except InputError as e:
        raise APIError(400, str(e), param="messages") from None


async def chat_constraint(ctx: ServingContext, req: p.ChatCompletionRequest, params: SamplingParams, start: str):
    """(params, a factory of the reply's Constraint, or None) for response_format and tools; the
    grammar is compiled here, off the event loop. After a prompt that leaves the model in (or
    right after) a thought, the grammar waits for the thought's end."""
    fmt, mode = req.response_format, req.tool_mode
    tokenizer, vocab = ctx.tokenizer, ctx.model.config.vocab_size
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
        make, param = (lambda: grammar_for(params, tokenizer, vocab).constraint), "response_format"
    elif mode != "none":
        tools = [t.function.model_dump() for t in req.tools]
        parallel = req.parallel_tool_calls is not False
        tool_format = tool_format_of(ctx)
        make, param = (lambda: tool_format.constraints(tools, mode, tokenizer, vocab, parallel)), "tools"
    else:
        return params, None
    try:
        inner = await asyncio.to_thread(releasing(make))  # (rwkv_engine/threads.py)
    except InputError as e:
        raise APIError(400, str(e), param=param) from None
    if start in ("thought", "thought>", "answer>"):
        matched = len("</think") if start == "answer>" else 0
        await asyncio.to_thread(
            releasing(ThoughtGate), inner, tokenizer, vocab, matched
        )  # (its token tables, built once)
        return params, lambda: ThoughtGate(inner, tokenizer, vocab, matched)
    return params, inner


def tool_format_of(ctx: ServingContext) -> ToolFormat:
    return FORMATS[ctx.template.tool_format]


@dataclass
class ChoiceStream:
    """One choice's reply as it arrives: split into thought and answer, the answer read as text or
    calls (`calls`, with tools), and what a client is sent of each. Log-probabilities go with
    the answer's text (a thought's and a call's tokens carry none)."""

    split: ReasoningSplitter
    calls: object | None = None  # the tool format's stream (tool_calls.CallStream, G1CallStream)
    seen: int = 0  # tokens of the reply read so far
    reasoning: list[str] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)  # the answer as written (calls included)
    content: list[str] = field(default_factory=list)  # what went out as content
    logprobs: list = field(default_factory=list)  # the answer's
    held_logprobs: list = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)

    def read(self, event: Delta) -> list[tuple]:
        """The pieces of a Delta: ("reasoning", text), ("content", text, logprobs), ("call",
        index, id, name), ("arguments", index, text)."""
        before = self.split.mode
        parts = self.split.push(event.text, max(event.generated - self.seen, 0))
        self.seen = max(self.seen, event.generated)
        if before != "thought":
            self.held_logprobs += event.logprobs or []
        if before == "detect" and self.split.thought:
            self.held_logprobs = []  # (the undecided start was the opening of a thought)
        out = self._pieces(parts)
        if self.calls is None and not any(k == "content" for k, *_ in out) and self.held_logprobs:
            out.append(("content", "", self._take_logprobs()))  # (logprobs of text still held back)
        return out

    def close(self, event: Finished) -> list[tuple]:
        parts = self.split.finish()
        if not self.split.answering:  # the reply ended inside its thought: all of it was thought
            self.split.reasoning_tokens += max(event.completion_tokens - self.seen, 0)
        out = self._pieces(parts)
        if self.calls is not None:
            out += self._call_pieces(self.calls.finish())
        return out

    def _pieces(self, parts) -> list[tuple]:
        out = []
        for kind, text in parts:
            if kind == "reasoning":
                self.reasoning.append(text)
                out.append(("reasoning", text))
                continue
            self.answer.append(text)
            if self.calls is None:
                out.append(("content", text, self._take_logprobs()))
            else:
                out += self._call_pieces(self.calls.push(text))
        return out

    def _call_pieces(self, parts) -> list[tuple]:
        out = []
        for kind, value in parts:
            if kind == "content":
                out.append(("content", value, self._take_logprobs()))
            elif kind == "call":
                self.call_ids.append(p.new_id("call"))
                out.append(("call", len(self.call_ids) - 1, self.call_ids[-1], value))
            else:
                out.append(("arguments", len(self.call_ids) - 1, value))
        return out

    def _take_logprobs(self) -> list:
        taken, self.held_logprobs = self.held_logprobs, []
        self.logprobs += taken
        return taken


class ChatOutput:
    """The answer of one chat request, built from its choices' events: whole (`whole`) or as
    stream chunks (`opening`, `on_event`, `usage_chunk`). Both read the events the same way
    (`ChoiceStream`)."""

    def __init__(self, ctx: ServingContext, req: p.ChatCompletionRequest, n: int, start: str):
        self.ctx, self.req, self.n = ctx, req, n
        self.rid, self.when = p.new_id("chatcmpl"), p.now()
        self.format = tool_format_of(ctx) if req.tool_mode != "none" else None
        self.streams = [
            ChoiceStream(ReasoningSplitter(start), self.format.stream() if self.format else None) for _ in range(n)
        ]

    def calls(self, s: ChoiceStream, reason: str) -> tuple[str | None, list[p.ToolCall] | None]:
        """The reply's content and calls: (the text before them or None, the calls) when it ends
        in whole calls (and ended by itself), else (the whole answer, None)."""
        answer = "".join(s.answer)
        read = self.format.parse(answer) if self.format and reason == "stop" else None
        if not read:
            return answer, None
        text, parsed = read
        ids = s.call_ids + [p.new_id("call") for _ in parsed[len(s.call_ids) :]]
        calls = [
            p.ToolCall(id=i, function=p.CalledFunction(name=name, arguments=arguments))
            for i, (name, arguments) in zip(ids, parsed)
        ]
        return text or None, calls

    def logprobs(self, entries) -> p.ChatLogprobs | None:
        return p.ChatLogprobs(content=chat_content(self.ctx.token_text, entries)) if self.req.logprobs else None

    def reasoning(self, s: ChoiceStream) -> str | None:
        return "".join(s.reasoning) if s.split.thought else None

    def whole(self, got) -> p.ChatCompletionResponse:
        choices = []
        for i, (c, s) in enumerate(zip(got, self.streams)):
            for event in c.events:
                s.read(event)
            s.close(c.finished)
            content, calls = self.calls(s, c.finished.reason)
            choices.append(
                p.ChatChoice(
                    index=i,
                    message=p.AssistantMessage(content=content, reasoning_content=self.reasoning(s), tool_calls=calls),
                    logprobs=None if calls else self.logprobs(s.logprobs),
                    finish_reason="tool_calls" if calls else c.finished.reason,
                )
            )
        return p.ChatCompletionResponse(
            id=self.rid,
            created=self.when,
            model=self.ctx.model_name,
            choices=choices,
            usage=self.usage([c.finished for c in got]),
        )

    def usage(self, events: list[Finished]) -> p.Usage:
        use = usage(events, self.n)
        reasoning = sum(self.streams[e.index].split.reasoning_tokens for e in events)
        return use.model_copy(
            update={"completion_tokens_details": p.CompletionTokensDetails(reasoning_tokens=reasoning)}
        )

    def chunk(self, choices: list[p.ChatChunkChoice], use: p.Usage | None = None) -> str:
        return sse(
            p.ChatCompletionChunk(id=self.rid, created=self.when, model=self.ctx.model_name, choices=choices, usage=use)
        )

    def opening(self) -> tuple[str, ...]:
        return tuple(
            self.chunk([p.ChatChunkChoice(index=i, delta=p.Delta(role="assistant", content=""))]) for i in range(self.n)
        )

    def usage_chunk(self, events: list[Finished]) -> str:
        return self.chunk([], use=self.usage(events))

    def on_event(self, event) -> str | None:
        i = event.index
        s = self.streams[i]
        if isinstance(event, Finished):
            before = self.sent(i, s.close(event)) or ""
            reason = "tool_calls" if self.calls(s, event.reason)[1] else event.reason
            return before + self.chunk([p.ChatChunkChoice(index=i, delta=p.Delta(), finish_reason=reason)])
        if isinstance(event, Burst):  # each Delta read as it came (the split, the token counts), sent as one
            return self.sent(i, joined([piece for delta in event.deltas for piece in s.read(delta)]))
        if not isinstance(event, Delta):
            return None
        return self.sent(i, s.read(event))

    def sent(self, i: int, pieces: list[tuple]) -> str | None:
        """The chunks of choice i's pieces (`ChoiceStream.read`)."""
        out = []
        for kind, *value in pieces:
            lp = None
            if kind == "reasoning":
                d = p.Delta(reasoning_content=value[0])
            elif kind == "content":
                d, lp = p.Delta(content=value[0]), self.logprobs(value[1])
            elif kind == "call":
                index, call_id, name = value
                fn = p.FunctionDelta(name=name, arguments="")
                d = p.Delta(tool_calls=[p.ToolCallDelta(index=index, id=call_id, type="function", function=fn)])
            else:
                index, text = value
                d = p.Delta(tool_calls=[p.ToolCallDelta(index=index, function=p.FunctionDelta(arguments=text))])
            out.append(self.chunk([p.ChatChunkChoice(index=i, delta=d, logprobs=lp)]))
        return "".join(out) or None


def joined(pieces: list[tuple]) -> list[tuple]:
    """`ChoiceStream.read` pieces with each run of one kind joined: reasoning and content texts
    (content's log-probabilities in order), a call's argument texts; a call's start stays apart."""
    out: list[tuple] = []
    for piece in pieces:
        last = out[-1] if out else (None,)
        if piece[0] == last[0] == "reasoning":
            out[-1] = ("reasoning", last[1] + piece[1])
        elif piece[0] == last[0] == "content":
            out[-1] = ("content", last[1] + piece[1], [*last[2], *piece[2]])
        elif piece[0] == last[0] == "arguments" and piece[1] == last[1]:
            out[-1] = ("arguments", piece[1], last[2] + piece[2])
        else:
            out.append(piece)
    return out
