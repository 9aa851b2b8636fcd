"""Batch inference over JSONL files: what `rwkv-engine batch MODEL IN.jsonl OUT.jsonl` runs.

Each line of IN is one request, either a bare OpenAI request body (`{"messages": [...]}` goes to
/v1/chat/completions, anything else to /v1/completions) or a line of OpenAI's Batch API
(`{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`). Each
line of OUT answers the line of IN with the same number (counted from 1, as in every message), in order:

    {"line": 1, "custom_id": null, "response": {"status_code": 200, "body": {...}}, "error": null}
    {"line": 2, "custom_id": "q2", "response": {"status_code": 400, "body": {"error": ...}},
     "error": {"message": "...", "type": "invalid_request_error", "code": null}}

The requests go through the server's own FastAPI app in this process (`serve.app.create_app`, no
socket), so a line gets what `rwkv-engine serve` answers the same body: same fields, defaults,
limits and errors. `stream` is ignored (a line's answer is always whole). Up to `concurrency`
lines run at once, decoded together by the engine; answers are written in order as soon as
every earlier line is written, one flushed line each.

Resuming: when OUT already holds answers (an interrupted run), its complete lines are kept, a
partial last line is cut, and the run goes on with the next line of IN: finished lines are
never redone, and no line is lost or answered twice.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)


@dataclass(frozen=True)
class Line:
    number: int  # 0-based index of the line in IN (its answer's "line" and messages count from 1)
    text: str


def _failure(line: Line, custom_id, status: int, message: str, body: dict | None = None) -> dict:
    if body is None:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    error = dict(body.get("error") or {"message": message})
    return {
        "line": line.number + 1,
        "custom_id": custom_id,
        "response": {"status_code": status, "body": body},
        "error": {"message": error.get("message", message), "type": error.get("type"), "code": error.get("code")},
    }


def parse_line(line: Line) -> tuple[object, str, dict] | dict:
    """(custom_id, endpoint, body) of a line, or its answer when the line itself is bad."""
    try:
        obj = json.loads(line.text)
    except ValueError as e:
        return _failure(line, None, 400, f"line {line.number + 1} is not JSON: {e}")
    except RecursionError:  # (the server's read_json answers the same)
        return _failure(line, None, 400, f"line {line.number + 1} is nested too deeply")
    if not isinstance(obj, dict):
        return _failure(line, None, 400, f"line {line.number + 1} is not a JSON object")
    custom_id = None
    if "body" in obj and "url" in obj:  # OpenAI Batch API line
        custom_id, url, body = obj.get("custom_id"), obj.get("url"), obj.get("body")
        method = str(obj.get("method", "POST")).upper()
        if method != "POST" or url not in ENDPOINTS:
            return _failure(
                line,
                custom_id,
                400,
                f"line {line.number + 1}: {method} {url} is not a batch endpoint; one of POST {', '.join(ENDPOINTS)}",
            )
        if not isinstance(body, dict):
            return _failure(line, custom_id, 400, f"line {line.number + 1}: body is not a JSON object")
    else:
        body, url = obj, CHAT if "messages" in obj else COMPLETIONS
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return custom_id, url, body


def with_model(parsed, model_name: str):
    """A parsed line whose body names no model gets the served one."""
    if isinstance(parsed, tuple) and "model" not in parsed[2]:
        custom_id, url, body = parsed
        return custom_id, url, {"model": model_name, **body}
    return parsed


def _retry_after(value: str | None) -> float:
    """Seconds a 429's Retry-After asks for (1 when it is missing or odd; at most 30)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return 1.0
    return min(max(seconds, 0.0), 30.0) if seconds == seconds else 1.0


