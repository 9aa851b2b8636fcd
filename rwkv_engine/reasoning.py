"""A reply split into its thought (`reasoning_content`) and its answer (`content`), as it streams.

Reasoning models (RWKV-7 G1, and the DeepSeek-R1 convention most templates follow) write their
thought between <think> and </think>, then the answer. Where the reply starts is told by the end
of the prompt (`reply_start`):

    prompt ends with        the reply                        start
    "<think"                ">" thought "</think>" answer     "thought", skipping the ">"
    "<think>"               thought "</think>" answer         "thought"
    "</think"               ">" answer                       "answer", skipping the ">"
    "</think>"              answer                           "answer"
    anything else           "<think>" thought ... or answer  "detect" (a template that knows <think>)
                                                             "plain" (one that does not: World)

The thought and the answer are each stripped of leading whitespace, and the thought of the
whitespace before </think>. A "plain" reply is all answer, less the one space a World model
writes after "Assistant:" (the World format's rule, docs/formats.md D). A thought that never closes (cut by
max_tokens) is all reasoning, with an empty answer.

`ReasoningSplitter.push(text, tokens)` takes the reply piece by piece as the engine sends it and
returns what can be told already; text that may still turn out to be part of a tag ("</thi")
is held until the next piece decides, and `finish()` gives what is left. `tokens` counts the
tokens behind each piece: those of pieces that arrive while the thought is open are the reply's
reasoning tokens (`reasoning_tokens`; a token that closes the thought counts as reasoning).
This module knows nothing of HTTP or the terminal; the server and `rwkv-engine chat` use it.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
Part = tuple[str, str]  # ("reasoning" | "content", text)


def reply_start(prompt: str, knows_thinking: bool) -> str:
    """Where a reply to `prompt` starts (the table of the module docstring): "thought", "thought>",
    "answer", "answer>", "detect" or "plain"; a trailing ">" means the reply's first ">" is skipped."""
    tail = prompt.rstrip()
    for tag, start in ((OPEN[:-1], "thought>"), (OPEN, "thought"), (CLOSE[:-1], "answer>"), (CLOSE, "answer")):
        if tail.endswith(tag):
            return start if tail == prompt or not start.endswith(">") else start[:-1]
    return "detect" if knows_thinking else "plain"


class ReasoningSplitter:
    """One reply's split, streamed (module docstring)."""

    def __init__(self, start: str = "plain"):
        if start not in ("thought", "thought>", "answer", "answer>", "detect", "plain"):
            raise ValueError(f"unknown reply start {start!r}")
        self.mode = start.rstrip(">")
        self.skip = ">" if start.endswith(">") else ""
        self.lead = True  # at the start of a part: leading whitespace is dropped
        self.held = ""
        self.thought = False  # the reply has (or had) a thought
        self.reasoning_tokens = 0

    @property
    def in_thought(self) -> bool:
        return self.mode == "thought"

    @property
    def answering(self) -> bool:
        """The thought is over (or there is none): what comes now is the answer."""
        return self.mode in ("answer", "plain")

    def push(self, text: str, tokens: int = 0) -> list[Part]:
        before = self.mode
        self.held += text
        out = self._split(final=False)
        if before == "thought" or (before == "detect" and self.thought):
            self.reasoning_tokens += tokens
        return out

    def finish(self) -> list[Part]:
        return self._split(final=True)

    def _split(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while True:
            if self.skip:
                if not self.held:
                    return out
                if self.held[0] == self.skip:
                    self.held = self.held[1:]
                self.skip = ""
            if self.mode == "plain":
                if self.lead and self.held:
                    self.lead = False
                    self.held = self.held[1:] if self.held[0] == " " else self.held
                return self._emit(out, "content", final=True)
            if self.mode == "detect":
                head = self.held.lstrip()
                if head.startswith(OPEN):
                    self.mode, self.thought, self.held = "thought", True, head[len(OPEN) :]
                elif OPEN.startswith(head) and not final:
                    return out  # spaces and a beginning of "<think>": undecided
                else:
                    self.mode = "answer"
                continue
            if self.lead:
                self.held = self.held.lstrip()
                if not self.held:
                    return out
                self.lead = False
            if self.mode == "answer":
                return self._emit(out, "content", final=True)
            self.thought = True
            end = self.held.find(CLOSE)
            if end >= 0:
                self._add(out, "reasoning", self.held[:end].rstrip())
                self.held, self.mode, self.lead = self.held[end + len(CLOSE) :], "answer", True
                continue
            return self._emit(out, "reasoning", final)

    def _emit(self, out: list[Part], kind: str, final: bool) -> list[Part]:
        """Send what is held as `kind`; in a thought, keep back what may still become "</think>"
        (with the whitespace before it), unless this is the end."""
        keep = 0 if final or kind == "content" else _tag_tail(self.held)
        cut = len(self.held) - keep
        if keep:
            cut = len(self.held[:cut].rstrip())
        elif not final:
            cut = len(self.held.rstrip()) if kind == "reasoning" else cut
        self._add(out, kind, self.held[:cut])
        self.held = self.held[cut:]
        return out

    @staticmethod
    def _add(out: list[Part], kind: str, text: str) -> None:
        if not text:
            return
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


def _tag_tail(text: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of "</think>"."""
    for n in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[-n:]):
            return n
    return 0


def split(text: str, start: str = "plain") -> tuple[str | None, str]:
    """(reasoning or None when the reply has no thought, content) of a whole reply."""
    s = ReasoningSplitter(start)
    parts = s.push(text) + s.finish()
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    return (reasoning if s.thought else None), "".join(t for k, t in parts if k == "content")
