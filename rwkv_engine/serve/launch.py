"""Run a built server: bind the socket, serve with uvicorn, shut down gracefully.

The port is bound before the model loads: a port in use fails before a long load, and clients
that connect meanwhile wait in the backlog (then /health says "starting" until the engine's
warm-up is done). SIGTERM (or Ctrl-C) shuts down gracefully: no new connections; requests in
flight finish for at most `shutdown_timeout` seconds, then the engine stops and each request
still running ends with an error (a stream gets an error event and `data: [DONE]`).
"""

from __future__ import annotations

import asyncio
import resource
import signal
import socket
import sys
import threading

from ..settings import Config
from .security import exposure_warning
from .server import build


def run(config: Config) -> int:
    """Bind, load, serve until SIGTERM / Ctrl-C; the exit status (0 after a graceful stop)."""
    sock = bind(config.server.host, config.server.port)
    try:
        return serve(config, sock)
    finally:
        sock.close()


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for sockets made
    # with it, and without TCP_NODELAY a small answer waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def print_banner(name: str, address: str, detail: str, host: str, key: str | None, chat_page: bool = True) -> None:
    """The startup lines on stderr: where the API is, and the exposure warning if there is one."""
    print(f"rwkv-engine serve: {name} on {address}/v1 ({detail})", file=sys.stderr, flush=True)
    if chat_page:
        print(f"rwkv-engine serve: chat page at {address}/", file=sys.stderr, flush=True)
    warning = exposure_warning(host, key)
    if warning:
        print("\n".join(["", "!" * 78, warning, "!" * 78, ""]), file=sys.stderr, flush=True)


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(config: Config, sock: socket.socket) -> int:
    """Build the server and serve it on the bound `sock` until SIGTERM / Ctrl-C."""
    import uvicorn

    from .connections import guarded_protocol

    settings = config.server
    engine, app = build(config)
    host, port = sock.getsockname()[:2]
    print_banner(
        config.model_name,
        url(host, port),
        f"max batch {config.engine.max_batch}, queue {config.engine.max_queue}",
        host,
        settings.api_key,
    )
    # The graceful-shutdown backstop comes after the engine has cut what still runs (_Server).
    uconfig = uvicorn.Config(
        app,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_timeout + 10,
        lifespan="on",
        access_log=settings.log_level in ("info", "debug"),
    )
    uconfig.load()
    uconfig.http_protocol_class = guarded_protocol(
        uconfig.http_protocol_class,
        connection_budget(settings.max_connections),
        settings.header_timeout,
        settings.write_timeout,
    )
    server = _server_class()(uconfig, engine, settings.shutdown_timeout)
    # uvicorn re-raises the signal that stopped it once it is done; with SIGTERM's default
    # action that would kill the process before the engine stops. Catch it instead.
    terminated = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.stop()
    if not server.started:
        return 1
    print("rwkv-engine serve: stopped", file=sys.stderr, flush=True)
    return 0


def connection_budget(wanted: int) -> int:
    """`wanted` connections, or fewer if the open-file limit cannot be raised to hold them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + 128  # (the model files, the log, the listening socket, ...)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
        if soft < need:
            wanted = max(1, soft - 128)
            print(
                f"rwkv-engine serve: the open-file limit is {soft}: at most {wanted} connections",
                file=sys.stderr,
                flush=True,
            )
    return wanted


def _server_class():
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, whose graceful shutdown stops the engine after `cut_after` seconds:
        each request still running then ends with an error ("the server is shutting down"), a
        stream with an error event and `data: [DONE]`, instead of being cancelled mid-stream."""

        def __init__(self, config, engine, cut_after: float):
            super().__init__(config)
            self.engine, self.cut_after = engine, cut_after

        async def shutdown(self, sockets=None):
            stop = lambda: threading.Thread(target=self.engine.stop, daemon=True).start()  # noqa: E731
            cut = asyncio.get_running_loop().call_later(self.cut_after, stop)
            try:
                await super().shutdown(sockets=sockets)
            finally:
                cut.cancel()

    return _Server
