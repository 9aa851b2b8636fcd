"""`rwkv-engine serve MODEL`: an OpenAI-compatible HTTP server (see docs/server.md).

Loads the model, starts the engine (rwkv_engine/serve/engine.py) and serves the FastAPI app
(rwkv_engine/serve/app.py) with uvicorn on --host:--port, 127.0.0.1:8000 by default. The
listening address is printed on stderr once the socket is bound ("--port 0" picks a free port).

The port is open before the model has warmed up: /health answers 503 {"status": "starting"}
until the engine's warm-up forward (which builds or loads the native kernels) is done.

SIGTERM (or Ctrl-C) shuts down gracefully: no new connections; requests in flight finish (for at
most --shutdown-timeout seconds; then the engine stops, and each request still running ends
with an error: a stream gets an error event and `data: [DONE]`); exit status 0 for SIGTERM.

Exposure (README "Security"): the API key comes from --api-key, --api-key-file or the
RWKV_ENGINE_API_KEY environment variable; a bind outside loopback without a key gets a loud
warning; the request checks (Host, Origin, key, body deadline) are serve/security.py's, the
connection cap and header deadline serve/connections.py's.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import sys
import threading
from pathlib import Path

from ..errors import InputError
from . import common

HELP = "Serve an OpenAI-compatible HTTP API (completions, chat completions) with continuous batching."


def _int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, with a one-line message otherwise."""

    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _seconds(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def add_arguments(parser) -> None:
    # The model flags every command shares, --quantization / --group-size included: the engine
    # serves whatever model `common.load_model` returns (see `build`).
    common.add_model_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 exposes the server to the network (default: %(default)s)",
    )
    g.add_argument(
        "--port",
        type=_non_negative,
        default=8000,
        metavar="PORT",
        help="TCP port; 0 = any free port (default: %(default)s)",
    )
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model id of the API (default: the checkpoint's file or directory name)",
    )
    g.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (visible in ps: prefer --api-key-file or "
        "the RWKV_ENGINE_API_KEY environment variable; default: no key)",
    )
    g.add_argument(
        "--api-key-file",
        metavar="PATH",
        type=Path,
        default=None,
        help="read the API key from this file (surrounding whitespace removed)",
    )
    g.add_argument(
        "--state-dir",
        metavar="DIR",
        type=Path,
        default=None,
        help="directory of saved states (State.save files) that requests may start from "
        "with the 'state' field (default: none allowed)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=_non_negative,
        default=30,
        metavar="SECONDS",
        help="on SIGTERM, wait this long for requests in flight (default: %(default)s)",
    )
    s = parser.add_argument_group("exposure (see README, Security)")
    s.add_argument(
        "--allowed-host",
        metavar="NAME",
        action="append",
        default=[],
        help="a Host header name to accept besides localhost, 127.x and [::1] (repeatable; '*' = any). "
        "On a loopback bind other names get 403 (DNS-rebinding protection); on other binds the "
        "Host is checked only when this is given",
    )
    s.add_argument(
        "--cors-origin",
        metavar="ORIGIN",
        action="append",
        default=[],
        help="a web origin (scheme://host[:port]) whose pages may call the API (repeatable; '*' = any; "
        "default: none, pages of other origins get 403)",
    )
    s.add_argument(
        "--header-timeout",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="close a connection whose request headers are not complete this long after their first "
        "byte (default: %(default)g)",
    )
    s.add_argument(
        "--body-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="answer 408 to a request whose body is not complete this long after its headers (default: %(default)g)",
    )
    s.add_argument(
        "--max-connections",
        type=_positive,
        default=512,
        metavar="N",
        help="most open connections; one more is answered 503 and closed (default: %(default)s)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level (default: %(default)s)",
    )
    add_engine_arguments(parser)
    r = parser.add_argument_group("scale-out on Ray (needs the [ray] extra)")
    r.add_argument(
        "--ray",
        action="store_true",
        help="serve with Ray Serve: --replicas engine replicas behind one endpoint, routed by prompt prefix",
    )
    r.add_argument(
        "--replicas",
        type=_positive,
        metavar="N",
        default=2,
        help="with --ray: engine replicas, one model copy each (default: %(default)s)",
    )
    r.add_argument(
        "--ray-address",
        metavar="ADDR",
        default=None,
        help="with --ray: a running Ray cluster to join (default: start a local one)",
    )
    r.add_argument(
        "--replica-cpus",
        type=float,
        metavar="N",
        default=1.0,
        help="with --ray: CPUs Ray reserves for each replica (default: %(default)s)",
    )


def add_engine_arguments(parser) -> None:
    """The engine's flags and the request limits: `serve` and `batch` share them."""
    e = parser.add_argument_group("engine and limits")
    e.add_argument(
        "--max-batch",
        type=_positive,
        metavar="N",
        default=8,
        help="most requests decoded together in one batched forward (default: %(default)s)",
    )
    e.add_argument(
        "--max-queue",
        type=_positive,
        metavar="N",
        default=64,
        help="most requests waiting for a batch slot; more get 429 (default: %(default)s)",
    )
    e.add_argument(
        "--prefill-chunk",
        type=_positive,
        metavar="N",
        default=256,
        help="prompt tokens prefilled between two decode steps; also the prompt-cache "
        "granularity (default: %(default)s)",
    )
    e.add_argument(
        "--state-cache-mb",
        type=_non_negative,
        metavar="MB",
        default=1024,
        help="memory for cached prompt-prefix states, in MiB; 0 = off (default: %(default)s)",
    )
    e.add_argument(
        "--max-prompt-tokens",
        type=_positive,
        metavar="N",
        default=16384,
        help="longest prompt accepted, in tokens (default: %(default)s)",
    )
    e.add_argument(
        "--max-tokens",
        type=_positive,
        metavar="N",
        default=4096,
        help="most tokens a request may generate; the default of chat requests (default: %(default)s)",
    )
    e.add_argument(
        "--max-body-kb",
        type=_positive,
        metavar="KB",
        default=4096,
        help="largest request body, in KiB (default: %(default)s)",
    )


