"""Tool calls in the World chat format: how tools and calls are written into the prompt, and how
a reply is read back as a call.

The convention (the model is told it in the prompt; the grammar enforces the call's shape):

* The tools go into the System turn (appended to the first system message, or a System turn
  of their own before the conversation):

      System: {system text}
      You can call these tools:
      {"name":"get_weather","description":"...","parameters":{...}}
      To call a tool, reply with <tool_call>{"name":"NAME","arguments":{...}} and nothing else.

* A call is a reply that starts with the marker <tool_call> followed by the compact JSON
  {"name": ..., "arguments": {...}}, which `structured.call_grammar` constrains to the tool's
  parameter schema. An assistant message of the history with `tool_calls` is rendered the same
  way (after its text, if any; one line per call), so the model sees its own convention.
* A tool's result (a `role: tool` message) is a turn "Tool: {content}", with the tool's name in
  front when the history names it: "Tool: get_weather: 18 C, sunny".

tool_choice: "none" renders no tool list and the reply is plain text; "auto" renders the tools
and lets the model choose: a reply that starts with the marker is a call (structured.
ToolCallTrigger), any other reply is text; "required" or a named function constrain the whole
reply to a call (to any of the tools, or to the named one). One call per reply.
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

from .structured import TOOL_CALL_MARKER, ToolCallTrigger, call_grammar, parse_call

__all__ = ["render_tools", "render_calls", "tool_constraint", "parse_call", "TOOL_CALL_MARKER"]


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def render_tools(tools: Sequence[Mapping]) -> str:
    """The text that tells the model about `tools` (OpenAI function definitions)."""
    lines = ["You can call these tools:"]
    for f in tools:
        entry = {"name": f["name"]}
        if f.get("description"):
            entry["description"] = f["description"]
        entry["parameters"] = f.get("parameters") or {"type": "object", "properties": {}}
        lines.append(compact(entry))
    lines.append(f'To call a tool, reply with {TOOL_CALL_MARKER}{{"name":"NAME","arguments":{{...}}}} and nothing else.')
    return "\n".join(lines)


def render_calls(calls: Sequence[tuple[str, str]]) -> str:
    """Calls (name, arguments as JSON text) as the assistant wrote them: one line per call."""
    out = []
    for name, arguments in calls:
        try:
            args = json.loads(arguments) if arguments else {}
        except ValueError:
            args = arguments  # not JSON: kept as the client sent it
        out.append(TOOL_CALL_MARKER + compact({"name": name, "arguments": args}))
    return "\n".join(out)


def tool_constraint(tools: Sequence[Mapping], choice: str, tokenizer, vocab_size: int):
    """The Constraint of a reply under tool_choice `choice` ("auto", "required" or a function
    name), or None for "none"."""
    if choice == "none":
        return None
    if choice == "auto":
        return ToolCallTrigger(call_grammar(tools, tokenizer, vocab_size, forced=False), tokenizer)
    chosen = tools if choice == "required" else [f for f in tools if f["name"] == choice]
    return call_grammar(chosen, tokenizer, vocab_size, forced=True).constraint()


def is_call(reply: str) -> bool:
    """True when a reply (its leading spaces aside) starts with the marker."""
    return reply.lstrip(" ").startswith(TOOL_CALL_MARKER)


def undecided(reply: str) -> bool:
    """True while a reply could still become a call: spaces and a beginning of the marker."""
    head = reply.lstrip(" ")
    return TOOL_CALL_MARKER.startswith(head)
