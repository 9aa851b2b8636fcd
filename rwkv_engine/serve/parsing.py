"""From an HTTP request to what the engine takes: the key check, the body (size-capped JSON), the
`protocol` model, prompt token ids and `SamplingParams`. Anything wrong is an `APIError` (4xx),
decided before the request reaches the engine."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request as HTTPRequest
from pydantic import ValidationError

from ..errors import InputError, RWKVEngineError
from ..sampling import SamplingParams
from ..tokenizer import EOS_TOKEN_ID
from . import protocol as p
from .context import ServingContext
from .errors import APIError
from .security import key_matches, quoted

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "penalty_decay",
    "seed",
    "min_tokens",
)


def authorize(ctx: ServingContext, request: HTTPRequest) -> None:
    key = ctx.config.server.api_key
    if key is not None and not key_matches(request.headers.get("authorization", ""), key):
        raise APIError(
            401, "missing or incorrect API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
        )


async def read_json(ctx: ServingContext, request: HTTPRequest) -> dict:
    limit = ctx.config.limits.max_body_bytes
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


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse(ctx: ServingContext, kind: type[p._Strict], obj: dict):
    """`obj` as a `kind` request, for the model this server serves."""
    try:
        req = kind.model_validate(obj)
    except ValidationError as e:
        param, message = p.describe_validation_error(e)
        raise APIError(400, message, param=param or None) from None
    name = ctx.model_name
    if req.model is not None and req.model != name:  # (optional in /tokenize)
        raise APIError(
            404,
            f"the model {quoted(req.model)} does not exist; this server serves {name!r}",
            param="model",
            code="model_not_found",
        )
    return req


async def read_request(ctx: ServingContext, request: HTTPRequest, kind: type[p._Strict]):
    """The key checked, then the body read and parsed as a `kind` request."""
    authorize(ctx, request)
    return parse(ctx, kind, await read_json(ctx, request))


def sampling_params(
    ctx: ServingContext,
    req,
    defaults: SamplingParams,
    max_tokens: int | None,
    default_max: int,
    extra_stop: tuple[str, ...] = (),
    max_tokens_field: str = "max_tokens",
) -> SamplingParams:
    """`defaults` with the request's sampling fields applied; max_tokens capped by the server."""
    cap = ctx.config.limits.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max, cap)
    if max_tokens > cap:
        raise APIError(
            400, f"{max_tokens_field} is {max_tokens}; this server allows at most {cap}", param=max_tokens_field
        )
    changes = {f: getattr(req, f) for f in _SAMPLING_FIELDS if getattr(req, f) is not None}
    changes["max_tokens"] = max_tokens
    changes["stop"] = tuple(dict.fromkeys((*extra_stop, *(req.stop or ()))))
    if req.logit_bias:
        changes["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    if req.ignore_eos:  # end-of-text becomes a token like any other
        changes["stop_token_ids"] = tuple(t for t in defaults.stop_token_ids if t != EOS_TOKEN_ID)
    try:
        return defaults.replace(**changes)
    except InputError as e:
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0].rstrip(":")) from None


async def encode_text(ctx: ServingContext, text: str, param: str) -> list[int]:
    try:
        if len(text) > 4096:
            return list(await asyncio.to_thread(ctx.tokenizer.encode, text))
        return list(ctx.tokenizer.encode(text))
    except (RWKVEngineError, UnicodeError) as e:  # e.g. a lone surrogate "\ud800"
        raise APIError(400, f"the {param} cannot be tokenized: {e}", param=param) from None


async def prompt_ids(ctx: ServingContext, prompt: str | list[int]) -> list[int]:
    ids = await encode_text(ctx, prompt, "prompt") if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, "the prompt is empty: there is nothing to continue", param="prompt")
    limit = ctx.config.limits.max_prompt_tokens
    if len(ids) > limit:
        raise APIError(
            400,
            f"the prompt has {len(ids)} tokens; this server accepts at most {limit}",
            param="prompt",
            code="context_length_exceeded",
        )
    return ids
