"""POST /v1/chat/completions: messages (World chat format) -> reply, whole or streamed; tools
and response_format through grammar constraints (structured.py, tool_calls.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from .. import tool_calls
from ..chat_format import TURN_SEPARATOR, ReplyText, render_chat
from ..errors import InputError
from ..sampling import SamplingParams
from ..structured import grammar_for
from . import protocol as p
from .context import ServingContext
from .engine import Finished
from .errors import APIError
from .jobs import Choice, collect, sse, stream_events, stream_response, submit, usage
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
    params, constraint = await chat_constraint(ctx, req, params)
    ids = await prompt_ids(ctx, render_chat(chat_messages(req)))
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
    out = ChatOutput(ctx, req, n)
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


async def chat_constraint(ctx: ServingContext, req: p.ChatCompletionRequest, params: SamplingParams):
    """(params, a factory of the reply's Constraint, or None) for response_format and tools;
    the grammar is compiled here, off the event loop."""
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
        make, param = (lambda: tool_calls.tool_constraints(tools, mode, tokenizer, vocab)), "tools"
    else:
        return params, None
    try:
        return params, await asyncio.to_thread(make)
    except InputError as e:
        raise APIError(400, str(e), param=param) from None


@dataclass
class ChoiceStream:
    """What one choice of a streamed reply holds between events. With tools, its reply is text or
    a call, sent as it grows (`calls`); log-probabilities of held text go out with it (a call
    carries none)."""

    reply: ReplyText = field(default_factory=ReplyText)
    calls: tool_calls.CallStream | None = None
    held_logprobs: list = field(default_factory=list)
    call_id: str = field(default_factory=lambda: p.new_id("call"))


class ChatOutput:
    """The answer of one chat request, built from its choices' events: whole (`whole`) or as
    stream chunks (`opening`, `on_event`, `usage_chunk`)."""

    def __init__(self, ctx: ServingContext, req: p.ChatCompletionRequest, n: int):
        self.ctx, self.req, self.n = ctx, req, n
        self.rid, self.when = p.new_id("chatcmpl"), p.now()
        self.with_tools = req.tool_mode != "none"
        self.streams = [ChoiceStream(calls=tool_calls.CallStream() if self.with_tools else None) for _ in range(n)]

    def tool_call(self, reply: str, reason: str) -> p.ToolCall | None:
        call = tool_calls.parse_call(reply) if self.with_tools and reason == "stop" else None
        return call and p.ToolCall(id=p.new_id("call"), function=p.CalledFunction(name=call[0], arguments=call[1]))

    def logprobs(self, entries) -> p.ChatLogprobs | None:
        return p.ChatLogprobs(content=chat_content(self.ctx.token_text, entries)) if self.req.logprobs else None

    def whole(self, got: list[Choice]) -> p.ChatCompletionResponse:
        choices = []
        for i, c in enumerate(got):
            reply = ReplyText()(c.text)
            call = self.tool_call(reply, c.finished.reason)
            message = p.AssistantMessage(content=None, tool_calls=[call]) if call else p.AssistantMessage(content=reply)
            choices.append(
                p.ChatChoice(
                    index=i,
                    message=message,
                    logprobs=None if call else self.logprobs(c.logprobs),
                    finish_reason="tool_calls" if call else c.finished.reason,
                )
            )
        return p.ChatCompletionResponse(
            id=self.rid,
            created=self.when,
            model=self.ctx.model_name,
            choices=choices,
            usage=usage([c.finished for c in got], self.n),
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
        return self.chunk([], use=usage(events, self.n))

    def on_event(self, event) -> str | None:
        i = event.index
        s = self.streams[i]
        if isinstance(event, Finished):
            reason, before = event.reason, ""
            if s.calls is not None:
                called = self.tool_call(s.calls.held, reason) is not None
                before, reason = self.sent(i, s.calls.finish()) or "", "tool_calls" if called else reason
            return before + self.chunk([p.ChatChunkChoice(index=i, delta=p.Delta(), finish_reason=reason)])
        text = s.reply(event.text)
        if s.calls is not None:
            s.held_logprobs += event.logprobs or []
            return self.sent(i, s.calls.push(text))
        if not (text or event.logprobs):
            return None
        return self.chunk(
            [p.ChatChunkChoice(index=i, delta=p.Delta(content=text), logprobs=self.logprobs(event.logprobs))]
        )

    def sent(self, i: int, parts: list[tuple[str, str]]) -> str | None:
        """The chunks of choice i's `parts` (tool_calls.CallStream): content, a call's name, or
        a piece of its arguments."""
        s = self.streams[i]
        out = []
        for kind, value in parts:
            lp = None
            if kind == "content":
                d = p.Delta(content=value)
                lp, s.held_logprobs = self.logprobs(s.held_logprobs), []
            elif kind == "call":
                fn = p.FunctionDelta(name=value, arguments="")
                d = p.Delta(tool_calls=[p.ToolCallDelta(id=s.call_id, type="function", function=fn)])
            else:
                d = p.Delta(tool_calls=[p.ToolCallDelta(function=p.FunctionDelta(arguments=value))])
            out.append(self.chunk([p.ChatChunkChoice(index=i, delta=d, logprobs=lp)]))
        return "".join(out) or None
