"""Chat templates (rwkv_engine/templates) against independent renderings.

* `world`: byte for byte the World format as rwkv-engine rendered it before templates existed,
  written out here in Python (the reference below is that code, kept as the oracle).
* `g1`: the G1 reference template that ships in the rwkv-tl 0.2.1 wheel, read from the installed
  package (never copied here), rendered two ways: by jinja2 as rwkv-tl itself renders it, and by
  transformers' `apply_chat_template`. All three give identical strings over the conversations
  below. One known difference: plain jinja2's `tojson` sorts keys and writes non-ASCII and
  <>&' as escapes, transformers' (and ours) keeps both as given; the conversations whose tools
  differ only there (`TRANSFORMERS_ONLY`) are compared with transformers.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from rwkv_engine.errors import InputError
from rwkv_engine.templates import builtin, is_g1, resolve

# --- the reference G1 template ---------------------------------------------------------------------


def rwkv_tl_template() -> str:
    spec = importlib.util.find_spec("rwkv_tl")  # (not imported: its package needs tilelang and a GPU)
    if spec is None:
        pytest.skip("rwkv-tl is not installed (pip install --no-deps rwkv-tl==0.2.1)")
    path = Path(spec.submodule_search_locations[0]) / "asset" / "rwkv_chat_template_v20260805.jinja"
    return path.read_text(encoding="utf-8")


def render_rwkv_tl(messages, tools=None, thinking=False, add_generation_prompt=True) -> str:
    """As rwkv_tl.text_model.RWKV7TextModel.chat renders it: jinja2's plain Environment."""
    jinja2 = pytest.importorskip("jinja2")
    return (
        jinja2.Environment()
        .from_string(rwkv_tl_template())
        .render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            bos_token="",
            tools=tools if tools is not None else [],
        )
    )


def render_transformers(messages, tools=None, thinking=False, add_generation_prompt=True) -> str:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=rwkv_tl_template())
    return tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, thinking=thinking
    )


# Sorted keys and ASCII in everything that goes through tojson (see the module docstring).
CALC = {
    "function": {
        "description": "Evaluate an arithmetic expression",
        "name": "calculator",
        "parameters": {"properties": {"expression": {"type": "string"}}, "required": ["expression"], "type": "object"},
    },
    "type": "function",
}
WEATHER = {
    "function": {
        "description": "Current weather",
        "name": "get_weather",
        "parameters": {"properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "type": "object"},
    },
    "type": "function",
}


def call(name, arguments, id="call-1"):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "one message": dict(messages=[{"role": "user", "content": "Hello!"}]),
    "system and turns": dict(
        messages=[
            {"role": "system", "content": "  You are terse.  "},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?\nShow the sum."},
        ]
    ),
    "non-ASCII": dict(
        messages=[
            {"role": "system", "content": "Réponds en français. 你好"},
            {"role": "user", "content": "Ça va ? 🙂 — naïve café"},
            {"role": "assistant", "content": "Très bien, merci ! 谢谢"},
            {"role": "user", "content": "Ü ß ø"},
        ]
    ),
    "empty content": dict(
        messages=[
            {"role": "user", "content": ""},
            {"role": "assistant", "content": ""},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "   "},
        ]
    ),
    "tools listed, no system": dict(messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER]),
    "tools with system, object arguments, result": dict(
        messages=[
            {"role": "system", "content": "Use tools when needed."},
            {"role": "user", "content": "What is 17*23?"},
            {"role": "assistant", "content": "", "tool_calls": [call("calculator", {"expression": "17*23"})]},
            {"role": "tool", "tool_call_id": "call-1", "content": "391"},
        ],
        tools=[CALC, WEATHER],
    ),
    "string arguments, text before the calls, parallel calls": dict(
        messages=[
            {"role": "user", "content": "Weather in Oslo and Lima?"},
            {
                "role": "assistant",
                "content": "Checking both.",
                "tool_calls": [
                    call("get_weather", '{"city": "Oslo"}', "a"),
                    call("get_weather", '{"city":"Lima","unit":"C"}', "b"),
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "4 C, snow"},
            {"role": "tool", "tool_call_id": "b", "content": "  19 C  "},
            {"role": "assistant", "content": "Oslo 4 C, Lima 19 C."},
            {"role": "user", "content": "Thanks"},
        ],
        tools=[WEATHER],
    ),
    "empty arguments, flat call": dict(
        messages=[
            {"role": "user", "content": "Ping"},
            {"role": "assistant", "tool_calls": [{"name": "calculator", "arguments": ""}]},
        ],
        tools=[CALC],
    ),
    "two system messages (the last wins)": dict(
        messages=[
            {"role": "system", "content": "first"},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "second"},
            {"role": "user", "content": "again"},
        ]
    ),
}
TRANSFORMERS_ONLY = {
    "unsorted, non-ASCII tools": dict(
        messages=[
            {"role": "user", "content": "Météo à Zürich ?"},
            {"role": "assistant", "content": None, "tool_calls": [call("météo", {"ville": "Zürich", "<b>": "&"})]},
        ],
        tools=[{"type": "function", "function": {"name": "météo", "description": "Le temps <à> l'instant"}}],
    ),
}


