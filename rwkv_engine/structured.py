"""Constrained decoding: JSON output that follows a schema, and tool calls, by token masks.

A grammar (a JSON schema, "any JSON object", or a tool call) is compiled by llguidance against
the model's vocabulary; each constrained sequence holds a `Constraint`, which says before every
step which tokens may come next (a bitmask over the vocabulary) and advances on the token drawn.
`Sampler.sample_batch` (sampling.py) calls `apply_masks` on the rows that carry one, after
bias and penalties and before top-p / top-k / temperature, so constrained and unconstrained
sequences share a decode step; a row without a constraint is untouched.

Why llguidance and not xgrammar (both were measured on the World vocabulary, 65536 tokens,
benchmarks/bench_structured.py; numbers in docs/performance.md): both gave valid JSON on every walk over
the byte-level World tokens, and their per-step mask costs are of the same order (a fraction of
a millisecond, far below a decode step). llguidance compiles a schema lazily (about 1 ms
against tens of ms), and it has no dependencies, where xgrammar requires torch, transformers
and triton, which would pin torch and add hundreds of MB to a CPU engine's install.

Vocabulary (`grammar_tokenizer`): token id -> its raw bytes (`tokenizer.decode_bytes([id])`).
Ids without bytes (0 = end of text; 65530..65535 of the World vocab; ids past the tokenizer's
end) are special tokens the grammar never produces; id 0 is the end-of-text token, which the
mask allows exactly when the grammar is complete, and then only it: an answer whose grammar
is complete ends there (finish_reason "stop"), one that runs out of max_tokens first ends with
"length" and its partial text. So constrained decoding needs 0 among the stop tokens.

JSON is generated compact (no whitespace between tokens: "," and ":" as separators), which
also keeps "\\n\\n", the end of a chat reply, out of it. For `json_schema`, properties the schema
does not name are allowed where JSON Schema allows them (pass "additionalProperties": false,
as OpenAI's strict mode requires, to forbid them).

Tool calls (rwkv_engine/tool_calls.py renders them): a call is `TOOL_CALL_MARKER` followed by
{"name": ..., "arguments": {...}}. `call_grammar(..., forced=True)` constrains a whole reply
to " <tool_call>{...}" (tool_choice "required" or a named function); `forced=False` (tool_choice
"auto") leaves the reply free until it starts with the marker, after which the call's grammar
applies (`ToolCallTrigger`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .errors import InputError, RWKVEngineError
from .tokenizer import EOS_TOKEN_ID

TOOL_CALL_MARKER = "<tool_call>"
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: "," and ":" without spaces

__all__ = [
    "Grammar",
    "Constraint",
    "ToolCallTrigger",
    "grammar_for",
    "constraint_for",
    "json_grammar",
    "call_grammar",
    "apply_masks",
    "TOOL_CALL_MARKER",
]


def _llguidance():
    try:
        import llguidance  # (not llguidance.torch: its import runs torch.compile, ~10 s)
    except ImportError:  # a runtime dependency; only a broken install lacks it
        raise InputError("structured output needs the llguidance package (pip install llguidance)") from None
    return llguidance


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer, vocab_size: int):
    """The llguidance tokenizer of `tokenizer`'s vocabulary, `vocab_size` ids (about 0.3 s; cached)."""
    llg = _llguidance()
    tokens, special = [], []
    for i in range(vocab_size):
        raw = tokenizer.decode_bytes([i]) if i < tokenizer.vocab_size else b""
        if not raw:  # no text: end of text or an unused id; the 0xFF prefix marks a special token
            raw = b"\xff<|endoftext|>" if i == EOS_TOKEN_ID else b"\xff<|unused_%d|>" % i
            special.append(i)
        tokens.append(raw)

    class Vocabulary:  # what llguidance.TokenizerWrapper reads
        eos_token_id = EOS_TOKEN_ID
        bos_token_id = None
        special_token_ids = special

        def __init__(self):
            self.tokens = tokens

        def __call__(self, data: bytes) -> list[int]:
            return tokenizer.encode_bytes(data)

    return llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary()), n_vocab=vocab_size, eos_token=EOS_TOKEN_ID)


@functools.lru_cache(maxsize=1)
def _executor():
    """llguidance's thread pool that computes the masks of a batch's rows in parallel."""
    return _llguidance().LLExecutor(num_threads=2)