class AppClient:
    """Requests to a FastAPI app in this process (httpx's ASGI transport); its engine must be running."""

    def __init__(self, app, model_name: str, busy_retries: int = 120):
        # 429 means every slot and queue place is taken, by this run's own lines: retried after
        # the server's Retry-After, but a line refused `busy_retries` times in a row gets an
        # error answer, so one line can never hold up the rest for good.
        self.app, self.model_name, self.busy_retries = app, model_name, busy_retries

    async def answer(self, client, line: Line) -> dict:
        parsed = with_model(parse_line(line), self.model_name)
        if isinstance(parsed, dict):
            return parsed
        custom_id, url, body = parsed
        r = await client.post(url, json=body)
        tries = 1
        while r.status_code == 429 and tries <= self.busy_retries:
            await asyncio.sleep(_retry_after(r.headers.get("retry-after")))
            r = await client.post(url, json=body)
            tries += 1
        try:
            payload = r.json()
        except ValueError:
            payload = {"error": {"message": r.text or f"HTTP {r.status_code}", "type": "server_error"}}
        if r.status_code == 429:
            error = dict(payload.get("error") or {}) if isinstance(payload, dict) else {}
            error["message"] = (
                f"the server stayed busy: gave up after {tries} tries ({error.get('message', 'HTTP 429')})"
            )
            payload = {**(payload if isinstance(payload, dict) else {}), "error": error}
        if r.status_code != 200:
            return _failure(line, custom_id, r.status_code, f"HTTP {r.status_code}", payload)
        return {
            "line": line.number + 1,
            "custom_id": custom_id,
            "response": {"status_code": 200, "body": payload},
            "error": None,
        }

    async def answer_all(self, lines: Iterable[Line], write: Callable[[dict], None], concurrency: int) -> None:
        """Answer every line, at most `concurrency` at once; `write` gets the answers in line order."""
        import httpx

        pending: dict[int, dict] = {}
        order: deque[int] = deque()
        running: set[asyncio.Task] = set()
        it = iter(lines)
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=None) as client:

            async def one(line: Line) -> None:
                pending[line.number] = await self.answer(client, line)

            exhausted = False
            while not exhausted or running:
                while not exhausted and len(running) < concurrency:
                    line = next(it, None)
                    if line is None:
                        exhausted = True
                        break
                    order.append(line.number)
                    running.add(asyncio.create_task(one(line)))
                if running:
                    done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()
                while order and order[0] in pending:
                    write(pending.pop(order.popleft()))

    def run(self, lines: Sequence[Line], concurrency: int) -> list[dict]:
        """The answers of `lines` in order, for callers without an event loop (e.g. a Ray actor)."""
        out: list[dict] = []
        asyncio.run(self.answer_all(lines, out.append, concurrency))
        return out


def resume_point(out_path: Path) -> int:
    """How many answers OUT already holds; a partial last line is cut off the file."""
    if not out_path.exists():
        return 0
    data = out_path.read_bytes()
    keep = data.rfind(b"\n") + 1  # everything after the last newline is a partial line
    lines = data[:keep].splitlines()
    for i, raw in enumerate(lines):
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or obj.get("line") != i + 1:
            raise InputError(
                f"{out_path}: line {i + 1} is not this command's answer to line {i + 1}; "
                "give a new output file or remove it"
            )
    if keep < len(data):
        with open(out_path, "r+b") as f:
            f.truncate(keep)
    return len(lines)


def read_lines(in_path: Path) -> list[Line]:
    """Every line of IN. Only \n (or \r\n) ends a line, never the other breaks str.splitlines
    knows (U+2028 and others may stand raw inside JSON strings); a missing final newline is fine."""
    try:
        text = in_path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{in_path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    pieces = text.split("\n")
    if pieces[-1] == "":
        pieces.pop()
    return [Line(i, t[:-1] if t.endswith("\r") else t) for i, t in enumerate(pieces)]


class OutputFile:
    """OUT opened for appending; each answer is one line, flushed (and fsynced every `sync_every`)."""

    def __init__(self, path: Path, sync_every: int = 64):
        self.f = open(path, "a", encoding="utf-8")
        self.sync_every, self.count = sync_every, 0
        self.ok = self.errors = 0

    def write(self, answer: dict) -> None:
        self.f.write(json.dumps(answer, ensure_ascii=False) + "\n")
        self.f.flush()
        self.count += 1
        if answer["error"] is None:
            self.ok += 1
        else:
            self.errors += 1
        if self.count % self.sync_every == 0:
            os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
