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
from collections.abc import Mapping, Sequence

from .structured import CALL_HEAD, TOOL_CALL_MARKER, ToolCallTrigger, call_grammar, parse_call

__all__ = ["render_tools", "render_calls", "tool_constraints", "parse_call", "CallStream", "TOOL_CALL_MARKER"]


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
    lines.append(
        f'To call a tool, reply with {TOOL_CALL_MARKER}{{"name":"NAME","arguments":{{...}}}} and nothing else.'
    )
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


def tool_constraints(tools: Sequence[Mapping], choice: str, tokenizer, vocab_size: int):
    """A factory of the Constraint of a reply (one per choice) under tool_choice `choice`
    ("auto", "required" or a function name), or None for "none". The grammar is compiled here."""
    if choice == "none":
        return None
    if choice == "auto":
        grammar = call_grammar(tools, tokenizer, vocab_size, forced=False)
        return lambda: ToolCallTrigger(grammar, tokenizer)
    chosen = tools if choice == "required" else [f for f in tools if f["name"] == choice]
    return call_grammar(chosen, tokenizer, vocab_size, forced=True).constraint


def is_call(reply: str) -> bool:
    """True when a reply (its leading spaces aside) starts with the marker."""
    return reply.lstrip(" ").startswith(TOOL_CALL_MARKER)


def undecided(reply: str) -> bool:
    """True while a reply could still become a call: spaces and a beginning of the marker."""
    head = reply.lstrip(" ")
    return TOOL_CALL_MARKER.startswith(head)


class CallStream:
    """A streamed reply under tools, as the pieces a client is sent: `push(text)` and `finish()`
    return a list of ("content", text), ("call", name) (a call starts; its name is known) and
    ("arguments", text) (the next piece of the call's arguments JSON).

    The reply is held while it may still become a call (spaces and a beginning of the marker).
    Text goes out as content; a call goes out as its name once the model has written it, then
    its arguments as they grow, always holding back the last character (the "}" that closes
    the call, not the arguments). A call cut short (max_tokens) ends with what was sent.
    """

    def __init__(self):
        self.held = ""
        self.free = False  # decided: plain text
        self._head = None  # the call's head match, once written
        self._sent = 0  # characters of the arguments sent

    def push(self, text: str) -> list[tuple[str, str]]:
        if self.free:
            return [("content", text)] if text else []
        self.held += text
        if undecided(self.held):
            return []
        if not is_call(self.held):
            self.free, text, self.held = True, self.held, ""
            return [("content", text)]
        return self._call()

    def finish(self) -> list[tuple[str, str]]:
        if self.free or not is_call(self.held):
            text, self.held = self.held, ""
            return [("content", text)] if text else []
        return self._call()

    def _call(self) -> list[tuple[str, str]]:
        body = self.held.lstrip(" ")[len(TOOL_CALL_MARKER) :]
        out = []
        if self._head is None:
            self._head = CALL_HEAD.match(body)
            if self._head is None:
                return []
            out.append(("call", json.loads(f'"{self._head.group(1)}"')))
        arguments = body[self._head.end() :]
        end = len(arguments) - 1  # (the last character may be the "}" that closes the call)
        if end > self._sent:
            out.append(("arguments", arguments[self._sent : end]))
            self._sent = end
        return out
