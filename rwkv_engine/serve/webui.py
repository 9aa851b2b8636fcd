"""The web chat page: `/` and `/chat` serve it, `/static/NAME` its script and style sheet.

The page (static/index.html, app.js, style.css) is plain HTML, JavaScript and CSS: no build
step, nothing loaded from another origin. It is a client of this server's own
`/v1/chat/completions` like any other, so the API key guards the API and not the page; the
page asks for the key when the API answers 401.

The files are read once, when the app is made. The page gets the server's chat defaults
written into it (a `<meta name="rwkv-defaults">` JSON), so the settings it shows for empty
fields are the values the server will use. Every answer has an ETag and `Cache-Control:
no-cache` (the browser revalidates, a new version shows at once); the page has a Content
Security Policy that allows only this origin's script, style and API.
"""

from __future__ import annotations

import hashlib
import html
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from ..sampling import SamplingParams

STATIC = Path(__file__).with_name("static")
PAGE_PATHS = ("/", "/chat")
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
DEFAULTS_MARK = "{{defaults}}"

_COMMON_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
_PAGE_HEADERS = {
    **_COMMON_HEADERS,
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class _File:
    body: bytes
    media_type: str
    headers: dict[str, str]

    @cached_property
    def etag(self) -> str:
        return '"' + hashlib.sha256(self.body).hexdigest()[:32] + '"'

    def answer(self, request: Request) -> Response:
        headers = {**self.headers, "ETag": self.etag}
        if self.etag in (t.strip() for t in request.headers.get("if-none-match", "").split(",")):
            return Response(status_code=304, headers=headers)
        return Response(self.body, media_type=self.media_type, headers=headers)


def router(defaults: SamplingParams, max_tokens: int) -> APIRouter:
    """The routes of the page; `defaults` and `max_tokens` are what a chat request gets for fields it omits."""
    shown = {
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "max_tokens": max_tokens,
        "presence_penalty": defaults.presence_penalty,
        "frequency_penalty": defaults.frequency_penalty,
    }
    page_text = (STATIC / "index.html").read_text(encoding="utf-8")
    page = _File(
        page_text.replace(DEFAULTS_MARK, html.escape(json.dumps(shown))).encode(),
        "text/html; charset=utf-8",
        _PAGE_HEADERS,
    )
    assets = {name: _File((STATIC / name).read_bytes(), kind, _COMMON_HEADERS) for name, kind in ASSETS.items()}

    r = APIRouter(include_in_schema=False)

    async def chat_page(request: Request):
        return page.answer(request)

    for path in PAGE_PATHS:
        r.add_api_route(path, chat_page, methods=["GET", "HEAD"])

    @r.api_route("/static/{name}", methods=["GET", "HEAD"])
    async def asset(name: str, request: Request):
        if name not in assets:
            raise HTTPException(404, "Not Found")
        return assets[name].answer(request)

    return r