def cases(conversations):
    return [
        pytest.param(dict(conv, thinking=thinking, add_generation_prompt=gen), id=f"{name}-think={thinking}-gen={gen}")
        for name, conv in conversations.items()
        for thinking in (False, True)
        for gen in (True, False)
    ]


@pytest.mark.parametrize("case", cases(CONVERSATIONS))
def test_g1_is_rwkv_tl(case):
    ours = builtin("g1").render(
        case["messages"],
        case.get("tools"),
        add_generation_prompt=case["add_generation_prompt"],
        thinking=case["thinking"],
    )
    assert ours == render_rwkv_tl(**case)
    assert ours == render_transformers(**case)


@pytest.mark.parametrize("case", cases(TRANSFORMERS_ONLY))
def test_g1_is_rwkv_tl_under_transformers(case):
    ours = builtin("g1").render(
        case["messages"],
        case.get("tools"),
        add_generation_prompt=case["add_generation_prompt"],
        thinking=case["thinking"],
    )
    assert ours == render_transformers(**case)
    assert ours != render_rwkv_tl(**case)  # (the tojson difference the module docstring names)


def test_g1_thinking_controls():
    """enable_thinking (vLLM / transformers) and reasoning_effort (OpenAI) on top of rwkv-tl's
    `thinking`; the effort hints are the G1 model cards' " think a bit" / " think a lot"."""
    g1 = builtin("g1")
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    off = "User: Why is the sky blue?\n\nAssistant: <think></think"
    on = "User: Why is the sky blue?\n\nAssistant: <think"
    assert g1.render(ask) == off == render_rwkv_tl(ask)
    assert g1.render(ask, thinking=True) == on == render_rwkv_tl(ask, thinking=True)
    assert g1.render(ask, enable_thinking=True) == on
    assert g1.render(ask, thinking=True, enable_thinking=False) == off
    assert g1.render(ask, reasoning_effort="none", thinking=True) == off
    assert g1.render(ask, reasoning_effort="medium") == on
    assert g1.render(ask, reasoning_effort="low") == "User: Why is the sky blue? think a bit\n\nAssistant: <think"
    assert g1.render(ask, reasoning_effort="high") == "User: Why is the sky blue? think a lot\n\nAssistant: <think"
    # Reasoning of earlier replies is not written back; "developer" counts as a system message.
    history = [
        {"role": "developer", "content": "Be kind."},
        *ask,
        {"role": "assistant", "content": "Rayleigh scattering.", "reasoning_content": "Short waves scatter more."},
        {"role": "user", "content": "Thanks"},
    ]
    text = g1.render(history, thinking=True)
    assert "Short waves" not in text and text.startswith("System: Be kind.\n\n")
    assert "Assistant: Rayleigh scattering.\n\nUser: Thanks\n\nAssistant: <think" in text


# --- world: today's rendering, byte for byte -----------------------------------------------------------


