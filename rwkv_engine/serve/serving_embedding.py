"""POST /v1/embeddings (OpenAI's API) and /v1/rerank, /rerank (Jina's and vLLM's): inputs read by
the engine with nothing generated (`Engine.submit_inputs`), beside the chats (docs/server.md).
Each request is counted in /metrics by outcome (`embedding_requests_total`, `rerank_requests_total`),
and what an answered one read (inputs, documents, tokens)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from ..embedding import encode, is_embedder
from ..errors import InputError, RWKVEngineError
from . import protocol as p
from .context import ServingContext
from .engine import InputsRequest
from .errors import APIError
from .jobs import read, submit_inputs
from .parsing import encode_text, read_request


def router(ctx: ServingContext) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/embeddings")
    async def embeddings(request: HTTPRequest):
        return await _counted(ctx, "embedding_requests_total", create_embeddings(ctx, request))

    @r.post("/v1/rerank")
    @r.post("/rerank")
    async def rerank(request: HTTPRequest):
        return await _counted(ctx, "rerank_requests_total", create_rerank(ctx, request))

    return r


async def _counted(ctx: ServingContext, counter: str, answer: Awaitable[Response]) -> Response:
    """`answer`'s response, its outcome counted in `counter`: ok, rejected (a 4xx), cancelled
    (the client left: a 499, a disconnect while the body was read), error (a 5xx, or anything
    unexpected)."""
    outcome = "error"
    try:
        response = await answer
        outcome = "cancelled" if response.status_code == 499 else "ok"
        return response
    except APIError as e:
        outcome = "rejected" if e.status < 500 else "error"
        raise
    except (ClientDisconnect, asyncio.CancelledError):
        outcome = "cancelled"
        raise
    finally:
        ctx.metrics.inc(counter, outcome=outcome)


async def create_embeddings(ctx: ServingContext, request: HTTPRequest):
    req = await read_request(ctx, request, p.EmbeddingRequest)
    model = ctx.model
    D = model.config.n_embd
    if req.dimensions is not None and req.dimensions != D:
        raise APIError(
            400,
            f"dimensions {req.dimensions}: this model's embeddings have {D} (it was not trained to shorten them)",
            param="dimensions",
        )
    items = [req.input] if isinstance(req.input, str) or _is_ids(req.input) else req.input
    _check_count(ctx, len(items), "input")
    items = [await encode_text(ctx, x, "input") if isinstance(x, str) else x for x in items]
    try:
        ids = encode(model, None, items)  # (the end token appended; ids checked against the vocabulary)
    except InputError as e:
        raise APIError(400, str(e), param="input") from None
    _check_lengths(ctx, ids, 0, "input")
    task = req.task or (ctx.config.defaults.embedding_task if is_embedder(model) else None)
    job = submit_inputs(ctx.engine, InputsRequest(ids, task=task))
    got = await read(request, job)
    if got is None:
        return Response(status_code=499)
    ctx.metrics.inc("embedding_inputs_total", len(ids))
    ctx.metrics.inc("embedding_tokens_total", got.tokens)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
        for i, v in enumerate(got.values)
    ]
    usage = {"prompt_tokens": got.tokens, "total_tokens": got.tokens}
    return JSONResponse({"object": "list", "data": data, "model": ctx.model_name, "usage": usage})


async def create_rerank(ctx: ServingContext, request: HTTPRequest):
    req = await read_request(ctx, request, p.RerankRequest)
    reranker = ctx.engine.reranker
    if reranker is None:
        raise APIError(400, "this server has no reranker (start it with --reranker FILE)", param="model")
    texts = req.texts
    _check_count(ctx, len(texts), "documents")
    try:
        query = reranker.query_ids(ctx.tokenizer, req.query)
        docs = await asyncio.to_thread(lambda: [reranker.document_ids(ctx.tokenizer, d) for d in texts])
    except (RWKVEngineError, UnicodeError) as e:  # e.g. a lone surrogate "\ud800"
        raise APIError(400, f"the query or a document cannot be tokenized: {e}", param="documents") from None
    _check_lengths(ctx, docs, len(query), "documents")
    job = submit_inputs(ctx.engine, InputsRequest(docs, query=query))
    got = await read(request, job)
    if got is None:
        return Response(status_code=499)
    ctx.metrics.inc("rerank_documents_total", len(docs))
    ctx.metrics.inc("rerank_tokens_total", got.tokens)
    scores = got.values.tolist()
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    usage = {
        "prompt_tokens": got.tokens,
        "total_tokens": got.tokens,
        "prompt_tokens_details": {"cached_tokens": got.cached_tokens},  # document prefixes from the cache
    }
    return JSONResponse({"id": p.new_id("rerank"), "model": ctx.model_name, "usage": usage, "results": results})


def _is_ids(value) -> bool:
    return bool(value) and all(isinstance(t, int) for t in value)


def _check_count(ctx: ServingContext, n: int, param: str) -> None:
    limit = ctx.config.limits.max_embedding_inputs
    if n == 0:
        raise APIError(400, f"{param} is empty: give at least one", param=param)
    if n > limit:
        raise APIError(400, f"{n} {param} in one request; this server takes at most {limit}", param=param)


def _check_lengths(ctx: ServingContext, ids: list[list[int]], extra: int, param: str) -> None:
    """Each input (with `extra` tokens read after it: a rerank query) within the prompt limit."""
    limit = ctx.config.limits.max_prompt_tokens
    for i, seq in enumerate(ids):
        if len(seq) + extra > limit:
            raise APIError(
                400,
                f"{param}[{i}] has {len(seq) + extra} tokens; this server accepts at most {limit}",
                param=param,
                code="context_length_exceeded",
            )


def _encoded(vector, encoding_format: str):
    """A vector [D] as a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
