"""`SamplingParams` and the sampling presets: what to sample and when to stop, validated.

Kept apart from rwkv_engine/sampling.py (the samplers, which need torch) so that the command
line can check sampling flags and show their defaults without importing torch; sampling.py
re-exports everything here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .chat_format import TURN_SEPARATOR
from .errors import InputError
from .tokenizer.world import EOS_TOKEN_ID


def _number(name: str, value, *, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a number, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise InputError(f"{name} must be an integer, got {value!r}")
        return int(value)
    value = float(value)
    if math.isnan(value):
        raise InputError(f"{name} must be a number, got nan")
    return value


def _token_id(name: str, value) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # JSON object keys arrive as strings
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{name}: token ids are non-negative integers, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. All fields are validated on construction.

    temperature        >= 0; 0 = greedy.
    top_p              in (0, 1]; 1 = no nucleus cut.
    top_k              >= 0; 0 = off.
    presence_penalty   subtracted once from every token generated so far.
    frequency_penalty  subtracted per (decayed) occurrence of a generated token.
    penalty_decay      in [0, 1]: every step the occurrence counts are multiplied by it.
    logit_bias         {token id: value} added to the logits; -inf bans the token.
    banned_token_ids   tokens that are never sampled.
    stop_token_ids     sampling one of these ends the generation; it is not part of the output.
                       Default (0,): id 0 is end-of-text for every RWKV vocabulary.
    stop               strings that end the generation; they are never part of the output.
    max_tokens         most tokens to generate (None = unbounded).
    min_tokens         fewest tokens to generate (vLLM's): until this many were generated, the
                       stop tokens are never sampled and stop strings do not end the output.
    seed               seed of the sequence's torch.Generator (None = nondeterministic).
    json_schema        a JSON schema (dict or JSON text): the output is JSON that validates
                       against it, by constrained decoding (rwkv_engine/structured.py).
    json_object        True: the output is a JSON object (any keys and values).

    Use `dataclasses.replace(params, temperature=0.5)` for a modified copy (validated too).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_decay: float = 0.996
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    banned_token_ids: Sequence[int] = ()
    stop_token_ids: Sequence[int] = (EOS_TOKEN_ID,)
    stop: Sequence[str] = ()
    max_tokens: int | None = 256
    min_tokens: int = 0
    seed: int | None = None
    json_schema: Mapping | str | None = None
    json_object: bool = False

    def __post_init__(self):
        self.temperature = _number("temperature", self.temperature)
        if not 0.0 <= self.temperature < math.inf:
            raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        self.top_p = _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _number("top_k", self.top_k, integer=True)
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not math.isfinite(value):
                raise InputError(f"{name} must be finite, got {value}")
            setattr(self, name, value)
        self.penalty_decay = _number("penalty_decay", self.penalty_decay)
        if not 0.0 <= self.penalty_decay <= 1.0:
            raise InputError(f"penalty_decay must be in [0, 1], got {self.penalty_decay}")

        if not isinstance(self.logit_bias, Mapping):
            raise InputError(f"logit_bias must be a mapping of token id to value, got {self.logit_bias!r}")
        bias = {}
        for k, v in self.logit_bias.items():
            v = _number(f"logit_bias[{k!r}]", v)
            if v == math.inf:
                raise InputError(f"logit_bias[{k!r}] must not be +inf")
            bias[_token_id("logit_bias", k)] = v
        self.logit_bias = bias
        self.banned_token_ids = self._ids("banned_token_ids", self.banned_token_ids)
        self.stop_token_ids = self._ids("stop_token_ids", self.stop_token_ids)

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            raise InputError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InputError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop = stop

        if self.max_tokens is not None:
            self.max_tokens = _number("max_tokens", self.max_tokens, integer=True)
            if self.max_tokens < 0:
                raise InputError(f"max_tokens must be >= 0, got {self.max_tokens}")
        self.min_tokens = _number("min_tokens", self.min_tokens, integer=True)
        if self.min_tokens < 0:
            raise InputError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InputError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None:
            self.seed = _number("seed", self.seed, integer=True)
            if not 0 <= self.seed < 2**63:
                raise InputError(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.json_object, bool):
            raise InputError(f"json_object must be true or false, got {self.json_object!r}")
        if self.json_schema is not None:
            if self.json_object:
                raise InputError("json_schema and json_object are exclusive (a schema already asks for JSON)")
            if not isinstance(self.json_schema, (Mapping, str)):
                raise InputError(
                    f"json_schema must be a JSON schema (a mapping or its JSON text), got {self.json_schema!r}"
                )

    @staticmethod
    def _ids(name: str, ids) -> tuple[int, ...]:
        if isinstance(ids, int):
            ids = (ids,)
        try:
            ids = tuple(ids)
        except TypeError:
            raise InputError(f"{name} must be a list of token ids, got {ids!r}") from None
        return tuple(dict.fromkeys(_token_id(name, i) for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> SamplingParams:
        """A validated copy with some fields changed."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise InputError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InputError if a token id named here is outside a vocabulary of `vocab_size`."""
        for name in ("logit_bias", "banned_token_ids", "stop_token_ids"):
            ids = getattr(self, name)
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise InputError(f"{name}: token id {bad[0]} is outside the vocabulary (size {vocab_size})")


# The presets every front end starts from (the CLI and the server add their own max_tokens and stops).
# Chat: ChatRWKV's API_DEMO_CHAT.py (the RWKV-7 chat demo).
CHAT = SamplingParams(temperature=1.0, top_p=0.3, presence_penalty=0.5, frequency_penalty=0.5, penalty_decay=0.996)
# The terminal chat (rwkv-engine chat): CHAT, replies cut at the turn separator, end-of-text banned
# (a reply ends at the separator), as SamplingParams fields.
CHAT_SESSION = dataclasses.asdict(
    CHAT.replace(max_tokens=500, stop=(TURN_SEPARATOR,), stop_token_ids=(), banned_token_ids=(EOS_TOKEN_ID,))
)
# Completion: a wider nucleus and lighter penalties, for continuing free text.
COMPLETION = SamplingParams(
    temperature=1.0, top_p=0.85, presence_penalty=0.2, frequency_penalty=0.2, penalty_decay=0.996
)
