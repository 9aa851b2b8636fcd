"""POST /v1/completions: text (or token ids) -> continuation, whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from . import protocol as p
from .context import ServingContext
from .engine import Finished, Prompt
from .jobs import Choice, collect, sse, stream_events, stream_response, submit, usage
from .logprobs import CompletionLogprobs
from .parsing import prompt_ids, read_request, sampling_params


def router(ctx: ServingContext) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await create_completion(ctx, request)

    return r


async def create_completion(ctx: ServingContext, request: HTTPRequest):
    req = await read_request(ctx, request, p.CompletionRequest)
    defaults = ctx.config.defaults
    params = sampling_params(ctx, req, defaults.sampling, req.max_tokens, defaults.completion_max_tokens)
    prompts = [await prompt_ids(ctx, prompt) for prompt in req.prompt]
    state, state_key = await ctx.states.get(req.state)
    n = req.n or 1
    job = submit(
        ctx.engine,
        prompts,
        params,
        state,
        state_key,
        n=n,
        logprobs=req.logprobs,
        echo=req.echo,
        speculative=req.speculative,
    )
    out = CompletionOutput(ctx, req, prompts, n, job.choices)
    if not req.stream:
        got = await collect(request, job)
        return Response(status_code=499) if got is None else out.whole(got)
    return stream_response(
        stream_events(job, out.on_event, usage_chunk=out.usage_chunk if req.include_usage_in_stream else None)
    )


class CompletionOutput:
    """The answer of one completion request, built from its choices' events: whole (`whole`) or
    as stream chunks (`on_event`, `usage_chunk`). Choice i continues prompt i // n."""

    def __init__(self, ctx: ServingContext, req: p.CompletionRequest, prompts: list[list[int]], n: int, choices: int):
        self.ctx, self.req, self.prompts, self.n = ctx, req, prompts, n
        self.rid, self.when = p.new_id("cmpl"), p.now()
        self.books = [CompletionLogprobs(ctx.token_text) for _ in range(choices)] if req.logprobs is not None else None

    def prompt_text(self, i: int) -> str:
        return self.ctx.tokenizer.decode(self.prompts[i // self.n])

    def logprobs(self, i: int, event: Prompt | None, entries) -> p.CompletionLogprobs | None:
        """Choice i's log-probabilities of what `event` (echo) and `entries` (tokens) add."""
        if self.books is None:
            return None
        book = self.books[i]
        if event is not None:
            book.add_first(self.prompts[i // self.n][0])
            book.add(event.logprobs)
        book.add(entries)
        return p.CompletionLogprobs(**book.take())

    def response(self, choices: list[p.CompletionChoice], use: p.Usage | None = None) -> p.CompletionResponse:
        return p.CompletionResponse(
            id=self.rid, created=self.when, model=self.ctx.model_name, choices=choices, usage=use
        )

    def whole(self, got: list[Choice]) -> p.CompletionResponse:
        echo = self.req.echo
        choices = [
            p.CompletionChoice(
                index=i,
                text=(self.prompt_text(i) if echo else "") + c.text,
                logprobs=self.logprobs(i, c.prompt, c.logprobs),
                finish_reason=c.finished.reason,
            )
            for i, c in enumerate(got)
        ]
        return self.response(choices, usage([c.finished for c in got], self.n))

    def on_event(self, event) -> str:
        i = event.index
        if isinstance(event, Finished):
            return sse(self.response([p.CompletionChoice(index=i, text="", finish_reason=event.reason)]))
        if isinstance(event, Prompt):
            text, lp = self.prompt_text(i), self.logprobs(i, event, ())
        else:
            text, lp = event.text, self.logprobs(i, None, event.logprobs)
        return sse(self.response([p.CompletionChoice(index=i, text=text, logprobs=lp)]))

    def usage_chunk(self, events: list[Finished]) -> str:
        return sse(self.response([], usage(events, self.n)))