def _model_name(model_arg: str) -> str:
    path = Path(model_arg)
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return model_arg  # a hub id


def api_key(args, environ=os.environ) -> str | None:
    """The API key: --api-key, --api-key-file or $RWKV_ENGINE_API_KEY, in that order (None: no key)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise InputError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            key, source = args.api_key_file.read_text().strip(), f"--api-key-file {args.api_key_file}"
        except (OSError, UnicodeError) as e:
            raise InputError(f"--api-key-file {args.api_key_file}: {getattr(e, 'strerror', None) or e}") from None
    elif args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif "RWKV_ENGINE_API_KEY" in environ:
        key, source = environ["RWKV_ENGINE_API_KEY"], "RWKV_ENGINE_API_KEY"
    else:
        return None
    if not key.strip():
        raise InputError(f"{source}: the API key is empty")
    return key


def exposure_warning(host: str, key: str | None) -> str | None:
    """The warning for a server reachable from other machines with no API key, or None."""
    from ..serve.security import is_loopback

    if key is not None or is_loopback(host):
        return None
    return (
        f"WARNING: listening on {host}, reachable from other machines, with NO API KEY: anyone who can "
        "reach this port can use the model. Set a key (--api-key-file PATH or RWKV_ENGINE_API_KEY), or "
        "listen on 127.0.0.1."
    )


def allowed_hosts(host: str, names: list[str]) -> tuple[str, ...] | None:
    """The Host names accepted besides the loopback ones; None = any (security.Guard)."""
    from ..serve.security import is_loopback

    if "*" in names or not (names or is_loopback(host)):
        return None
    if not is_loopback(host) and host not in ("0.0.0.0", "::", ""):
        names = [*names, host]  # the address it listens on is a name of it too
    return tuple(names)


def _connection_budget(wanted: int) -> int:
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


def _bind(host: str, port: int) -> socket.socket:
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


def build(args, key: str | None = None, progress: bool | None = None):
    """(engine, app, settings): the model the flags name, loaded, and the engine and app over it
    with the API key `key`. What the single server process runs, and what every replica runs
    under --ray and every worker of `rwkv-engine batch`. progress: as `common.load_model`."""
    from ..serve.app import ServerSettings, create_app
    from ..serve.engine import Engine, EngineConfig

    model, tokenizer = common.load_model(args, progress)
    engine = Engine(
        model,
        tokenizer,
        EngineConfig(
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            prefill_chunk=args.prefill_chunk,
            state_cache_bytes=args.state_cache_mb << 20,
        ),
    )
    settings = ServerSettings(
        model_name=args.served_model_name or _model_name(args.model),
        api_key=key,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_cap=args.max_tokens,
        max_body_bytes=args.max_body_kb << 10,
        state_dir=args.state_dir,
        allowed_hosts=allowed_hosts(args.host, args.allowed_host),
        cors_origins=tuple(args.cors_origin),
        body_timeout=args.body_timeout,
    )
    return engine, create_app(engine, settings), settings


def run(args) -> int:
    if args.state_dir is not None and not args.state_dir.is_dir():
        raise InputError(f"--state-dir {args.state_dir}: not a directory")
    key = api_key(args)
    if args.ray:
        from ..serve.ray import run_cli

        return run_cli(args, key)
    # Bound first: a port in use fails before a long model load, and clients that connect
    # meanwhile wait in the backlog (then /health says "starting" until the warm-up is done).
    sock = _bind(args.host, args.port)
    try:
        return _serve(args, key, sock)
    finally:
        sock.close()


def _serve(args, key: str | None, sock: socket.socket) -> int:
    import uvicorn

    from ..serve.connections import guarded_protocol

    engine, app, settings = build(args, key)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"rwkv-engine serve: {settings.model_name} on http://{shown}:{port}/v1 "
        f"(max batch {args.max_batch}, queue {args.max_queue})",
        file=sys.stderr,
        flush=True,
    )
    print(f"rwkv-engine serve: chat page at http://{shown}:{port}/", file=sys.stderr, flush=True)
    warning = exposure_warning(host, key)
    if warning:
        print("\n".join(["", "!" * 78, warning, "!" * 78, ""]), file=sys.stderr, flush=True)

    # The graceful-shutdown backstop comes after the engine has cut what still runs (_Server).
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout + 10,
        lifespan="on",
        access_log=args.log_level in ("info", "debug"),
    )
    config.load()
    config.http_protocol_class = guarded_protocol(
        config.http_protocol_class, _connection_budget(args.max_connections), args.header_timeout
    )
    server = _server_class()(config, engine, args.shutdown_timeout)
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
