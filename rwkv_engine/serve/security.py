"""The checks every HTTP request passes before the router sees it: an ASGI middleware.

`Guard(app, ...)` wraps the FastAPI app (`create_app` installs it). In order, for each request:

1. Host (DNS rebinding). With `allowed_hosts` set -- a loopback bind sets it: localhost,
   127.0.0.0/8, [::1], plus the names of --allowed-host -- a Host header naming any other
   host gets 403 `host_not_allowed`. Otherwise a page of evil.example whose DNS name is
   rebound to 127.0.0.1 would be same-origin with a local server: it could drive it and read
   the answers.
2. Origin (CORS and cross-site requests). A browser sends `Origin` with every cross-origin
   request. One from this server's own origin (a page it serves) or from an origin of
   `cors_origins` (--cors-origin; none by default, "*" for any) passes, and an allowed
   origin gets `Access-Control-Allow-Origin` on the answer and its preflights (OPTIONS)
   answered. Any other gets 403 `origin_not_allowed`: without this a page of another site
   could still post (a "simple" request needs no preflight), and make a keyless server
   generate, even if it cannot read the answer. Requests without `Origin` (curl, SDKs) pass.
3. API key, for every path under /v1/, as soon as the headers are in (the body is not
   waited for): 401 `invalid_api_key`. (Routes outside /v1/ that need the key check it
   themselves with `key_matches`.)
4. Body deadline: the whole body must arrive within `body_timeout` seconds of the headers,
   else 408 `timeout` and the connection is closed. The app sees a client that went away.
5. An answer that starts before the request body has been read closes the connection
   (`Connection: close`), so a body the app never reads cannot hold it open.

It also drops a trailing slash from the path (POST /v1/chat/completions/ is
/v1/chat/completions). Error answers have OpenAI's error body and count in
`http_errors_total`. Time limits before the headers (a stalled request line or header block)
and the cap on open connections are the connection layer's: `serve/connections.py`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import InputError
from . import protocol as p

CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
CORS_MAX_AGE = "600"


def key_matches(authorization: str, key: str) -> bool:
    """Whether an Authorization header value is `Bearer KEY` (compared in constant time)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def is_loopback(host: str) -> bool:
    """Whether a host name or address (no port) is this machine's loopback."""
    host = host.lower().rstrip(".")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key(key: str | None, key_file: Path | None, environ=os.environ) -> str | None:
    """The API key: `key` (--api-key), read from `key_file` (--api-key-file) or
    $RWKV_ENGINE_API_KEY, in that order (None: no key)."""
    if key is not None and key_file is not None:
        raise InputError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            key, source = key_file.read_text().strip(), f"--api-key-file {key_file}"
        except (OSError, UnicodeError) as e:
            raise InputError(f"--api-key-file {key_file}: {getattr(e, 'strerror', None) or e}") from None
    elif key is not None:
        source = "--api-key"
    elif "RWKV_ENGINE_API_KEY" in environ:
        key, source = environ["RWKV_ENGINE_API_KEY"], "RWKV_ENGINE_API_KEY"
    else:
        return None
    if not key.strip():
        raise InputError(f"{source}: the API key is empty")
    return key


def exposure_warning(host: str, key: str | None) -> str | None:
    """The warning for a server reachable from other machines with no API key, or None."""
    if key is not None or is_loopback(host):
        return None
    return (
        f"WARNING: listening on {host}, reachable from other machines, with NO API KEY: anyone who can "
        "reach this port can use the model. Set a key (--api-key-file PATH or RWKV_ENGINE_API_KEY), or "
        "listen on 127.0.0.1."
    )


def allowed_hosts(host: str, names: list[str]) -> tuple[str, ...] | None:
    """The Host names accepted besides the loopback ones, for a server listening on `host`, given
    the names of --allowed-host; None = any (`Guard`)."""
    if "*" in names or not (names or is_loopback(host)):
        return None
    if not is_loopback(host) and host not in ("0.0.0.0", "::", ""):
        names = [*names, host]  # the address it listens on is a name of it too
    return tuple(names)


def host_name(header: str) -> str:
    """The host of a Host header value, without the port: "[::1]:80" -> "::1", "a.b:1" -> "a.b"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def quoted(text: str, limit: int = 100) -> str:
    """repr(text), cut to its first `limit` characters (a client may send megabytes)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


