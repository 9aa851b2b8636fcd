"""`rwkv-engine serve MODEL`: an OpenAI-compatible HTTP server (see docs/serve.md).

Loads the model, starts the engine (rwkv_engine/serve/engine.py) and serves the FastAPI app
(rwkv_engine/serve/app.py) with uvicorn on --host:--port, 127.0.0.1:8000 by default. The
listening address is printed on stderr once the socket is bound ("--port 0" picks a free port).

SIGTERM (or Ctrl-C) shuts down gracefully: no new connections; requests in flight finish (for at
most --shutdown-timeout seconds, then they are cancelled); the engine stops; exit status 0 for
SIGTERM.
"""

from __future__ import annotations

import signal
import socket
import sys
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


def add_arguments(parser) -> None:
    # The model flags every command shares, --quantization / --group-size included: the engine
    # serves whatever model `common.load_model` returns.
    common.add_model_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 exposes the server to the network (default: %(default)s)")
    g.add_argument("--port", type=_non_negative, default=8000, metavar="PORT",
                   help="TCP port; 0 = any free port (default: %(default)s)")
    g.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model id of the API (default: the checkpoint's file or directory name)")
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    g.add_argument("--state-dir", metavar="DIR", type=Path, default=None,
                   help="directory of saved states (State.save files) that requests may start from "
                        "with the 'state' field (default: none allowed)")
    g.add_argument("--shutdown-timeout", type=_non_negative, default=30, metavar="SECONDS",
                   help="on SIGTERM, wait this long for requests in flight (default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (default: %(default)s)")
    e = parser.add_argument_group("engine and limits")
    e.add_argument("--max-batch", type=_positive, metavar="N", default=8,
                   help="most requests decoded together in one batched forward (default: %(default)s)")
    e.add_argument("--max-queue", type=_positive, metavar="N", default=64,
                   help="most requests waiting for a batch slot; more get 429 (default: %(default)s)")
    e.add_argument("--prefill-chunk", type=_positive, metavar="N", default=256,
                   help="prompt tokens prefilled between two decode steps; also the prompt-cache "
                        "granularity (default: %(default)s)")
    e.add_argument("--state-cache-mb", type=_non_negative, metavar="MB", default=1024,
                   help="memory for cached prompt-prefix states, in MiB; 0 = off (default: %(default)s)")
    e.add_argument("--max-prompt-tokens", type=_positive, metavar="N", default=16384,
                   help="longest prompt accepted, in tokens (default: %(default)s)")
    e.add_argument("--max-tokens", type=_positive, metavar="N", default=4096,
                   help="most tokens a request may generate; the default of chat requests (default: %(default)s)")
    e.add_argument("--max-body-kb", type=_positive, metavar="KB", default=4096,
                   help="largest request body, in KiB (default: %(default)s)")


def _model_name(model_arg: str) -> str:
    path = Path(model_arg)
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return model_arg  # a hub id


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(args) -> int:
    import uvicorn

    from ..serve.app import ServerSettings, create_app
    from ..serve.engine import Engine, EngineConfig

    if args.state_dir is not None and not args.state_dir.is_dir():
        raise InputError(f"--state-dir {args.state_dir}: not a directory")
    model, tokenizer = common.load_model(args)
    engine = Engine(model, tokenizer, EngineConfig(
        max_batch=args.max_batch, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
        state_cache_bytes=args.state_cache_mb << 20,
    ))
    settings = ServerSettings(
        model_name=args.served_model_name or _model_name(args.model), api_key=args.api_key,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens_cap=args.max_tokens,
        max_body_bytes=args.max_body_kb << 10, state_dir=args.state_dir,
    )
    app = create_app(engine, settings)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"rwkv-engine serve: {settings.model_name} on http://{shown}:{port}/v1 "
          f"(max batch {args.max_batch}, queue {args.max_queue})", file=sys.stderr, flush=True)

    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                            lifespan="on", access_log=args.log_level in ("info", "debug"))
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it is done; with SIGTERM's default
    # action that would kill the process before the engine stops. Catch it instead.
    terminated = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.stop()
        sock.close()
    if not server.started:
        return 1
    print("rwkv-engine serve: stopped", file=sys.stderr, flush=True)
    return 0