def world_reference(messages, tools=None) -> str:
    """The World rendering as chat_format.render_chat and serving_chat.chat_messages wrote it."""

    def normal(text):
        text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
        return re.sub(r"\n{2,}", "\n", text)

    def compact(value):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    roles = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
    names, out = {}, []
    for m in messages:
        text = m.get("content") or ""
        if m.get("tool_calls"):
            names.update((c["id"], c["function"]["name"]) for c in m["tool_calls"])
            written = "\n".join(
                "<tool_call>" + compact({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                for c in m["tool_calls"]
            )
            text = f"{text}\n{written}" if text.strip() else written
        elif m["role"] == "tool" and m.get("tool_call_id") in names:
            text = f"{names[m['tool_call_id']]}: {text}"
        out.append((m["role"], text))
    if tools:
        lines = ["You can call these tools:"]
        for t in tools:
            f = t["function"]
            entry = {"name": f["name"]}
            if f.get("description"):
                entry["description"] = f["description"]
            entry["parameters"] = f.get("parameters") or {"type": "object", "properties": {}}
            lines.append(compact(entry))
        lines.append('To call a tool, reply with <tool_call>{"name":"NAME","arguments":{...}} and nothing else.')
        listed = "\n".join(lines)
        if out and out[0][0] in ("system", "developer"):
            out[0] = (out[0][0], f"{out[0][1]}\n{listed}")
        else:
            out.insert(0, ("system", listed))
    parts = []
    for role, text in out:
        text = normal(text)
        parts.append(f"{roles[role]}: {text}\n\n" if text else f"{roles[role]}:\n\n")
    return "".join(parts) + "Assistant:"


WORLD = {
    **{k: v for k, v in CONVERSATIONS.items() if k != "empty arguments, flat call"},
    "newlines folded": dict(
        messages=[
            {"role": "developer", "content": "a\r\n\r\n\r\nb\rc\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\nd"},
            {"role": "user", "content": "\n\nx\n\n\ny  "},
        ]
    ),
    "tool result without a known call": dict(
        messages=[{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "nope", "content": "r"}]
    ),
    "tool without description or parameters": dict(
        messages=[{"role": "user", "content": "q"}], tools=[{"type": "function", "function": {"name": "ping"}}]
    ),
}


@pytest.mark.parametrize("name", list(WORLD))
def test_world_is_todays_rendering(name):
    conv = WORLD[name]
    assert builtin("world").render(conv["messages"], conv.get("tools")) == world_reference(**conv)


# --- choosing a template ----------------------------------------------------------------------------


def test_g1_recognised_by_name():
    for name in (
        "rwkv7-g1j-2.9b-20260831-ctx16384.pth",
        "/models/rwkv7-g1a-0.1b-20250728-ctx4096.pth",
        "RWKV7-G1a3-13.3B-GGUF",
        "BlinkDL/rwkv7-g1",
        "rwkv7-g0a2-7.2b.gguf",
    ):
        assert is_g1(name), name
    for name in ("RWKV-x070-World-2.9B-v3-20250211-ctx4096.pth", "rwkv-6-world-1b6.pth", "g1.5-model", "big1b.pth"):
        assert not is_g1(name), name
    assert not is_g1("rwkv7-g1a-0.1b.pth", version="6.0")  # the G series is RWKV-7


def test_resolve(tmp_path):
    assert resolve("world").name == "world" and resolve("g1").name == "g1"
    w = tmp_path / "RWKV-x070-World-0.1B.pth"
    w.write_bytes(b"")
    assert resolve("auto", str(w), "7").name == "world"
    g = tmp_path / "rwkv7-g1j-0.1b-20260831-ctx16384.pth"
    g.write_bytes(b"")
    chosen = resolve("auto", str(g), "7")
    assert chosen.name == "g1" and "G1" in chosen.source
    # A template beside the weights wins over the name.
    (tmp_path / "rwkv7-g1j-0.1b-20260831-ctx16384.jinja").write_text("{{ messages[0].content }}!")
    own = resolve("auto", str(g), "7")
    assert own.render([{"role": "user", "content": "x"}]) == "x!" and "beside" in own.source
    # A Hugging Face directory's tokenizer_config.json, a list of named templates included.
    d = tmp_path / "hf"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default", "template": "D"}]}))
    assert resolve("auto", str(d)).render([]) == "D"
    (d / "chat_template.jinja").write_text("J")
    assert resolve("auto", str(d)).render([]) == "J"
    f = tmp_path / "mine.jinja"
    f.write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    assert resolve(str(f)).render([{"role": "user", "content": ""}]) == "<user>"


def test_gguf_metadata(tmp_path):
    """A GGUF names its model (general.name) and may carry its template (tokenizer.chat_template)."""
    gguf = pytest.importorskip("gguf")

    def write(name, **strings):
        path = tmp_path / name
        w = gguf.GGUFWriter(str(path), "rwkv7")
        for key, value in strings.items():
            w.add_string(key.replace("__", "."), value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return str(path)

    named = write("model-q8_0.gguf", general__name="RWKV7 G1a3 13.3B")
    assert resolve("auto", named, "7").name == "g1"
    assert resolve("auto", write("other.gguf", general__name="RWKV7 World 2.9B"), "7").name == "world"
    own = write("own.gguf", tokenizer__chat_template="{{ 'T' }}")
    assert resolve("auto", own, "7").render([]) == "T"


def test_bad_templates(tmp_path):
    with pytest.raises(InputError, match="neither"):
        resolve("nonexistent-template")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(InputError, match="not valid Jinja"):
        resolve(str(bad))
    escape = tmp_path / "escape.jinja"
    escape.write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InputError, match="failed"):
        resolve(str(escape)).render([])
    mutate = tmp_path / "mutate.jinja"
    mutate.write_text("{{ messages.append(1) }}")
    with pytest.raises(InputError, match="failed"):
        resolve(str(mutate)).render([])
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('no system role here') }}")
    with pytest.raises(InputError, match="no system role here"):
        resolve(str(raising)).render([])
