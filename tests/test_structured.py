"""Structured output: JSON constrained by a schema, checked with `jsonschema`.

A random tiny World model (vocab 65536, the real World tokenizer) samples junk at temperature 1
with no nucleus cut, which is what makes this a real test of the constraint: whatever it draws,
every answer that finishes must parse and validate; one cut by max_tokens says "length".
Many seeds run as one batch in the serving engine, constrained and free rows sharing each
decode step, and a row's answer must equal the same request run alone by `generate`.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import rwkv_engine
from rwkv_engine import SamplingParams
from rwkv_engine.errors import InputError
from rwkv_engine.serve.engine import EngineConfig, Finished, Request
from rwkv_engine.structured import TOOL_CALL_MARKER, ToolCallTrigger, call_grammar, pack_bits, parse_call, unpack_bits
from rwkv_engine.testing import random_state_dict, save_pth

from .conftest import run_engine

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": -10, "maximum": 10}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
TAGS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"tag": {"enum": ["a", "b", "c"]}, "weight": {"type": "number"}},
        "required": ["tag"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 4,
}
SEEDS = range(12)
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_pth(
        random_state_dict(version="5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=3),
        tmp_path_factory.mktemp("structured") / "tiny.pth",
    )
    model = rwkv_engine.load(path)
    return model, rwkv_engine.load_tokenizer(model)


def run_batch(tiny, requests: list[tuple[str, SamplingParams]]) -> list[tuple[str, Finished]]:
    """Every request through one Engine at once (one batch); (text, Finished) per request."""
    model, tok = tiny
    config = EngineConfig(max_batch=len(requests), state_cache_bytes=0)
    return run_engine(model, tok, [Request(tok.encode(prompt), params) for prompt, params in requests], config)[0]


def wild(seed: int, **kw) -> SamplingParams:
    """Temperature 1, no top-p / top-k cut: the random model's junk, all of it."""
    return SamplingParams(
        temperature=1.0, top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=seed, max_tokens=MAX_TOKENS, **kw
    )


def test_every_finished_answer_validates(tiny):
    requests = [("Person:", wild(s, json_schema=PERSON)) for s in SEEDS]
    requests += [("Tags:", wild(s, json_schema=json.dumps(TAGS))) for s in SEEDS]
    requests += [("Any:", wild(s, json_object=True)) for s in SEEDS[:6]]
    requests += [("Free text:", wild(s)) for s in SEEDS[:2]]  # unconstrained rows in the same steps
    results = run_batch(tiny, requests)
    finished = 0
    for (_prompt, params), (text, event) in zip(requests, results):
        assert event.reason in ("stop", "length"), event
        if params.json_schema is None and not params.json_object:
            continue
        if event.reason == "length":  # cut short: the partial text as it is, all of max_tokens
            assert event.completion_tokens == MAX_TOKENS
            continue
        finished += 1
        value = json.loads(text)
        if params.json_object:
            assert isinstance(value, dict)
        else:
            schema = params.json_schema if isinstance(params.json_schema, dict) else json.loads(params.json_schema)
            jsonschema.validate(value, schema)
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not re.search(r"\s", outside_strings), f"not compact JSON: {text!r}"
    assert finished >= len(requests) // 2, f"only {finished} answers finished: the test would check little"

    # Batched = alone: a constrained row and a free row give what `generate` gives them alone.
    model, tok = tiny
    for i in (0, len(requests) - 1):
        prompt, params = requests[i]
        gen = rwkv_engine.generate(model, tok, prompt, params)
        assert gen.read() == results[i][0]
        assert gen.finish_reason == results[i][1].reason


def test_length_finish_returns_the_partial_text(tiny):
    model, tok = tiny
    gen = rwkv_engine.generate(model, tok, "Person:", wild(1, json_schema=PERSON).replace(max_tokens=5))
    text = gen.read()
    assert gen.finish_reason == "length" and len(gen.tokens) == 5
    assert text == tok.decode(gen.tokens) and text.startswith('{"name":"')


def test_complete_grammar_allows_only_end_of_text(tiny):
    """Once the JSON is whole, the mask leaves end-of-text alone, whatever the logits prefer."""
    model, tok = tiny
    bias = {0: -100.0}  # the model hates ending; the grammar ends it anyway
    params = SamplingParams(temperature=0.0, json_schema={"enum": ["yes", "no"]}, logit_bias=bias, max_tokens=20)
    gen = rwkv_engine.generate(model, tok, "Answer:", params)
    assert gen.read() in ('"yes"', '"no"') and gen.finish_reason == "stop"


