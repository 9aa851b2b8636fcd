"""Limits below HTTP requests: a cap on open connections and a deadline for the request headers.

uvicorn enforces only an idle keep-alive timeout (the time between one answer and the next
request's first byte, --timeout-keep-alive, 5 s) and `limit_concurrency`, which answers 503
once the headers are in but still accepts and holds every connection. A connection that sends
nothing, or half a request line, or half the headers, stays open for good, holding a file
descriptor; enough of them ("slowloris") and the server can take no connection at all.

`guarded_protocol(base, ...)` subclasses uvicorn's HTTP protocol class (httptools or h11; both
keep the request being served in `self.cycle`, a new one per request whose headers are in):

* at most `max_connections` connections are open: one more is answered 503 at once, whatever
  it sends is ignored, and it is closed a second later (closing at once, with its request
  unread, would send a reset that can destroy the answer before the client reads it);
* the headers of each request must be complete within `header_timeout` seconds of its first
  byte (of the connection, for the first request); otherwise the connection is closed. (The
  start of a request sent in the same packet as the previous one, behind it, is not seen
  arriving: uvicorn's keep-alive timeout closes that connection.)
* a response must keep moving: once more than the transport's high-water mark of it is queued
  (uvicorn's `pause_writing`), the queue must shrink within `write_timeout` seconds, again and
  again until it is below the mark; a client that stops reading is cut off (`abort`: its unsent
  bytes are dropped), which frees the memory, the connection and, for a stream, the request.
* a request with both Content-Length and Transfer-Encoding (RFC 9112 6.3: a sign of request
  smuggling through a proxy that reads the other one) is answered, then its connection closed:
  nothing after it on the connection is read as a request.

The body's deadline is the ASGI layer's (security.py), which can answer 408.
"""

from __future__ import annotations

import asyncio

from .security import error_body

REFUSED_LINGER = 1.0  # seconds a connection over the cap stays open after its 503


def _busy_response() -> bytes:
    body = error_body(503, "the server has too many open connections; retry later", "too_many_connections")
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _ambiguous_length(cycle) -> bool:
    names = {name for name, _ in cycle.scope.get("headers", ())}
    return b"content-length" in names and b"transfer-encoding" in names


def guarded_protocol(
    base: type[asyncio.Protocol], max_connections: int, header_timeout: float, write_timeout: float = 30.0
) -> type:
    """`base` (a uvicorn HTTP protocol class) with the connection cap, the header deadline, the
    write progress deadline and the Content-Length + Transfer-Encoding rule."""
    busy = _busy_response()

    class Guarded(base):
        _header_timer: asyncio.TimerHandle | None = None
        _waiting_cycle = None  # self.cycle when the timer was armed: headers pending while unchanged
        _refused = False
        _write_timer: asyncio.TimerHandle | None = None
        _write_queued = 0  # bytes queued when the write timer was armed

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refused = True
                transport.write(busy)
                if transport.can_write_eof():
                    transport.write_eof()
                self.loop.call_later(REFUSED_LINGER, transport.close)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are in
                self._disarm()
                # Every request whose headers came with these bytes: the one started, the ones
                # queued behind it (httptools pipelines them).
                for c in (self.cycle, *(c for c, _ in getattr(self, "pipeline", ()))):
                    if c is not None and _ambiguous_length(c):
                        c.keep_alive = False
            elif self._header_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection

        def connection_lost(self, exc):
            self._disarm()
            self._stop_write_timer()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_queued = self.transport.get_write_buffer_size()
                self._write_timer = self.loop.call_later(write_timeout, self._write_check)

        def resume_writing(self) -> None:
            self._stop_write_timer()
            super().resume_writing()

        def _stop_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_check(self) -> None:
            self._write_timer = None
            if self.transport.is_closing() and self.transport.get_write_buffer_size() == 0:
                return
            queued = self.transport.get_write_buffer_size()
            if queued >= self._write_queued:  # nothing read by the client in write_timeout seconds
                self.transport.abort()
                return
            self._write_queued = queued
            self._write_timer = self.loop.call_later(write_timeout, self._write_check)

        def _arm(self) -> None:
            self._waiting_cycle = self.cycle
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.cycle is self._waiting_cycle and not self.transport.is_closing():
                self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
