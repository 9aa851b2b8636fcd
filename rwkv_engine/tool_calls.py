"""Tool calls: the grammar that constrains a reply to calls, and how a reply is read back as calls,
in the two conventions of the built-in chat templates (rwkv_engine/templates). The template
writes the tools and earlier calls into the prompt; this module reads what the model answers.

`FORMATS["world"]` (the `world` template; rwkv-engine's own convention, one call per reply):

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

`FORMATS["g1"]` (the `g1` template; the format the RWKV-7 G1 models were trained on):

* A call is a ```json block holding {"name": ..., "arguments": {...}}, written (and constrained
  by `structured.g1_call_grammar`) the way the template writes a call back into the history:
  " ```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```". Several calls are
  blocks joined by "\n " (parallel_tool_calls, on unless the request turns it off).
* A tool's result is a turn "User: Function output:\n{content}" (the template's).

With either format, tool_choice: "none" renders no tool list and the reply is plain text;
"auto" renders the tools and lets the model choose: a reply (an answer, after any thought)
that starts with the marker (World) is a call, and so is (G1) an opening fence at any line start
of the answer, after text or not (structured.ToolCallTrigger); the text before it is the reply's
content, and any other reply is text; "required" or a named function constrain the whole answer
to calls (to any of the tools, or to the named one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .structured import (
    CALL_HEAD,
    G1_CLOSE,
    G1_FENCE,
    TOOL_CALL_MARKER,
    ToolCallTrigger,
    call_grammar,
    g1_call_grammar,
    load_call,
    parse_call,
)

__all__ = [
    "FORMATS",
    "ToolFormat",
    "parse_call",
    "CallStream",
    "G1CallStream",
    "parse_g1",
    "read_g1",
    "TOOL_CALL_MARKER",
]


def tool_constraints(
    tools: Sequence[Mapping], choice: str, tokenizer, vocab_size: int, fmt: str = "world", parallel: bool = True
):
    """A factory of the Constraint of an answer (one per choice) under tool_choice `choice`
    ("auto", "required" or a function name) in format `fmt`, or None for "none". The grammar is
    compiled here. (World: one call per reply whatever `parallel` says.)"""
    if choice == "none":
        return None
    chosen = tools if choice in ("auto", "required") else [f for f in tools if f["name"] == choice]
    if fmt == "g1":
        grammar = g1_call_grammar(chosen, tokenizer, vocab_size, forced=choice != "auto", parallel=parallel)
        if choice == "auto":
            return lambda: ToolCallTrigger(grammar, tokenizer, marker=G1_FENCE, lead=b" \n", line_starts=True)
        return grammar.constraint
    if choice == "auto":
        grammar = call_grammar(tools, tokenizer, vocab_size, forced=False)
        return lambda: ToolCallTrigger(grammar, tokenizer)
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


# --- G1: ```json blocks -------------------------------------------------------------------------------

# The start of a call as any writer may space it; the grammar writes {"name": "NAME", "arguments": ...
# (and what follows it has begun: the arguments' first character)
G1_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may still turn out to be the end of a call's arguments: its "}", the space and the
# beginning of the closing fence after it.
G1_TAIL = re.compile(r"\s*(\}\s*`{0,2})?$")
G1_BLOCK = re.compile(r"\s*```json\n(.*?)\n```", re.S)
# A call block's opening fence at a line start (the answer's start read as one: "\n" is put in
# front), with the whitespace before it; and what, at the end of text, may still become one.
G1_OPENING = re.compile(r"\n\s*" + re.escape(G1_FENCE))
G1_MAYBE = re.compile(r"\n\s*(?:" + "|".join(re.escape(G1_FENCE[:k]) for k in range(len(G1_FENCE) - 1, 0, -1)) + r")?$")


def read_g1(answer: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(the text before the calls, [(name, arguments as the JSON text the model wrote)]) of an
    answer that ends in ```json call blocks, the first at a line start (the g1 template writes
    a message's text, a newline, then its calls); None when it holds no such calls."""
    opening = G1_OPENING.search("\n" + answer)
    if opening is None:
        return None
    calls, pos = [], max(opening.start() - 1, 0)
    text = answer[:pos]
    while pos < len(answer.rstrip()):
        m = G1_BLOCK.match(answer, pos)
        if m is None:
            return None
        body = m.group(1)
        call = load_call(body)
        if call is None:
            return None
        head = G1_HEAD.match(body)
        if head and body.rstrip().endswith("}"):
            calls.append((call["name"], body[head.end() :].rstrip()[:-1].rstrip()))
        else:
            calls.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
        pos = m.end()
    return (text, calls) if calls else None


