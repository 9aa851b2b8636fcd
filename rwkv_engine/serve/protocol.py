"""The OpenAI HTTP API as pydantic models: what the server accepts and what it sends.

Requests are validated strictly (a number must be a JSON number, not a string; unknown fields
are refused, as OpenAI does) so that a wrong request gets one clear 400 naming the field,
instead of being silently reinterpreted. Fields OpenAI defines but this server does not
implement are accepted only with their neutral value (best_of = 1, no suffix, store = false).
Chat takes `tools` and `tool_choice` (calls come back as `tool_calls`) and `response_format`
(JSON, or JSON that follows a schema); both are grammar constraints (structured.py).

Extensions (all optional; with the `openai` client pass them in `extra_body`):
    top_k           keep at most this many tokens (0 = off)
    penalty_decay   per-token decay of the occurrence counts behind the penalties (RWKV's 0.996)
    state           name of a saved state file (`State.save`) under the server's --state-dir to
                    start from instead of the fresh state
    ignore_eos      (vLLM, llama.cpp) end-of-text does not end the answer: it is generated as a
                    token like any other (it has no text) and generation goes on
    min_tokens      (vLLM) until this many tokens were generated, no stop token is sampled and no
                    stop string ends the answer
    speculative     "lookup", "draft" or "off": speculative decoding for this request (the same
                    output; default: the server's --speculative)
    chat_template_kwargs   (chat, /tokenize) keyword arguments of the chat template, as vLLM's:
                    {"enable_thinking": false}, {"thinking": true}, ...

Reasoning (docs/server.md): `reasoning_effort` (OpenAI's: none, minimal, low, medium, high) chooses
whether and how long a reasoning model thinks; the reply carries its thought as
`reasoning_content` (DeepSeek's and vLLM's field) on the message and on stream deltas, and
`usage.completion_tokens_details.reasoning_tokens` counts it.

Sampling fields left out take the server's defaults (`settings.RequestDefaults`): the OpenAI API's,
unless its flags say otherwise. This module knows nothing of the engine.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from ..settings import MAX_CHOICES
from .logprobs import MAX_TOP_LOGPROBS

# --- requests ----------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class JSONSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """text, json_object (any JSON object) or json_schema (JSON valid against the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is required with type json_schema, and only there")
        return self


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] = Field(default_factory=list)
    name: str | None = None  # accepted, given to the template
    tool_calls: list[ToolCall] | None = None  # assistant messages: calls it made
    tool_call_id: str | None = None  # tool messages: the call answered
    reasoning_content: str | None = None  # assistant messages: their thought, as this server sent it

    @model_validator(mode="after")
    def _tool_fields(self):
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers), and only it")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_as_part(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of text parts")
        return v

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: content as text, a call's arguments as the JSON
        value they hold (as vLLM and transformers give them; "" is {}, text that is not JSON stays text)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _json_value(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return out


def _json_value(text: str) -> Any:
    if not text:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return text


class TemplateFields(_Strict):
    """What chat requests and /tokenize's messages share: how the template renders them."""

    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def template_kwargs(self, think: bool) -> dict[str, Any]:
        """The template's keyword arguments; `think`: the server's default for requests that say
        nothing. Whether to think is decided once here and handed to the template under both
        names templates use (`thinking`, rwkv-tl's; `enable_thinking`, vLLM's and transformers')."""
        kwargs = dict(self.chat_template_kwargs or {})
        for key in ("enable_thinking", "thinking"):
            if key in kwargs:
                think = bool(kwargs[key])
                break
        if self.reasoning_effort is not None:
            think = self.reasoning_effort != "none"
            kwargs["reasoning_effort"] = self.reasoning_effort
        kwargs.update(thinking=think, enable_thinking=think)
        return kwargs

    def render(self, template, messages: list[ChatMessage], tools, add_generation_prompt: bool, think: bool) -> str:
        """The prompt of `messages` (with `tools`, ToolDefs or None) by `template` (a
        templates.ChatTemplate; InputError when it fails): what the server reads, and what the Ray
        router keys on."""
        listed = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        return template.render(
            [m.for_template() for m in messages],
            listed,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs(think),
        )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved(cls, v):
        reserved = {"messages", "tools", "add_generation_prompt", "bos_token"} & set(v or ())
        if reserved:
            raise ValueError(f"{sorted(reserved)[0]} is set by the server, not by chat_template_kwargs")
        return v


# Values of OpenAI fields this server does not implement that mean "not used".
_NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "store": (None, False),
}


