"""What goes into the serving engine (`Request`) and what comes out of it (`Prompt`, `Delta`,
`Finished` events, in that order, to the request's sink; an `InputsRequest` gets one `Read`, or a
`Finished` with reason "error" / "cancelled"; `QueueFull`, `EngineStopped` from
`Engine.submit`). They know nothing of HTTP: serve/jobs.py turns them into API answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import RWKVEngineError
from ..sampling import SamplingParams
from ..state import State
from ..structured import Constraint
from .logprobs import TokenLogprob


@dataclass
class Request:
    """What to generate: a continuation of `prompt_ids` from `start_state` (None = fresh)."""

    prompt_ids: list[int]
    params: SamplingParams
    start_state: State | None = None
    start_key: str = ""  # names start_state in the prompt cache; "" is the fresh state
    n: int = 1  # choices sampled from the one prefill
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    echo: bool = False  # send a Prompt event (with logprobs: the prompt's log-probabilities)
    # A fresh grammar Constraint for each choice (default: from params.json_schema / json_object).
    constraint: Callable[[], Constraint] | None = None
    # Speculative decoding: "lookup", "draft", "off", or None for the engine's default. The output
    # is the same either way; a request with logprobs decodes plainly.
    speculative: str | None = None


@dataclass
class InputsRequest:
    """Inputs to read, with nothing generated (work.InputsPrefill): embeddings of `inputs` (token
    sequences as `embedding.encode` gives them), or, with `query`, the rerank scores of the
    document prefixes `inputs` against the query ids (the engine's reranker)."""

    inputs: list[list[int]]
    task: str | None = None  # an EmbeddingRWKV task head (None: the default / mean pooling)
    normalize: bool | None = None
    query: list[int] | None = None


@dataclass(frozen=True)
class Read:
    """What an `InputsRequest` gives: `values` [N, D] embeddings or [N] rerank scores (fp32, CPU),
    in input order; `tokens` the tokens read (for usage), `cached_tokens` those the cache gave."""

    values: object  # torch.Tensor (this module stays torch-free)
    tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Prompt:
    """The prompt of an echo request: log-probabilities of its tokens (the first has none), or
    None when the request asked for no log-probabilities."""

    logprobs: tuple[TokenLogprob, ...] | None
    index: int = 0


@dataclass(frozen=True)
class Delta:
    text: str
    index: int = 0  # the choice
    logprobs: tuple[TokenLogprob, ...] = ()  # of the token(s) behind this piece, if asked for
    generated: int = 0  # tokens the choice has generated so far, this piece's included


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    message: str | None = None  # what went wrong, for "error"
    index: int = 0  # the choice


Sink = Callable[[object], None]


class QueueFull(RWKVEngineError):
    """Every batch slot is taken and `max_queue` requests already wait."""

    retry_after = 1  # seconds


class EngineStopped(RWKVEngineError):
    """The engine is not running (not started yet, or shutting down)."""
