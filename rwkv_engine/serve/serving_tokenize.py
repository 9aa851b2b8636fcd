"""The model list and the tokenizer's routes: /v1/models, /tokenize, /detokenize, /tokenizer_info."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from ..tokenizer import EOS_TOKEN_ID
from . import protocol as p
from .context import ServingContext
from .errors import APIError
from .parsing import authorize, encode_text, read_request
from .security import quoted
from .serving_chat import render


def router(ctx: ServingContext) -> APIRouter:
    r = APIRouter()
    served = ctx.model_name
    template = ctx.template
    meta = {
        "chat_template": template.name,
        "chat_template_source": template.source,
        "reasoning": template.thinks,  # the template knows <think> (a reasoning model's format)
        "think": ctx.config.chat.think,
    }

    @r.get("/v1/models")
    async def list_models(request: HTTPRequest):
        authorize(ctx, request)
        return p.ModelList(data=[p.ModelCard(id=served, created=ctx.created, meta=meta)])

    @r.get("/v1/models/{name:path}")
    async def get_model(name: str, request: HTTPRequest):
        authorize(ctx, request)
        if name != served:
            raise APIError(404, f"the model {quoted(name)} does not exist", param="model", code="model_not_found")
        return p.ModelCard(id=served, created=ctx.created, meta=meta)

    @r.post("/tokenize")
    @r.post("/v1/tokenize")
    async def tokenize(request: HTTPRequest):
        req = await read_request(ctx, request, p.TokenizeRequest)
        if req.messages is not None:  # (vLLM's chat form: the prompt /v1/chat/completions would read)
            text = render(ctx, req.messages, req.tools, req.add_generation_prompt, req)
            ids = await encode_text(ctx, text, "messages")
        else:
            ids = await encode_text(ctx, req.text, "content" if req.content is not None else "prompt")
        tokens = [_piece(ctx.tokenizer, t) for t in ids] if req.with_pieces else ids
        return {"tokens": tokens, "count": len(ids), "max_model_len": ctx.config.limits.max_prompt_tokens}

    @r.get("/tokenizer_info")
    async def tokenizer_info(request: HTTPRequest):
        """vLLM's tokenizer description, which lm-evaluation-harness's `local-completions` probes
        to use the server's /tokenize. The World tokenizer has no end-of-text *text* (token 0 has
        none), so the special-token strings are null and `eos_token_id` is 0. `chat_template` is
        the Jinja text of the server's chat template."""
        authorize(ctx, request)
        return {
            "tokenizer_class": type(ctx.tokenizer).__name__,
            "eos_token": None,
            "bos_token": None,
            "pad_token": None,
            "eos_token_id": EOS_TOKEN_ID,
            "vocab_size": ctx.model.config.vocab_size,
            "model_max_length": ctx.config.limits.max_prompt_tokens,
            "chat_template": template.text,
        }

    @r.post("/detokenize")
    @r.post("/v1/detokenize")
    async def detokenize(request: HTTPRequest):
        req = await read_request(ctx, request, p.DetokenizeRequest)
        vocab = ctx.model.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
        text = ctx.tokenizer.decode(req.tokens)
        return {"content": text, "prompt": text}

    return r


def _piece(tokenizer, token: int) -> dict:
    """A token and its text, or its bytes where they are not whole UTF-8."""
    raw = tokenizer.decode_bytes([token])
    try:
        return {"id": token, "piece": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"id": token, "piece": list(raw)}