def parse_g1(answer: str) -> list[tuple[str, str]] | None:
    """The calls of `read_g1`, or None."""
    read = read_g1(answer)
    return None if read is None else read[1]


class G1CallStream:
    """`CallStream` for the G1 format: text goes out as content, except a tail that may still
    open a ```json block at a line start (a newline, whitespace and a beginning of the fence; at
    the answer's start, whitespace and a beginning of the fence), which is held until it is
    decided; each call goes out as ("call", name) once its name is written, then its arguments
    as they grow, holding back what may still be the "}" that closes the call and the closing
    fence. Several blocks give several calls. A call cut short ends with what was sent; a fence
    that never got a call's name is content."""

    def __init__(self):
        self.held = ""
        self.started = False  # content went out: the held text is not the answer's start
        self.calling = False
        self._pos = 0  # where the current block's JSON starts in `held`
        self._head = None  # the current call's head match, once written
        self._calls_sent = 0
        self._sent = 0  # characters of the current block sent (up to the end of the arguments sent)

    def push(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        if self.calling:
            return self._calls()
        lead = "" if self.started else "\n"  # (the answer's start is a line start)
        opening = G1_OPENING.search(lead + self.held)
        out = []
        if opening is None:
            maybe = G1_MAYBE.search(lead + self.held)
            cut = len(self.held) if maybe is None else max(maybe.start() - len(lead), 0)
            if cut:
                out.append(("content", self.held[:cut]))
                self.held, self.started = self.held[cut:], True
            return out
        cut = max(opening.start() - len(lead), 0)
        if cut:
            out.append(("content", self.held[:cut]))
        self.held, self.calling = self.held[cut:], True
        self._pos = opening.end() - len(lead) - cut
        return out + self._calls()

    def finish(self) -> list[tuple[str, str]]:
        if self.calling and (self._calls_sent or self._head is not None):
            return self._calls()
        text, self.held = self.held, ""
        return [("content", text)] if text else []

    def _calls(self) -> list[tuple[str, str]]:
        out = []
        while True:
            body = self.held[self._pos :]
            if self._head is None:
                self._head = G1_HEAD.match(body)
                if self._head is None:
                    return out
                self._calls_sent += 1
                out.append(("call", json.loads(f'"{self._head.group(1)}"')))
                self._sent = self._head.end()
            close = body.find(G1_CLOSE, self._head.end())
            if close < 0:
                end = G1_TAIL.search(body, self._head.end()).start()
            else:
                arguments = body[self._head.end() : close].rstrip()
                end = self._head.end() + len(arguments[:-1].rstrip() if arguments.endswith("}") else arguments)
            if end > self._sent:
                out.append(("arguments", body[self._sent : end]))
                self._sent = end
            if close < 0:
                return out
            rest = body[close + len(G1_CLOSE) :]
            following = rest.lstrip()
            if not following.startswith(G1_FENCE):
                return out  # the end, or the start of another block still being written
            self._pos += close + len(G1_CLOSE) + len(rest) - len(following) + len(G1_FENCE)
            self._head = None


@dataclass(frozen=True)
class ToolFormat:
    """One convention: its answer streams (`stream()`), whole answers (`parse`), constraints."""

    name: str
    stream: type
    parse: object  # answer -> (text before the calls, [(name, arguments)]) or None

    def constraints(self, tools, choice: str, tokenizer, vocab_size: int, parallel: bool = True):
        return tool_constraints(tools, choice, tokenizer, vocab_size, self.name, parallel)


def _parse_world(answer: str) -> tuple[str, list[tuple[str, str]]] | None:
    call = parse_call(answer)
    return None if call is None else ("", [call])


FORMATS = {"world": ToolFormat("world", CallStream, _parse_world), "g1": ToolFormat("g1", G1CallStream, read_g1)}
