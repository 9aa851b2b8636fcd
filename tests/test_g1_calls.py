"""G1 tool calls (```json blocks): the streamed reader against the whole-answer parser, over every
chunking of adversarial answers, and the grammar against what the `g1` template writes back."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from rwkv_engine.tool_calls import G1CallStream, parse_g1, read_g1


def chunkings(text: str, cuts: int):
    """Every way to cut `text` into at most cuts + 1 pieces, and into single characters."""
    positions = range(1, len(text))
    sets = itertools.chain((c for r in range(cuts + 1) for c in itertools.combinations(positions, r)), [positions])
    for c in sets:
        bounds = [0, *c, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def streamed(pieces):
    s = G1CallStream()
    parts = [part for piece in pieces for part in s.push(piece)] + s.finish()
    content = "".join(v for k, v in parts if k == "content")
    calls = []
    for kind, value in parts:
        if kind == "call":
            calls.append([value, ""])
        elif kind == "arguments":
            calls[-1][1] += value
    assert all(v for _, v in parts)
    return content, [tuple(c) for c in calls]


ONE = ' ```json\n{"name": "get_weather", "arguments": {"city": "Oslo", "n": {"a": [1, "}"]}}}\n```'
TWO = '\n```json\n{"name": "a", "arguments": {}}\n```\n ```json\n{"name": "b\\"c", "arguments": {"x": "\\n```"}}\n```'
ANSWERS = {
    # answer: (content, calls) as a client must receive them
    ONE: ("", [("get_weather", '{"city": "Oslo", "n": {"a": [1, "}"]}}')]),
    TWO: ("", [("a", "{}"), ('b"c', '{"x": "\\n```"}')]),
    '```json\n{"name":"f","arguments":{"k":1} }\n```': ("", [("f", '{"k":1}')]),
    " ```json\n": (" ```json\n", []),  # a fence that never got a call: text
    " ```json": (" ```json", []),  # (the fence ends with its newline)
    " ``` code": (" ``` code", []),
    "```js\nx": ("```js\nx", []),
    "Sure.\n```json\n{}": ("Sure.\n```json\n{}", []),
    " ": (" ", []),
    # text, then calls at a line start (as the g1 template writes a message with both)
    'Both.\n ```json\n{"name": "a", "arguments": {"k": "x\\ny"}}\n```': ("Both.", [("a", '{"k": "x\\ny"}')]),
    "See:\n\n```json\n" + ONE[9:]: ("See:", [("get_weather", '{"city": "Oslo", "n": {"a": [1, "}"]}}')]),
    "a ```json\n{}\n```\n`": ("a ```json\n{}\n```\n`", []),  # (not at a line start)
    "x\n``` y\n```j": ("x\n``` y\n```j", []),
}


@pytest.mark.parametrize("answer", list(ANSWERS))
def test_every_chunking(answer):
    content, calls = ANSWERS[answer]
    whole = read_g1(answer)
    assert (whole or ("", []))[1] == calls
    assert whole is None or whole[0] == content
    for _, arguments in calls:
        json.loads(arguments)
    cuts = len(answer) if len(answer) <= 12 else 2
    for pieces in chunkings(answer, cuts):
        assert streamed(pieces) == (content, calls), pieces


def test_cut_call_streams_what_was_written():
    s = G1CallStream()
    out = s.push(' ```json\n{"name": "f", "arguments": {"a": "b') + s.finish()
    assert out == [("call", "f"), ("arguments", '{"a": "b')]
    assert parse_g1(' ```json\n{"name": "f", "arguments": {"a": "b') is None


def test_not_calls():
    for answer in ("", "hello", '```json\n{"name": 1, "arguments": {}}\n```', '```json\n{"arguments": {}}\n```'):
        assert parse_g1(answer) is None
    assert parse_g1('```json\n{"name": "f", "arguments": 1}\n```trailing') is None


# --- the grammar, after the thought, on a random model ---------------------------------------------------

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import rwkv_engine
    from rwkv_engine.testing import random_state_dict, save_pth

    path = save_pth(
        random_state_dict(version="5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=5),
        tmp_path_factory.mktemp("g1calls") / "tiny.pth",
    )
    model = rwkv_engine.load(path)
    return model, rwkv_engine.load_tokenizer(model)


def test_calls_constrained_after_the_thought(tiny):
    """Random weights at temperature 1: the thought is free, the answer after it is G1 calls that
    validate against the tool's schema, written as the g1 template writes calls back."""
    jsonschema = pytest.importorskip("jsonschema")
    from rwkv_engine import SamplingParams
    from rwkv_engine.reasoning import reply_start, split
    from rwkv_engine.serve.engine import EngineConfig, Request
    from rwkv_engine.structured import ThoughtGate
    from rwkv_engine.templates import builtin
    from rwkv_engine.tool_calls import tool_constraints

    from .conftest import run_engine

    model, tok = tiny
    calls = tool_constraints([WEATHER], "required", tok, 65536, fmt="g1", parallel=True)
    ends = dict.fromkeys(tok.encode("</think>"), 30.0)  # (so that a random model ends its thought)
    requests, starts = [], []
    for thinking in (False, True):
        prompt = builtin("g1").render([{"role": "user", "content": "Weather?"}], thinking=thinking)
        start = reply_start(prompt, True)
        matched = 7 if start == "answer>" else 0
        for seed in range(12):
            params = SamplingParams(
                temperature=1.0,
                top_p=1.0,
                presence_penalty=0,
                frequency_penalty=0,
                seed=seed,
                max_tokens=300,  # (a random model writes "</think>" a third of a token at a time)
                stop=("\n\n",),
                logit_bias=ends if thinking else {},
            )
            make = lambda matched=matched: ThoughtGate(calls, tok, 65536, matched)  # noqa: E731
            requests.append(Request(tok.encode(prompt), params, constraint=make))
            starts.append(start)
    results, _ = run_engine(model, tok, requests, EngineConfig(max_batch=24))
    answered = 0
    for (text, finished), start in zip(results, starts):
        reasoning, answer = split(text, start)
        assert (reasoning is not None) == (start == "thought>")
        if start == "answer>":
            assert text.startswith(">")
        if finished.reason != "stop":
            continue
        parsed = parse_g1(answer)
        assert parsed, text
        for name, arguments in parsed:
            assert name == "get_weather"
            value = json.loads(arguments)
            jsonschema.validate(value, WEATHER["parameters"])
            assert arguments == json.dumps(value)  # the spacing the template writes back
        answered += start == "thought>"
    assert answered >= 2, [(f.reason, len(t)) for (t, f), s in zip(results, starts) if s == "thought>"]


