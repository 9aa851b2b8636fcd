"""response_format and tool calls on a live `rwkv-engine serve`, with the `openai` client and LangChain.

The server is test_serve's (a tiny random World model in a subprocess). A random model writes
junk, so every JSON answer that finishes must validate because of the grammar alone.
"""

from __future__ import annotations

import json

import pytest

from tests.test_serve import MODEL, Server, client, files, ref, server  # noqa: F401  (fixtures)

jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

WILD = dict(temperature=1.0, top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0)
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["answer", "confidence", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_json_schema_answers_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    finished = 0
    for seed in range(6):
        got = client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, seed=seed, max_tokens=60, **WILD
        )
        choice = got.choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
        finished += 1
    assert finished >= 3

    # Streamed: the same JSON in pieces.
    want = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, seed=1, max_tokens=60, **WILD)
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=fmt, seed=1, max_tokens=60, stream=True, **WILD
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == want.choices[0].finish_reason


def test_json_object(client):
    for seed in range(3):
        got = client.chat.completions.create(
            model=MODEL, messages=ASK, response_format={"type": "json_object"}, seed=seed, max_tokens=40, **WILD
        )
        if got.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(got.choices[0].message.content), dict)


def prompt_tokens(ref, text: str) -> int:
    return len(ref[1].encode(text))


def test_tool_call_round_trip(ref, client):
    got = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=2, max_tokens=80, **WILD
    )
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["parameters"])

    # The tools are written into the system turn, as tool_calls.py documents.
    listed = "\n".join(
        ["You can call these tools:"]
        + [
            json.dumps(
                {k: t["function"][k] for k in ("name", "description", "parameters") if k in t["function"]},
                separators=(",", ":"),
            )
            for t in TOOLS
        ]
        + ['To call a tool, reply with <tool_call>{"name":"NAME","arguments":{...}} and nothing else.']
    )
    assert got.usage.prompt_tokens == prompt_tokens(
        ref, f"System: {listed}\n\nUser: What is the weather in Oslo?\n\nAssistant:"
    )

    # Back with the call and its result: rendered as the model's own call and a Tool turn.
    history = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "4 C, snow"},
    ]
    again = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", seed=3, max_tokens=10
    )
    assert again.choices[0].message.content is not None and not again.choices[0].message.tool_calls
    # written back as the template writes it: compact, non-ASCII characters as they are
    arguments = json.dumps(json.loads(call.function.arguments), separators=(",", ":"), ensure_ascii=False)
    written = (
        f"User: What is the weather in Oslo?\n\nAssistant: <tool_call>"
        f'{{"name":"{call.function.name}","arguments":{arguments}}}\n\n'
        f"Tool: {call.function.name}: 4 C, snow\n\nAssistant:"
    )
    assert again.usage.prompt_tokens == prompt_tokens(ref, written)


def test_named_tool_choice_and_stream(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(2):
        got = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=60, **WILD
        )
        if got.choices[0].finish_reason == "tool_calls":
            assert got.choices[0].message.tool_calls[0].function.name == "get_time"
    want = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=2, max_tokens=80, **WILD
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=2, max_tokens=80, stream=True, **WILD
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [tc for d in deltas for tc in (d.tool_calls or [])]
    first, rest = pieces[0], pieces[1:]
    assert first.index == 0 and first.id and first.type == "function" and first.function.arguments == ""
    assert first.function.name == want.choices[0].message.tool_calls[0].function.name
    assert len(rest) > 1 and all(r.index == 0 and r.id is None and r.function.name is None for r in rest)
    assert "".join(r.function.arguments for r in rest) == want.choices[0].message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(d.content or "" for d in deltas)


def test_auto_tool_choice_lets_text_through(client):
    got = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=5, max_tokens=12, **WILD)
    assert got.choices[0].finish_reason in ("stop", "length") and got.choices[0].message.content


def test_bad_structured_requests(server):
    def post(**body):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=60)
        return r.status_code, r.json()["error"]

    status, err = post(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})
    assert status == 400 and err["param"] == "response_format" and "schema" in err["message"]
    status, err = post(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert status == 400 and "nope" in err["message"]
    status, err = post(tool_choice="required")
    assert status == 400 and "tools" in err["message"]
    status, err = post(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert status == 400 and err["param"] == "response_format"
    status, err = post(response_format={"type": "json_schema"})
    assert status == 400 and "json_schema" in err["message"]


def test_langchain_bind_tools_and_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel, Field

    llm = lc.ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        temperature=1.0,
        top_p=1.0,
        seed=4,
        max_tokens=80,
    )

    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city."""
        return "4 C"

    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    ai = bound.invoke([HumanMessage("Weather in Oslo?")])
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    follow = llm.bind_tools([WEATHER], tool_choice="none").invoke(
        [HumanMessage("Weather in Oslo?"), ai, ToolMessage("4 C", tool_call_id=call["id"])]
    )
    assert isinstance(follow.content, str) and not follow.tool_calls

    class Verdict(BaseModel):
        answer: str = Field(json_schema_extra={"enum": ["yes", "no"]})
        score: int = Field(ge=0, le=9)

    structured = llm.with_structured_output(Verdict, method="json_schema", strict=True)
    verdict = structured.invoke("Is it cold?")
    assert isinstance(verdict, Verdict) and verdict.answer in ("yes", "no") and 0 <= verdict.score <= 9


def test_n_choices_each_constrained(client):
    """n = 3 from one prefill: every choice has its own grammar state."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    got = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=fmt, n=3, seed=7, max_tokens=60, **WILD
    )
    assert len(got.choices) == 3
    for c in got.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), ANSWER)
    calls = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", n=2, seed=7, max_tokens=80, **WILD
    )
    for c in calls.choices:
        if c.finish_reason == "tool_calls":
            assert c.message.tool_calls[0].function.name in ("get_weather", "get_time")
    assert any(c.finish_reason == "tool_calls" for c in calls.choices)
