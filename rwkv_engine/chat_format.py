"""The World chat format in Python: a list of chat messages -> the text a World model continues.

    System: {system}\n\nUser: {message}\n\nAssistant: {reply}\n\nUser: {message}\n\nAssistant:

(docs/formats.md D.) Every message becomes "{Role}: {text}\n\n" ("{Role}:\n\n" when its text
is empty) with the roles System (also for OpenAI's "developer"), User, Assistant and Tool (a
tool's result; how tools and calls are written is rwkv_engine/tool_calls.py); the prompt ends
with "Assistant:" and no space: the model answers with a leading space, which the server and the
chat remove from what the user sees (reasoning.py, "plain" replies). "\n\n" separates turns, so
message text is normalised never to contain it: CRLF -> LF, stripped, runs of newlines folded
into one (as ChatRWKV's API demos do). A reply ends at "\n\n".

An assistant message of the history is rendered as "Assistant: {content}", which puts back the
space the server stripped: the history then reads exactly as the model wrote it, so a
conversation's next prompt starts with the previous prompt plus the reply, and the prompt-state
cache can resume it.

The server, its Ray router and the chat CLI render conversations with chat templates
(rwkv_engine/templates), whose built-in `world` renders exactly this; `render_chat` stays as the
World format's short form for what needs no template (tests). TURN_SEPARATOR, the end of every
turn and reply, is shared by both. This module knows nothing of HTTP, the terminal or the engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

TURN_SEPARATOR = "\n\n"

ROLE_NAMES = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool",
}  # a tool's result (rwkv_engine/tool_calls.py)


def normalize_text(text: str) -> str:
    """Message text as it goes into the prompt: never contains the turn separator."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
    return re.sub(r"\n{2,}", "\n", text)


def render_chat(messages: Iterable[tuple[str, str]]) -> str:
    """The prompt for `messages`, (role, text) pairs with role in ROLE_NAMES, ending with "Assistant:"."""
    parts = []
    for role, text in messages:
        name = ROLE_NAMES.get(role)
        if name is None:
            raise ValueError(f"unknown chat role {role!r}; one of {', '.join(ROLE_NAMES)}")
        text = normalize_text(text)
        parts.append(f"{name}: {text}{TURN_SEPARATOR}" if text else f"{name}:{TURN_SEPARATOR}")
    parts.append("Assistant:")
    return "".join(parts)