LINE_MARKER = re.compile(rb"(?:\A|\n)[ \n]*```json\n\Z")


def test_auto_trigger_at_line_starts(tiny):
    """tool_choice auto, G1: the call's fence counts at any line start, so text may come first.
    The mask after each reply is checked against a regex oracle over every token (banned = it
    completes a line-start fence and goes on past it), and a call written after text is handed
    to the call's grammar, which accepts it as the template writes it back."""
    from rwkv_engine.structured import unpack_bits
    from rwkv_engine.tool_calls import tool_constraints

    model, tok = tiny
    make = tool_constraints([WEATHER], "auto", tok, 65536, fmt="g1")
    newline = [i for i in range(65536) if b"\n" in tok.decode_bytes([i])]
    bans = 0
    for reply in ("", " ", "Sure", "Sure.\n", "Sure.\n ``", "Sure.\n```json", "a ``", "x\n\n `"):
        trigger = make()
        for t in tok.encode(reply):
            trigger.accept(t)
        assert not trigger.calling and trigger.active
        mask = torch.zeros(1, (65536 + 31) // 32, dtype=torch.int32)
        trigger.fill(mask, 0)
        allowed = unpack_bits(mask, 65536)[0]
        banned = set(range(65536)) - set(allowed.nonzero().flatten().tolist())
        want = set()
        for i in newline:
            total = reply.encode() + tok.decode_bytes([i])
            if any(LINE_MARKER.search(total[:e]) for e in range(len(reply.encode()) + 1, len(total))):
                want.add(i)
        assert banned == want, reply
        bans += len(want)
    assert bans  # (some token overshoots a fence, after some reply)
    trigger = make()
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n```'
    for t in tok.encode("Here it is:\n ```json\n"):
        assert trigger.active and not trigger.calling
        trigger.accept(t)
    assert trigger.calling
    for t in tok.encode(call):
        trigger.accept(t)
    assert trigger.complete
    assert read_g1("Here it is:\n ```json\n" + call) == (
        "Here it is:",
        [("get_weather", '{"city": "Oslo", "days": 2}')],
    )