class _SamplingFields(_Strict):
    """The fields completions and chat completions share."""

    model: str | None = None  # None: the served model (as llama.cpp's server)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    penalty_decay: float | None = Field(default=None, ge=0, le=1)
    logit_bias: dict[str, float] | None = None
    stop: list[Annotated[str, Field(max_length=256)]] | None = Field(default=None, max_length=16)
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    state: str | None = Field(default=None, min_length=1)
    ignore_eos: bool = False
    min_tokens: int | None = Field(default=None, ge=0)
    # rwkv-engine's own: speculative decoding for this request (None: the server's --speculative).
    speculative: Literal["lookup", "draft", "off"] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        if v is not None and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise ValueError("must be a string or a list of strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys are token ids (digit strings), got {key[:20]!r}")
            if len(key) > 10:  # (int() of a few thousand digits raises; no vocabulary is that large)
                raise ValueError(f"token id {key[:20]}... is outside any vocabulary")
            if not -100 <= value <= 100:
                raise ValueError(f"values are in [-100, 100], got {value} for token {key}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of prompts (each
    a string or a list of token ids), as OpenAI; validated into a list of prompts."""

    prompt: list[str | list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    @field_validator("best_of", "suffix")
    @classmethod
    def _neutral(cls, v: Any, info) -> Any:
        if v not in _NEUTRAL[info.field_name]:
            raise ValueError("not supported by this server")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if isinstance(v, str) or (_token_ids(v) and v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(x, str) or _token_ids(x) for x in v):
            return v
        raise ValueError("must be a string, a list of token ids, or a non-empty list of those")

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is allowed only with echo (there is nothing to answer)")
        return self


class ChatCompletionRequest(_SamplingFields, TemplateFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # G1 format: several calls in one reply unless false
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info):
        tools = info.data.get("tools") or []
        if v is not None and v != "none" and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in [t.function.name for t in tools]:
            raise ValueError(f"tool_choice names the function {v.function.name!r}, which is not among the tools")
        return v

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v):
        names = [t.function.name for t in v or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be distinct")
        return v

    @property
    def tool_mode(self) -> str:
        """ "none", "auto", "required" or the name of the function to call."""
        if not self.tools:
            return "none"
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        return choice.function.name if isinstance(choice, NamedToolChoice) else choice

    @field_validator("store")
    @classmethod
    def _neutral(cls, v: Any, info) -> Any:
        if v not in _NEUTRAL[info.field_name]:
            raise ValueError("not supported by this server")
        return v

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    @property
    def top_logprob_count(self) -> int | None:
        """Alternatives per token the engine reports; None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_limit_field(self) -> str:
        """The field `token_limit` comes from, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(TemplateFields):
    """POST /tokenize: the text as llama.cpp's `content` or vLLM's `prompt`, or a conversation as
    vLLM's `messages` (rendered by the server's chat template, with `tools`,
    `add_generation_prompt` and `chat_template_kwargs`): exactly one of the three.

    `add_special` (llama.cpp) / `add_special_tokens` (vLLM) are accepted and change nothing: the
    World tokenizer adds no special tokens. `with_pieces` (llama.cpp) returns each token as
    {"id", "piece"}, the piece a string when its bytes are valid UTF-8, else the list of bytes.
    """

    model: str | None = None
    content: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True
    add_special: bool = False
    add_special_tokens: bool = False
    with_pieces: bool = False

    @model_validator(mode="after")
    def _one_text(self):
        if sum(x is not None for x in (self.content, self.prompt, self.messages)) != 1:
            raise ValueError("give the text as content (llama.cpp) or prompt (vLLM), or a conversation as messages")
        if self.messages is None and (self.tools or self.chat_template_kwargs or self.reasoning_effort):
            raise ValueError("tools, chat_template_kwargs and reasoning_effort go with messages")
        return self

    @property
    def text(self) -> str:
        return self.content if self.content is not None else self.prompt


class DetokenizeRequest(_Strict):
    """POST /detokenize: {"tokens": [ids]}; the answer has the text as both `content` (llama.cpp)
    and `prompt` (vLLM)."""

    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings (OpenAI's): `input` a string, a list of strings, a list of token ids or
    a list of lists of ids; `encoding_format` float or base64 (little-endian float32, what the
    official client asks for by default); `dimensions` only the model's own (RWKV embeddings are
    not trained to be truncated); `task` (extension) an EmbeddingRWKV task head."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    task: Literal["retr", "cls", "sts"] | None = None


class RerankDocument(_Strict):
    text: str


class RerankRequest(_Strict):
    """POST /v1/rerank and /rerank (Jina's and vLLM's body; Cohere's fields): the documents as
    strings or {"text"}; the answer's results sorted by relevance, the first `top_n` of them."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    user: str | None = None

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


# --- responses ---------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # chat: the thought's share

    @model_serializer(mode="wrap")
    def _details_when_set(self, handler) -> dict[str, Any]:
        out = handler(self)
        if self.completion_tokens_details is None:
            out.pop("completion_tokens_details", None)
        return out


class CompletionLogprobs(BaseModel):
    """Legacy completions log-probabilities (see logprobs.py for the token text and offsets)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    """The body of a non-streamed completion, and (object the same) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # the thought, when the reply had one
    tool_calls: list[ToolCall] | None = None

    @model_serializer
    def _calls_when_made(self) -> dict[str, Any]:
        out = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: the first has id, type and name (arguments ""), the next
    ones the following pieces of the arguments."""

    index: int = 0
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer
    def _set_fields_only(self) -> dict[str, Any]:
        out = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type=self.type)
        out["function"] = {
            k: v for k, v in (("name", self.function.name), ("arguments", self.function.arguments)) if v is not None
        }
        return out


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer
    def _set_fields_only(self) -> dict[str, Any]:
        fields = (("role", self.role), ("content", self.content), ("reasoning_content", self.reasoning_content))
        out = {k: v for k, v in fields if v is not None}
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rwkv-engine"
    # How chat requests are rendered: {"chat_template": name, "chat_template_source": why it was
    # chosen, "reasoning": whether the template has thinking, "think": the default for requests
    # that do not say} (llama.cpp puts its model facts in `meta` too)
    meta: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- errors ------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    """OpenAI's error body for an answer of HTTP `status`: every error the server sends is one."""
    return ErrorResponse(error=ErrorDetail(message=message, type=error_type(status), param=param, code=code))


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-before", "function-after"}


def describe_validation_error(e: ValidationError) -> tuple[str, str]:
    """(param, message) for the first problem of a failed request validation."""
    err = e.errors(include_url=False)[0]
    param = ""
    for part in err["loc"]:
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):
            continue  # which member of a union pydantic tried, not a field
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += ("." if param else "") + str(part)
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err["type"] == "extra_forbidden":
        msg = "unrecognized request field"
    elif err["type"] == "missing":
        msg = "required field is missing"
    return param, f"{param}: {msg}" if param else msg