class Grammar:
    """A compiled grammar on one vocabulary; `constraint()` gives a fresh matcher per sequence."""

    def __init__(self, lark_or_json: str, tokenizer, vocab_size: int, what: str):
        llg = _llguidance()
        self.vocab_size = vocab_size
        self._tokenizer = grammar_tokenizer(tokenizer, vocab_size)
        self._grammar = lark_or_json
        error = llg.LLMatcher.validate_grammar(lark_or_json, self._tokenizer)
        if error and not error.startswith("WARNING"):
            raise InputError(f"{what} cannot be used: {error.splitlines()[0]}")
        self._check_productive(what)

    def _check_productive(self, what: str) -> None:
        """Refuse a grammar that matches nothing: a schema such as {"$ref": "#"} validates, but its
        matcher allows no first token but end of text (and then fails), which would end the
        answer at once with an empty "stop"."""
        m = self.matcher()
        bits = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)[None]
        allowed = unpack_bits(bits, self.vocab_size)[0]
        allowed[EOS_TOKEN_ID] = False
        if m.is_error() or not bool(allowed.any()):
            raise InputError(f"{what} cannot be used: it matches no value (a $ref that only refers to itself?)")

    def matcher(self):
        llg = _llguidance()
        m = llg.LLMatcher(self._tokenizer, self._grammar, log_level=0)
        if m.is_error():
            raise InputError(f"the grammar cannot be used: {m.get_error()}")
        return m

    def constraint(self) -> Constraint:
        return Constraint(self.matcher())


