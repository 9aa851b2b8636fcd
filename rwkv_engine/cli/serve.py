"""`rwkv-engine serve MODEL`: an OpenAI-compatible HTTP server (see docs/server.md).

Loads the model, starts the engine (rwkv_engine/serve/engine.py) and serves the FastAPI app
(rwkv_engine/serve/app.py) with uvicorn on --host:--port, 127.0.0.1:8000 by default. The
listening address is printed on stderr once the socket is bound ("--port 0" picks a free port).

The port is open before the model has warmed up: /health answers 503 {"status": "starting"}
until the engine's warm-up forward (which builds or loads the native kernels) is done.

SIGTERM (or Ctrl-C) shuts down gracefully: no new connections; requests in flight finish (for at
most --shutdown-timeout seconds; then the engine stops, and each request still running ends
with an error: a stream gets an error event and `data: [DONE]`); exit status 0 for SIGTERM.

Exposure (docs/server.md, "Security"): the API key comes from --api-key, --api-key-file or the
RWKV_ENGINE_API_KEY environment variable; a bind outside loopback without a key gets a loud
warning; the request checks (Host, Origin, key, body deadline) are serve/security.py's, the
connection cap and header deadline serve/connections.py's.

This module only turns the flags into a `settings.Config` (`config`), each flag's default read
from its field there: the server is assembled by serve/server.py and run by serve/launch.py (or
serve/ray.py with --ray).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..settings import (
    CPU_MAX_BATCH,
    CUDA_MAX_BATCH,
    ChatSettings,
    Config,
    EngineConfig,
    Limits,
    RequestDefaults,
    ServerSettings,
)
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


def _max_batch(text: str) -> int:
    """--max-batch N, or "auto" (the default): CUDA_MAX_BATCH where torch sees a GPU, else CPU_MAX_BATCH."""
    if text != "auto":
        return _positive(text)
    import torch

    return CUDA_MAX_BATCH if torch.cuda.is_available() else CPU_MAX_BATCH


_non_negative = _int_at_least(0)


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (a larger one made the bind raise OverflowError)."""
    import argparse

    value = _non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {text!r}")
    return value