def test_bad_requests(tiny):
    model, tok = tiny
    with pytest.raises(InputError, match="exclusive"):
        SamplingParams(json_schema={"type": "object"}, json_object=True)
    with pytest.raises(InputError, match="json_schema must be"):
        SamplingParams(json_schema=5)
    with pytest.raises(InputError, match="JSON schema cannot be used"):
        rwkv_engine.generate(model, tok, "x", SamplingParams(json_schema={"type": 5}))
    with pytest.raises(InputError, match="not valid JSON"):
        rwkv_engine.generate(model, tok, "x", SamplingParams(json_schema="{nope"))
    with pytest.raises(InputError, match="stop_token_ids"):
        rwkv_engine.generate(model, tok, "x", SamplingParams(json_object=True, stop_token_ids=()))


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    ],
)
def test_schema_that_matches_nothing_is_refused(tiny, schema):
    """Issue 28 R4: a schema that validates but matches no value was answered with "" and
    finish_reason "stop"; it is refused as unusable instead."""
    model, tok = tiny
    with pytest.raises(InputError, match="JSON schema cannot be used: it matches no value"):
        rwkv_engine.generate(model, tok, "x", SamplingParams(json_schema=schema, max_tokens=5))


def test_a_failed_matcher_is_an_error_not_a_stop():
    """R4, second half: a matcher that fails mid-answer makes the mask step raise, never a silent stop."""
    from rwkv_engine.errors import RWKVEngineError
    from rwkv_engine.structured import Constraint, apply_masks

    class Failed:
        def is_error(self):
            return True

        def get_error(self):
            return "parser died"

    c = Constraint(Failed())
    c.matchers = lambda index: []
    assert not c.complete
    with pytest.raises(RWKVEngineError, match="grammar failed: parser died"):
        apply_masks(torch.zeros(1, 64), [(0, c)])


def test_bitmask_packing_matches_llguidance_layout():
    allowed = torch.rand(3, 65536) < 0.5
    assert torch.equal(unpack_bits(pack_bits(allowed), 65536), allowed)
    one = torch.zeros(1, 64, dtype=torch.bool)
    one[0, 33] = True  # token 33: bit 1 of word 1
    assert pack_bits(one).tolist() == [[0, 2]]


def test_tool_call_trigger(tiny):
    """tool_choice auto: text stays free; a reply that starts with the marker becomes a call."""
    model, tok = tiny
    tools = [
        {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        }
    ]
    grammar = call_grammar(tools, tok, 65536, forced=False)

    free = ToolCallTrigger(grammar, tok)
    for t in tok.encode(" Hello"):
        free.accept(t)
    assert not free.active

    calling = ToolCallTrigger(grammar, tok)
    for t in tok.encode(" " + TOOL_CALL_MARKER):
        assert calling.active
        calling.accept(t)
    assert calling.calling and not calling.complete
    body = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
    for t in tok.encode(body):
        calling.accept(t)
    assert calling.complete
    assert parse_call(" " + TOOL_CALL_MARKER + body) == ("get_weather", '{"city":"Oslo"}')


def test_call_stream_pieces():
    """A streamed reply under tools: held while it may be a call; a call as name then arguments."""
    from rwkv_engine.tool_calls import CallStream

    def run(chunks):
        s = CallStream()
        out = [piece for ch in chunks for piece in s.push(ch)]
        return out + s.finish()

    call = ["<", "tool", "_call", '>{"', 'name":"f","', "argu", 'ments":{"a":', '1,"b":"x"}', "}"]
    out = run(call)
    assert out[0] == ("call", "f")
    assert "".join(v for k, v in out[1:] if k == "arguments") == '{"a":1,"b":"x"}'
    assert parse_call("".join(call)) == ("f", '{"a":1,"b":"x"}')
    assert run([" Hel", "lo"]) == [("content", " Hel"), ("content", "lo")]
    assert run(["<", "b>", " bold"]) == [("content", "<b>"), ("content", " bold")]
    assert run(["<tool"]) == [("content", "<tool")]  # ended before it was a call


def test_generate_command_json_schema(tiny, tmp_path, capsys):
    """`rwkv-engine generate --json-schema FILE` prints what `generate` gives with that schema."""
    from rwkv_engine.cli import main

    model, tok = tiny
    path = tmp_path / "tiny.pth"
    from rwkv_engine.testing import random_state_dict, save_pth

    save_pth(random_state_dict(version="5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=3), path)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(PERSON))
    flags = [
        "--temperature",
        "1",
        "--top-p",
        "1",
        "--presence-penalty",
        "0",
        "--frequency-penalty",
        "0",
        "--seed",
        "4",
        "--max-tokens",
        str(MAX_TOKENS),
    ]
    assert main(["generate", str(path), "--prompt", "Person:", "--json-schema", str(schema), "--stats", *flags]) == 0
    out, err = capsys.readouterr()
    want = rwkv_engine.generate(
        model,
        tok,
        "Person:",
        wild(4, json_schema=PERSON).replace(penalty_decay=0.996, presence_penalty=0.0, frequency_penalty=0.0),
    )
    assert out == want.read() and f"finish: {want.finish_reason}" in err
    if want.finish_reason == "stop":
        jsonschema.validate(json.loads(out), PERSON)

    (tmp_path / "bad.json").write_text('{"type": 5}')
    assert main(["generate", str(path), "--prompt", "x", "--json-schema", str(tmp_path / "bad.json")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "JSON schema cannot be used" in err[0]
    assert main(["generate", str(path), "--prompt", "x", "--json-schema", str(tmp_path / "none.json")]) != 0
    assert "none.json" in capsys.readouterr().err