class Constraint:
    """One sequence's position in a grammar: the allowed next tokens, advanced token by token."""

    active = True  # False: the row is not constrained (now or ever again)

    def __init__(self, matcher):
        self._m = matcher

    @property
    def complete(self) -> bool:
        """The grammar has matched a whole answer (only end of text may follow)."""
        return not self._m.is_error() and (self._m.is_stopped() or self._m.is_accepting())

    def matchers(self, index: int) -> list:
        """(llguidance matcher, bitmask row) pairs the batched mask fill computes for this row."""
        return [(self._m, index)]

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask`, where it is not computed by `matchers` (nothing here)."""

    def raise_if_failed(self) -> None:
        """A matcher in error allows only end of text: that must end the answer with an error, not a "stop"."""
        if self._m is not None and self._m.is_error():
            raise RWKVEngineError(f"the grammar failed: {self._m.get_error().splitlines()[0]}")

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise RWKVEngineError(f"the grammar refused token {token}: {self._m.get_error()}")


class ToolCallTrigger(Constraint):
    """tool_choice "auto": free text, unless the reply starts with the marker (after `lead`
    bytes: spaces for the World format, spaces and newlines for G1's ```json blocks); from then
    on the call's grammar applies. `line_starts` (G1): the marker also counts at the start of
    any line of the reply (after its newline and `lead` bytes), so text may come before the call.

    While the reply (or its last line) so far is leading bytes plus a proper prefix of the
    marker, tokens that would complete the marker *and* go on past it are banned (the call's
    grammar must see the bytes after the marker as its own tokens), and so, with `line_starts`,
    are tokens that hold a whole marker after a newline of their own and go on past it; every
    other token is allowed. Without `line_starts`, once the reply leaves the marker the row is
    unconstrained.
    """

    def __init__(
        self, grammar: Grammar, tokenizer, marker: str = TOOL_CALL_MARKER, lead: bytes = b" ", line_starts: bool = False
    ):
        self._grammar = grammar
        self._marker = marker.encode()
        self._lead = lead
        self._line_starts = line_starts
        table = _overshooting_lines if line_starts else _overshooting
        self._banned = table(tokenizer, grammar.vocab_size, self._marker, lead)
        self._tokenizer = tokenizer
        self._reply = b""
        self._row = 0  # the row of `_banned` that applies now
        self._m = None
        self.active = True

    @property
    def calling(self) -> bool:
        return self._m is not None

    @property
    def complete(self) -> bool:
        return self._m is not None and super().complete

    def matchers(self, index: int) -> list:
        return [] if self._m is None else [(self._m, index)]

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        if self._m is None:
            bitmask[index] = self._banned[self._row]

    def accept(self, token: int) -> None:
        if self._m is not None:
            return super().accept(token)
        self._reply += self._tokenizer.decode_bytes([int(token)]) if token != EOS_TOKEN_ID else b""
        if self._line_starts:
            return self._accept_lines(token)
        head = self._reply.lstrip(self._lead)
        if head == self._marker:
            self._m = self._grammar.matcher()
        elif not self._marker.startswith(head) or token == EOS_TOKEN_ID:
            self.active = False
        else:
            self._row = len(head)

    def _accept_lines(self, token: int) -> None:
        """The marker's progress at the reply's last line start (it ends with a newline, so a
        whole marker is looked for before its own); row len(marker): the line is plain text."""
        marker, reply = self._marker, self._reply
        if token == EOS_TOKEN_ID:
            self.active = False
        elif reply.endswith(marker) and not reply[: -len(marker)].rsplit(b"\n", 1)[-1].strip(self._lead):
            self._m = self._grammar.matcher()
        else:
            head = reply.rsplit(b"\n", 1)[-1].lstrip(self._lead)
            self._row = len(head) if marker.startswith(head) else len(marker)


@functools.lru_cache(maxsize=8)
def _overshooting(tokenizer, vocab_size: int, marker: bytes, lead: bytes = b" ") -> torch.Tensor:
    """[len(marker), words] bitmasks: row k allows every token except those that, after k bytes
    of the marker (k = 0: after nothing but `lead` bytes), complete it and go on past it."""
    words = (vocab_size + 31) // 32
    allowed = torch.ones(len(marker), words * 32, dtype=torch.bool)
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        raw = tokenizer.decode_bytes([i])
        if not raw:
            continue
        head = raw.lstrip(lead)
        if head.startswith(marker) and len(head) > len(marker):
            allowed[0, i] = False
        for k in range(1, len(marker)):
            rest = marker[k:]
            if raw.startswith(rest) and len(raw) > len(rest):
                allowed[k, i] = False
    return pack_bits(allowed)


@functools.lru_cache(maxsize=8)
def _overshooting_lines(tokenizer, vocab_size: int, marker: bytes, lead: bytes) -> torch.Tensor:
    """[len(marker) + 1, words] bitmasks for `ToolCallTrigger(line_starts=True)`: rows 0..len-1
    as `_overshooting`'s (k bytes of the marker at a line start), less the tokens that hold a
    newline, `lead` bytes and the whole marker and go on past it; row len(marker) (within a line
    of text) bans only those."""
    inner = re.compile(b"\n[" + re.escape(lead) + b"]*" + re.escape(marker) + b".", re.S)
    rows = torch.ones(len(marker) + 1, ((vocab_size + 31) // 32) * 32, dtype=torch.bool)
    rows[:-1] = unpack_bits(_overshooting(tokenizer, vocab_size, marker, lead), rows.shape[1])
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        if inner.search(tokenizer.decode_bytes([i])):
            rows[:, i] = False
    return pack_bits(rows)


THOUGHT_END = b"</think>"


class ThoughtGate(Constraint):
    """A constraint that starts after the reply's thought: free while the model thinks, then the
    answer's constraint (`inner()`, made when the thought ends) from the first token after
    "</think>". `matched`: bytes of "</think>" the prompt already holds (7 when it ends with
    "</think": the thought is over, and the reply must begin with the ">" that closes it).

    As `ToolCallTrigger` does for its marker, tokens that would end the thought and go on past
    "</think>" are banned while it runs, so the answer's grammar sees the answer's bytes as its
    own tokens; every other token is allowed. After a prompt that closed the thought, only the
    tokens that finish "</think>" are.
    """

    def __init__(self, inner, tokenizer, vocab_size: int, matched: int = 0):
        self._make = inner
        self._inner: Constraint | None = None
        self._tokenizer = tokenizer
        self._k = matched
        table = _finishing if matched else _ending_inside
        self._banned = table(tokenizer, vocab_size, THOUGHT_END)

    @property
    def active(self) -> bool:
        return self._inner is None or self._inner.active

    @property
    def answering(self) -> bool:
        return self._inner is not None

    @property
    def complete(self) -> bool:
        return self._inner is not None and self._inner.complete

    def matchers(self, index: int) -> list:
        return [] if self._inner is None else self._inner.matchers(index)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        if self._inner is None:
            bitmask[index] = self._banned[self._k]
        else:
            self._inner.fill(bitmask, index)

    def raise_if_failed(self) -> None:
        if self._inner is not None:
            self._inner.raise_if_failed()

    def accept(self, token: int) -> None:
        if self._inner is not None:
            return self._inner.accept(token)
        if token == EOS_TOKEN_ID:
            return
        self._k = _advance(THOUGHT_END, self._k, self._tokenizer.decode_bytes([int(token)]))
        if self._k == len(THOUGHT_END):
            self._inner = self._make()


def _advance(marker: bytes, k: int, data: bytes) -> int:
    """Bytes of `marker` matched after reading `data` with `k` matched before (len(marker) once
    it is complete; the longest end of what was read that begins the marker otherwise)."""
    text = marker[:k] + data
    if marker in text:
        return len(marker)
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@functools.lru_cache(maxsize=4)
def _ending_inside(tokenizer, vocab_size: int, marker: bytes) -> torch.Tensor:
    """[len(marker), words] bitmasks: row k (bytes of the marker matched) bans the tokens with
    which the marker would end before the token does."""
    words = (vocab_size + 31) // 32
    allowed = torch.ones(len(marker), words * 32, dtype=torch.bool)
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        raw = tokenizer.decode_bytes([i])
        if marker[-1:] not in raw:  # (only a token holding the marker's last byte can end it)
            continue
        for k in range(len(marker)):
            text = marker[:k] + raw
            end = text.find(marker)
            if end >= 0 and end + len(marker) < len(text):
                allowed[k, i] = False
    return pack_bits(allowed)


@functools.lru_cache(maxsize=4)
def _finishing(tokenizer, vocab_size: int, marker: bytes) -> torch.Tensor:
    """[len(marker), words] bitmasks: row k allows only the tokens that go on with the marker
    after its first k bytes without passing its end."""
    words = (vocab_size + 31) // 32
    allowed = torch.zeros(len(marker), words * 32, dtype=torch.bool)
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        raw = tokenizer.decode_bytes([i])
        for k in range(1, len(marker)):
            if raw and marker[k:].startswith(raw):
                allowed[k, i] = True
    return pack_bits(allowed)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool [n, 32 * words] -> int32 bitmask [n, words] (bit j of word w = token 32 w + j)."""
    bits = allowed.reshape(allowed.shape[0], -1, 32).to(torch.int64) << torch.arange(32)
    packed = bits.sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpacked(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    as_bytes = bitmask.contiguous().numpy().view(np.uint8)  # little-endian: bit j of byte i = token 8 i + j
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size].view(bool)