def _seconds(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _share(text: str) -> float:
    """An argparse type: a finite number >= 0 (--prefill-share)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_arguments(parser) -> None:
    # The model flags every command shares, --quantization / --group-size included: the engine
    # serves whatever model `common.load_model` returns (see `build`).
    common.add_model_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default=ServerSettings.host,
        help="address to listen on; 0.0.0.0 exposes the server to the network (default: %(default)s)",
    )
    g.add_argument(
        "--port",
        type=_port,
        default=ServerSettings.port,
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
        default=ServerSettings.shutdown_timeout,
        metavar="SECONDS",
        help="on SIGTERM, wait this long for requests in flight (default: %(default)s)",
    )
    s = parser.add_argument_group("exposure (see docs/server.md, Security)")
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
        default=ServerSettings.header_timeout,
        metavar="SECONDS",
        help="close a connection whose request headers are not complete this long after their first "
        "byte (default: %(default)g)",
    )
    s.add_argument(
        "--write-timeout",
        type=_seconds,
        default=ServerSettings.write_timeout,
        metavar="SECONDS",
        help="close a connection whose client reads none of a queued answer for this long (default: %(default)g)",
    )
    s.add_argument(
        "--body-timeout",
        type=_seconds,
        default=ServerSettings.body_timeout,
        metavar="SECONDS",
        help="answer 408 to a request whose body is not complete this long after its headers (default: %(default)g)",
    )
    s.add_argument(
        "--max-connections",
        type=_positive,
        default=ServerSettings.max_connections,
        metavar="N",
        help="most open connections; one more is answered 503 and closed (default: %(default)s)",
    )
    g.add_argument(
        "--log-level",
        default=ServerSettings.log_level,
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level (default: %(default)s)",
    )
    add_engine_arguments(parser)
    r = parser.add_argument_group("scale-out on Ray (needs the [ray] extra)")
    r.add_argument(
        "--ray",
        action="store_true",
        help="serve with Ray Serve: --replicas engine replicas behind one endpoint, routed by prompt prefix "
        "(a rerank by its documents)",
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
        type=_max_batch,
        metavar="N",
        default="auto",
        help=f"most sequences (choices of requests) decoded together in one batched forward, and most "
        f"prompts read at once (default: {CUDA_MAX_BATCH} where CUDA is available: one CUDA graph replay; "
        f"else {CPU_MAX_BATCH})",
    )
    e.add_argument(
        "--max-queue",
        type=_positive,
        metavar="N",
        default=EngineConfig.max_queue,
        help="most requests waiting beyond the --max-batch running ones; more get 429 (default: %(default)s)",
    )
    e.add_argument(
        "--prefill-chunk",
        type=_positive,
        metavar="N",
        default=EngineConfig.prefill_chunk,
        help="most prompt tokens prefilled between two decode steps; also the prompt-cache "
        "granularity (default: %(default)s)",
    )
    e.add_argument(
        "--prefill-share",
        type=_share,
        metavar="R",
        default=EngineConfig.prefill_share,
        help="where prefill and decode take turns (--prefill-threads 0, one thread, a GPU): while streams "
        "decode, prefill between two decode steps for about R times a decode step's time (measured as "
        "the engine runs; at least a 32-token piece, at most --prefill-chunk), so streams get their "
        "tokens at an even pace while new prompts are read; 0 = always --prefill-chunk tokens "
        "(default: %(default)s)",
    )
    e.add_argument(
        "--prefill-threads",
        type=_non_negative,
        metavar="N",
        default=None,
        help="on the CPU, while streams decode and prompts wait, read the prompts on N of the threads "
        "beside the decode steps on the others, so the streams' tokens never wait for a prompt; 0 = "
        "prefill and decode take turns on all threads (default: half the threads, where there are at "
        "least two). Where a prompt's bits depend on the thread count (checked at start-up: AMX "
        "GEMMs), every prompt is read on N threads, so that no answer depends on the load",
    )
    e.add_argument(
        "--state-cache-mb",
        type=_non_negative,
        metavar="MB",
        default=EngineConfig.state_cache_bytes >> 20,
        help="memory for cached prompt-prefix states, in MiB; 0 = off (default: %(default)s)",
    )
    e.add_argument(
        "--state-store",
        metavar="DIR",
        type=Path,
        default=None,
        help="also keep the prompt-cache states in this directory (created if missing; one safetensors "
        "file per state, written in the background): conversations resume after a restart, and on other "
        "servers of the same model sharing the directory (default: memory only)",
    )
    e.add_argument(
        "--state-store-mb",
        type=_non_negative,
        metavar="MB",
        default=EngineConfig.state_store_bytes >> 20,
        help="most MiB of state files in --state-store; the least recently used go first (default: %(default)s)",
    )
    e.add_argument(
        "--max-prompt-tokens",
        type=_positive,
        metavar="N",
        default=Limits.max_prompt_tokens,
        help="longest prompt accepted, in tokens (default: %(default)s)",
    )
    e.add_argument(
        "--max-tokens",
        type=_positive,
        metavar="N",
        default=Limits.max_tokens,
        help="most tokens a request may generate; the default of chat requests (default: %(default)s)",
    )
    e.add_argument(
        "--max-body-kb",
        type=_positive,
        metavar="KB",
        default=Limits.max_body_bytes >> 10,
        help="largest request body, in KiB (default: %(default)s)",
    )
    m = parser.add_argument_group("embeddings and reranking (/v1/embeddings, /v1/rerank; docs/server.md)")
    m.add_argument(
        "--reranker",
        metavar="FILE",
        default=EngineConfig.reranker,
        help="an EmbeddingRWKV reranker checkpoint (the model must be its embedder): serves /v1/rerank",
    )
    m.add_argument(
        "--rerank-instruction",
        metavar="TEXT",
        default=EngineConfig.rerank_instruction,
        help="the reranker's instruction (default: the one it was trained with)",
    )
    m.add_argument(
        "--embedding-task",
        choices=("retr", "cls", "sts"),
        default=RequestDefaults.embedding_task,
        help="an EmbeddingRWKV model's task head for requests that name none (default: retr)",
    )
    m.add_argument(
        "--max-embedding-inputs",
        type=_positive,
        metavar="N",
        default=Limits.max_embedding_inputs,
        help="most inputs of one embeddings request, documents of one rerank (default: %(default)s)",
    )
    from ..sampling_params import SamplingParams

    d = parser.add_argument_group(
        "request defaults (what a request's omitted sampling fields take: the OpenAI API's unless set here)"
    )
    common.add_distribution_args(d, SamplingParams())
    common.add_speculative_args(parser)
    add_chat_arguments(parser)


def add_chat_arguments(parser) -> None:
    """How chat requests become prompts: `serve` and `batch` share them."""
    c = parser.add_argument_group("chat template and thinking (see docs/server.md)")
    common.add_template_arg(c)
    c.add_argument(
        "--think",
        choices=["on", "off"],
        default=common.on_off(ChatSettings.think),
        help="whether a reasoning model (G1) thinks when a chat request does not say "
        "(reasoning_effort, chat_template_kwargs.enable_thinking) (default: %(default)s)",
    )


def chat_settings(args) -> ChatSettings:
    """The chat flags (`add_chat_arguments`) as `ChatSettings`."""
    return ChatSettings(template=args.chat_template, think=args.think == "on")


def engine_config(args) -> EngineConfig:
    """The engine flags (`add_engine_arguments`) as an `EngineConfig`."""
    return EngineConfig(
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk,
        prefill_share=args.prefill_share,
        prefill_threads=args.prefill_threads,
        state_cache_bytes=args.state_cache_mb << 20,
        state_store=state_store(args.state_store),
        state_store_bytes=args.state_store_mb << 20,
        speculative=args.speculative,
        draft=args.draft,
        draft_quantization=args.draft_quantization,
        max_draft=args.max_draft,
        reranker=args.reranker,
        rerank_instruction=args.rerank_instruction,
    )


def state_store(path: Path | None) -> str | None:
    """--state-store as an absolute path (Ray replicas may run elsewhere), created if missing."""
    if path is None:
        return None
    if path.exists() and not path.is_dir():
        raise InputError(f"--state-store {path}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--state-store {path}: cannot create it ({e.strerror})") from None
    return str(path.resolve())


def limits(args) -> Limits:
    """The request limits (`add_engine_arguments`) as `Limits`."""
    return Limits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens,
        max_body_bytes=args.max_body_kb << 10,
        max_embedding_inputs=args.max_embedding_inputs,
    )


def config(args, environ=None) -> Config:
    """serve's parsed flags as a `Config` (the API key read from where the flags say)."""
    import os

    from ..serve.security import api_key

    if args.state_dir is not None and not args.state_dir.is_dir():
        raise InputError(f"--state-dir {args.state_dir}: not a directory")
    server = ServerSettings(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=api_key(args.api_key, args.api_key_file, os.environ if environ is None else environ),
        state_dir=args.state_dir,
        allowed_hosts=tuple(args.allowed_host),
        cors_origins=tuple(args.cors_origin),
        header_timeout=args.header_timeout,
        write_timeout=args.write_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
    )
    defaults = RequestDefaults(sampling=common.distribution_params(args), embedding_task=args.embedding_task)
    return Config(common.model_spec(args), engine_config(args), limits(args), server, defaults, chat_settings(args))


def parse(argv: list[str]):
    """(Config, args) from serve's command line without the command name (MODEL first)."""
    parser = common.ArgumentParser(prog="rwkv-engine serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return config(args), args


def run(args) -> int:
    cfg = config(args)
    if args.ray:
        from ..serve.ray import run_cli

        return run_cli(cfg, replicas=args.replicas, replica_cpus=args.replica_cpus, address=args.ray_address)
    from ..serve.launch import run as launch

    return launch(cfg)
