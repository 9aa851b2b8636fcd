"""`rwkv-engine batch MODEL IN.jsonl OUT.jsonl`: answer a file of OpenAI requests, one per line.

See rwkv_engine/batch.py for the line formats. The requests run through the server's own app in
this process, decoded together by one engine; OUT gets one answer per line of IN, in order, and an
interrupted run resumes where it stopped when started again with the same OUT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path

from ..errors import InputError
from . import common, serve

PROGRESS_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal

HELP = "Answer a JSONL file of OpenAI request bodies, one answer line per request, resumable."


def add_arguments(parser) -> None:
    common.add_model_args(parser)
    parser.add_argument("input", type=Path, help="JSONL file: one request body (or OpenAI Batch API line) per line")
    parser.add_argument(
        "output", type=Path, help="JSONL file of answers; if it exists, the run resumes after its last line"
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model id requests may name; bodies without 'model' get it "
        "(default: the checkpoint's file or directory name)",
    )
    parser.add_argument(
        "--concurrency",
        type=serve._positive,
        metavar="N",
        default=None,
        help="requests in flight at once, per worker (default: twice --max-batch)",
    )
    serve.add_engine_arguments(parser)
    # Nobody reads the tokens as they come: whole prefill chunks between decode steps (throughput).
    parser.set_defaults(prefill_share=0.0)
    r = parser.add_argument_group("spread over a Ray cluster (needs the [ray] extra)")
    r.add_argument("--ray", action="store_true", help="run on Ray Data: --workers actors, one model load each")
    r.add_argument(
        "--workers",
        type=serve._positive,
        metavar="N",
        default=2,
        help="with --ray: actors answering lines (default: %(default)s)",
    )
    r.add_argument(
        "--ray-address",
        metavar="ADDR",
        default=None,
        help="with --ray: a running Ray cluster to join (default: start a local one)",
    )
    r.add_argument(
        "--worker-cpus",
        type=float,
        metavar="N",
        default=1.0,
        help="with --ray: CPUs Ray reserves for each worker (default: %(default)s)",
    )


def config(args):
    """The flags as a server `Config`: requests come from this process, so the server settings
    are those of a loopback server with no key (`ServerSettings`'s defaults)."""
    from ..settings import Config, RequestDefaults, ServerSettings

    return Config(
        common.model_spec(args),
        dataclasses.replace(serve.engine_config(args), name="rwkv-engine batch"),
        serve.limits(args),
        ServerSettings(served_model_name=args.served_model_name),
        RequestDefaults(sampling=common.distribution_params(args), embedding_task=args.embedding_task),
        serve.chat_settings(args),
    )


def run(args) -> int:
    from tqdm import tqdm

    from ..batch import AppClient, OutputFile, read_lines, resume_point

    if not args.input.is_file():
        raise InputError(f"{args.input}: no such file")
    if args.output.resolve() == args.input.resolve():
        raise InputError("the output file must not be the input file")
    lines = read_lines(args.input)
    total = len(lines)
    done = resume_point(args.output)
    if done > total:
        raise InputError(f"{args.output} holds {done} answers but {args.input} has only {total} lines")
    lines = lines[done:]
    if done:
        print(
            f"rwkv-engine batch: {args.output} holds {done} of {total} answers; resuming at line {done + 1}",
            file=sys.stderr,
            flush=True,
        )
    if not lines:
        print(f"rwkv-engine batch: nothing to do ({total} lines answered)", file=sys.stderr)
        return 0
    out = OutputFile(args.output)
    bar = tqdm(total=total, initial=done, desc="batch", unit="req", disable=not sys.stderr.isatty())
    started = last = time.monotonic()

    def progress() -> str:
        rate = out.count / max(time.monotonic() - started, 1e-9)
        return f"{done + out.count} of {total} lines, {rate:.2f} lines/s, {out.errors} errors"

    def write(answer: dict) -> None:
        nonlocal last
        out.write(answer)
        bar.update(1)
        if bar.disable and time.monotonic() - last >= PROGRESS_EVERY:  # (a terminal has the bar)
            last = time.monotonic()
            print(f"rwkv-engine batch: {progress()}", file=sys.stderr, flush=True)

    try:
        cfg = config(args)
        concurrency = args.concurrency or 2 * args.max_batch
        if args.ray:
            from ..serve.ray import batch_on_ray

            batch_on_ray(
                cfg,
                lines,
                write,
                workers=args.workers,
                worker_cpus=args.worker_cpus,
                concurrency=concurrency,
                address=args.ray_address,
            )
        else:
            from ..serve.server import build

            engine, app = build(cfg)
            engine.start()
            try:
                client = AppClient(app, cfg.model_name)
                asyncio.run(client.answer_all(lines, write, concurrency))
            finally:
                engine.stop()
    finally:
        out.close()
        bar.close()
    print(
        f"rwkv-engine batch: {out.count} lines answered ({out.ok} ok, {out.errors} errors, "
        f"{out.count / max(time.monotonic() - started, 1e-9):.2f} lines/s), {done + out.count} of {total} in {args.output}",
        file=sys.stderr,
    )
    return 0