class Guard:
    """ASGI middleware: see the module docstring.

    allowed_hosts: None = any Host; else the names allowed besides the loopback ones.
    cors_origins: origins (scheme://host[:port]) whose pages may call the API; "*" = any.
    count_error(status): called for every error answer the guard gives.
    """

    def __init__(
        self,
        app,
        *,
        api_key: str | None = None,
        allowed_hosts: tuple[str, ...] | None = None,
        cors_origins: tuple[str, ...] = (),
        body_timeout: float = 30.0,
        count_error: Callable[[int], None] | None = None,
    ):
        self.app = app
        self.api_key = api_key
        self.allowed_hosts = None if allowed_hosts is None else {host_name(h).rstrip(".") for h in allowed_hosts}
        self.any_origin = "*" in cors_origins
        self.cors_origins = {o.rstrip("/").lower() for o in cors_origins if o != "*"}
        self.body_timeout = body_timeout
        self.count_error = count_error or (lambda status: None)

    def _host_allowed(self, host: str | None) -> bool:
        if self.allowed_hosts is None or host is None:  # (HTTP/1.0 without Host: not a browser)
            return True
        name = host_name(host).rstrip(".")
        return is_loopback(name) or name in self.allowed_hosts

    def _cors_allowed(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/").lower() in self.cors_origins

    async def _reply(self, send, status: int, message: str, code: str, extra: list | None = None) -> None:
        self.count_error(status)
        data = error_body(status, message, code)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"connection", b"close"),
            *(extra or []),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        path = scope["path"]
        if len(path) > 1 and path.endswith("/"):
            scope = dict(scope, path=path.rstrip("/") or "/")
            path = scope["path"]

        host = headers.get("host")
        if not self._host_allowed(host):
            return await self._reply(
                send,
                403,
                f"the Host header {quoted(host)} is not a name of this server "
                "(start it with --allowed-host NAME to allow one)",
                "host_not_allowed",
            )

        origin = headers.get("origin")
        cors = []
        if origin is not None:
            same = host is not None and urlsplit(origin).netloc.lower() == host.lower()
            if self._cors_allowed(origin):
                cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            elif not same:
                return await self._reply(
                    send,
                    403,
                    f"requests from the web origin {quoted(origin)} are not allowed "
                    "(start the server with --cors-origin ORIGIN to allow one)",
                    "origin_not_allowed",
                )
            if cors and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                return await self._preflight(send, cors)

        if self.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            if not key_matches(headers.get("authorization", ""), self.api_key):
                return await self._reply(
                    send,
                    401,
                    "missing or incorrect API key: send the header 'Authorization: Bearer KEY'",
                    "invalid_api_key",
                    extra=cors,
                )

        await self._forward(scope, receive, send, headers, cors)

    async def _preflight(self, send, cors: list) -> None:
        headers = [
            *cors,
            (b"access-control-allow-methods", CORS_METHODS.encode()),
            (b"access-control-allow-headers", CORS_HEADERS.encode()),
            (b"access-control-max-age", CORS_MAX_AGE.encode()),
            (b"content-length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async def _forward(self, scope, receive, send, headers: dict, cors: list) -> None:
        """The app, with the body deadline (4) and Connection: close on an early answer (5)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length", "0").strip()
        state = {
            "body_done": not chunked and (not length.isdigit() or int(length) == 0),
            "started": False,
            "timed_out": False,
            "replied": False,
        }

        async def timed_receive():
            if state["body_done"] or state["timed_out"]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                state["timed_out"] = True
                if not state["started"]:
                    state["started"] = state["replied"] = True
                    await self._reply(
                        send,
                        408,
                        f"the request body did not arrive within {self.body_timeout:g} s",
                        "timeout",
                        extra=cors,
                    )
                return {"type": "http.disconnect"}  # the app sees a client that went away
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            return message

        async def guarded_send(message):
            if state["replied"]:
                return  # the 408 went out; the app's late answer goes nowhere
            if message["type"] == "http.response.start":
                state["started"] = True
                extra = list(cors)
                if not state["body_done"]:
                    extra.append((b"connection", b"close"))
                if extra:
                    message = dict(message, headers=[*message.get("headers", []), *extra])
            await send(message)

        await self.app(scope, timed_receive, guarded_send)


def error_body(status: int, message: str, code: str) -> bytes:
    """OpenAI's error body as JSON bytes (also for answers written below ASGI: connections.py)."""
    return json.dumps(p.error_body(status, message, code=code).model_dump()).encode()
