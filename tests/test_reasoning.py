"""The reasoning split (rwkv_engine/reasoning.py), streamed with every chunking of adversarial replies.

The oracle is a whole-reply split written with regular expressions (not the splitter's state
machine), and for the token count the positions of the tags in the reply.
"""

from __future__ import annotations

import itertools
import re

import pytest

from rwkv_engine.reasoning import ReasoningSplitter, reply_start, split


def reference(text: str, start: str) -> tuple[str | None, str, int, int]:
    """(reasoning, content, where the thought opens, where it closes) of a whole reply."""
    skip = start.endswith(">")
    mode = start.rstrip(">")
    base = 1 if skip and text.startswith(">") else 0
    body = text[base:]
    if mode == "plain":
        return None, body[1:] if body.startswith(" ") else body, -1, -1
    opened = base
    if mode == "detect":
        m = re.match(r"\s*<think>", body)
        if m is None:
            return None, body.lstrip(), -1, -1
        body, opened = body[m.end() :], base + m.end()
        mode = "thought"
    if mode == "answer":
        return None, body.lstrip(), -1, -1
    m = re.search(r"</think>", body)
    if m is None:
        return body.lstrip(), "", opened, len(text) + 1
    return body[: m.start()].strip(), body[m.end() :].lstrip(), opened, opened + m.end()


EVERY = 14  # replies up to this long are cut every possible way (up to 2 ** 13 ways)


def chunkings(text: str):
    """Every way to cut `text` into non-empty pieces; for a longer text, every way into at
    most four pieces (each tag cut anywhere, twice over) and into single characters."""
    n = len(text)
    positions = range(1, n)
    if n <= EVERY:
        cut_sets = (c for r in range(n) for c in itertools.combinations(positions, r))
    else:
        cut_sets = itertools.chain((c for r in range(4) for c in itertools.combinations(positions, r)), [positions])
    for cuts in cut_sets:
        bounds = [0, *cuts, n]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


ADVERSARIAL = {
    "thought>": [
        ">ab</think>cd",
        "> a\n</think>\n b",
        ">x</thi",
        ">no close",
        "></think>",
        ">a</think>b</think>",
        "><think>a</",
        "x</think>y",
        ">a< /think>b",
        ">\u3000a\u2003</think>\u00a0b",
        ">a </th ink>",
    ],
    "thought": ["a</think>b", "  </think>  ", "</</think>>"],
    "answer>": [">", "> hi", "x>y", ">\n\n</think>a", ">  "],
    "answer": ["  hi <think>x</think>"],
    "detect": [" <think>a</think>b", " <thin", " <think", "<think>", "\n<think>a", "<thinking>", " hi"],
    "plain": ["  hi", " <think>a</think>", "x", ""],
}
CASES = [(start, text) for start, texts in ADVERSARIAL.items() for text in texts]


@pytest.mark.parametrize("start,text", CASES)
def test_every_chunking(start, text):
    reasoning, content, opened, closed = reference(text, start)
    assert split(text, start) == (reasoning, content)
    for pieces in chunkings(text):
        s = ReasoningSplitter(start)
        parts, position, expected_tokens = [], 0, 0
        for piece in pieces:
            end = position + len(piece)
            if reasoning is not None and end >= opened and position < closed:
                expected_tokens += 1  # (a piece is one token here)
            parts += s.push(piece, tokens=1)
            position = end
        parts += s.finish()
        got_reasoning = "".join(t for k, t in parts if k == "reasoning")
        got_content = "".join(t for k, t in parts if k == "content")
        assert (got_reasoning if s.thought else None, got_content) == (reasoning, content), pieces
        assert s.reasoning_tokens == expected_tokens, pieces
        assert all(t for _, t in parts), pieces  # no empty pieces are sent


def test_partial_close_is_held_then_sent():
    s = ReasoningSplitter("thought>")
    assert s.push(">step one </th") == [("reasoning", "step one")]
    assert s.push("ink>") == []
    assert s.push(" The answer") == [("content", "The answer")]
    s = ReasoningSplitter("thought>")
    assert s.push(">a </th") == [("reasoning", "a")]
    assert s.push("e end") == [("reasoning", " </the end")]


def test_reply_start():
    assert reply_start("User: q\n\nAssistant: <think", True) == "thought>"
    assert reply_start("User: q\n\nAssistant: <think></think", True) == "answer>"
    assert reply_start("Assistant: <think>\n</think", True) == "answer>"
    assert reply_start("<|im_start|>assistant\n<think>\n", True) == "thought"
    assert reply_start("<think>\n\n</think>\n\n", True) == "answer"
    assert reply_start("User: q\n\nAssistant:", True) == "detect"
    assert reply_start("User: q\n\nAssistant:", False) == "plain"