def unpack_bits(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [n, words] -> bool [n, vocab_size]: True where the token is allowed."""
    return torch.from_numpy(_unpacked(bitmask, vocab_size))


def apply_masks(logits: torch.Tensor, rows: Sequence[tuple[int, Constraint]]) -> None:
    """Set to -inf, in place, the logits [B, V] of the tokens each constrained row may not take next.

    On the CPU the work is done by numpy: unpacking and filling a 65536-token row there costs
    a fraction of a millisecond, where torch's kernels for the same (big enough to go to its
    thread pool) took 5-30 ms a row on the busy 2-core machine this was measured on.
    """
    if not rows:
        return
    V = logits.shape[1]
    bitmask = torch.full((len(rows), (V + 31) // 32), -1, dtype=torch.int32)
    pairs = []
    for j, (_, c) in enumerate(rows):
        pairs += c.matchers(j)
        c.fill(bitmask, j)
    if pairs:  # what llguidance.torch.fill_next_token_bitmask_par does, without importing that module
        _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
    for _, c in rows:
        c.raise_if_failed()
    allowed = _unpacked(bitmask, V)
    cpu = logits.device.type == "cpu" and logits.is_contiguous() and logits.dtype == torch.float32
    values = logits.numpy() if cpu else None
    for j, (b, _) in enumerate(rows):
        if cpu:
            np.putmask(values[b], ~allowed[j], -np.inf)
            empty = values[b].max() == -np.inf
        else:
            row = logits[b]
            row.masked_fill_(~torch.from_numpy(allowed[j]).to(row.device), -math.inf)
            empty = bool(row.amax() == -math.inf)
        if empty:
            raise InputError(
                "the grammar allows no token that the sampling parameters allow "
                "(logit_bias or banned tokens forbid all of them)"
            )


# --- grammars -------------------------------------------------------------------------------------


def _schema(schema) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InputError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise InputError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return dict(schema)


@functools.lru_cache(maxsize=64)
def _cached_grammar(text: str, tokenizer, vocab_size: int, what: str) -> Grammar:
    return Grammar(text, tokenizer, vocab_size, what)


def _json_text(schema) -> str:
    schema = {"type": "object"} if schema is None else _schema(schema)
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise InputError(f"the JSON schema cannot be used: {e}") from None


def check_json_schema(schema) -> None:
    """Raise InputError if `schema` cannot be compiled (checked without a vocabulary: fast)."""
    error = _llguidance().LLMatcher.validate_grammar(_json_text(schema))
    if error and not error.startswith("WARNING"):
        raise InputError(f"the JSON schema cannot be used: {error.splitlines()[0]}")


def json_grammar(schema, tokenizer, vocab_size: int) -> Grammar:
    """The grammar of compact JSON that validates against `schema` (a dict or its JSON text);
    None for any JSON object (response_format json_object)."""
    return _cached_grammar(_json_text(schema), tokenizer, vocab_size, "the JSON schema")


def call_schema(tools: Sequence[Mapping]) -> dict:
    """JSON schema of one call {"name": ..., "arguments": {...}} to one of `tools` (OpenAI
    function definitions: {"name", "description", "parameters"})."""
    options = []
    for f in tools:
        params = f.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_grammar(tools: Sequence[Mapping], tokenizer, vocab_size: int, forced: bool) -> Grammar:
    """The grammar of a tool call to one of `tools`: after the marker (`forced=False`, for
    `ToolCallTrigger`), or of a whole reply " <tool_call>{...}" (`forced=True`)."""
    schema = dict(call_schema(tools), **{"x-guidance": JSON_OPTIONS})
    if forced:
        text = _llguidance().LLMatcher.grammar_from_lark(
            f'start: " " {json.dumps(TOOL_CALL_MARKER)} %json {json.dumps(schema)}'
        )
    else:
        text = _llguidance().LLMatcher.grammar_from_json_schema(schema)
    return _cached_grammar(text, tokenizer, vocab_size, "the tools' parameter schemas")


# The G1 format (rwkv_engine/templates/g1.jinja): each call a ```json block of
# {"name": ..., "arguments": ...} written as the template writes a call back into the history
# (", " and ": " between items), blocks joined by "\n ".
G1_FENCE, G1_CLOSE, G1_NEXT = "```json\n", "\n```", "\n "
G1_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def g1_call_grammar(tools: Sequence[Mapping], tokenizer, vocab_size: int, forced: bool, parallel: bool) -> Grammar:
    """The grammar of G1 tool calls to `tools`: of a whole answer (`forced`: up to two spaces or
    newlines, then the blocks), or of what follows the first block's opening fence (`forced=False`,
    for `ToolCallTrigger` with the fence as its marker). `parallel`: any number of blocks, else one."""
    schema = dict(call_schema(tools), **{"x-guidance": G1_JSON})
    call = f"%json {json.dumps(schema)}"
    head = f"/[ \\n]{{0,2}}/ {json.dumps(G1_FENCE)} " if forced else ""
    more = f" ({json.dumps(G1_NEXT + G1_FENCE)} {call} {json.dumps(G1_CLOSE)})*" if parallel else ""
    text = _llguidance().LLMatcher.grammar_from_lark(f"start: {head}{call} {json.dumps(G1_CLOSE)}{more}")
    return _cached_grammar(text, tokenizer, vocab_size, "the tools' parameter schemas")


def grammar_for(params, tokenizer, vocab_size: int) -> Grammar | None:
    """The grammar `params` (a SamplingParams) asks for with json_schema / json_object, or None."""
    if params.json_schema is None and not params.json_object:
        return None
    check_stop_tokens(params)
    return json_grammar(params.json_schema, tokenizer, vocab_size)


def constraint_for(params, tokenizer, vocab_size: int) -> Constraint | None:
    """A fresh `Constraint` for one sequence generated with `params`, or None if unconstrained."""
    grammar = grammar_for(params, tokenizer, vocab_size)
    return None if grammar is None else grammar.constraint()


def check_stop_tokens(params) -> None:
    if EOS_TOKEN_ID not in params.stop_token_ids:
        raise InputError("constrained output ends with the end-of-text token: keep 0 in stop_token_ids")


CALL_HEAD = re.compile(r'\{"name":"((?:[^"\\]|\\.)*)","arguments":')  # how the grammar writes a call's start


def load_call(body: str) -> dict | None:
    """The JSON object `body` if it is a tool call (a string "name" and an "arguments"), else None:
    the check every tool-call format's reader shares."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    return call


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as the JSON text the model wrote) of a reply that is a whole tool call, else None."""
    head = text.lstrip(" ")
    if not head.startswith(TOOL_CALL_MARKER):
        return None
    body = head[len(TOOL_CALL_MARKER) :]
    call = load_call(body)
    if call is None:
        return None
    m = CALL_HEAD.match(body)
    if m and body.endswith("}"):
        return call["name"], body[m.end() : -1]
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False, separators=(",", ":"))
