"""`rwkv-engine batch MODEL IN.jsonl OUT.jsonl`: answer a file of OpenAI requests, one per line.

See rwkv_engine/batch.py for the line formats. The requests run through the server's own app in
this process, decoded together by one engine; OUT gets one answer per line of IN, in order, and an
interrupted run resumes where it stopped when started again with the same OUT.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from ..errors import InputError
from . import common
from .serve import _model_name, _non_negative, _positive

HELP = "Answer a JSONL file of OpenAI request bodies, one answer line per request, resumable."


def add_arguments(parser) -> None:
    common.add_model_args(parser)
    parser.add_argument("input", type=Path, help="JSONL file: one request body (or OpenAI Batch API line) per line")
    parser.add_argument("output", type=Path, help="JSONL file of answers; if it exists, the run resumes after its last line")
    parser.add_argument("--served-model-name", metavar="NAME", default=None,
                        help="the model id requests may name; bodies without 'model' get it "
                             "(default: the checkpoint's file or directory name)")
    parser.add_argument("--max-batch", type=_positive, metavar="N", default=8,
                        help="requests decoded together (default: %(default)s)")
    parser.add_argument("--concurrency", type=_positive, metavar="N", default=None,
                        help="requests in flight at once (default: twice --max-batch)")
    parser.add_argument("--prefill-chunk", type=_positive, metavar="N", default=256,
                        help="prompt tokens prefilled between two decode steps (default: %(default)s)")
    parser.add_argument("--state-cache-mb", type=_non_negative, metavar="MB", default=1024,
                        help="memory for cached prompt-prefix states, in MiB; 0 = off (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=_positive, metavar="N", default=16384,
                        help="longest prompt accepted, in tokens (default: %(default)s)")
    parser.add_argument("--max-tokens", type=_positive, metavar="N", default=4096,
                        help="most tokens a request may generate; the chat default (default: %(default)s)")


def make_app(args, model, tokenizer):
    """(app, engine) as `serve` builds them, for in-process requests."""
    from ..serve.app import ServerSettings, create_app
    from ..serve.engine import Engine, EngineConfig

    engine = Engine(model, tokenizer, EngineConfig(
        max_batch=args.max_batch, max_queue=max(64, 4 * args.max_batch), prefill_chunk=args.prefill_chunk,
        state_cache_bytes=args.state_cache_mb << 20,
    ))
    settings = ServerSettings(model_name=args.served_model_name or _model_name(args.model),
                              max_prompt_tokens=args.max_prompt_tokens, max_tokens_cap=args.max_tokens)
    return create_app(engine, settings), engine, settings.model_name


def run(args) -> int:
    from tqdm import tqdm

    from ..batch import AppClient, OutputFile, count_lines, read_lines, resume_point

    if not args.input.is_file():
        raise InputError(f"{args.input}: no such file")
    if args.output.resolve() == args.input.resolve():
        raise InputError("the output file must not be the input file")
    total = count_lines(args.input)
    done = resume_point(args.output)
    if done > total:
        raise InputError(f"{args.output} holds {done} answers but {args.input} has only {total} lines")
    lines = read_lines(args.input, done)
    if done:
        print(f"rwkv-engine batch: {args.output} holds {done} of {total} answers; resuming at line {done + 1}",
              file=sys.stderr, flush=True)
    if not lines:
        print(f"rwkv-engine batch: nothing to do ({total} lines answered)", file=sys.stderr)
        return 0
    model, tokenizer = common.load_model(args)
    app, engine, name = make_app(args, model, tokenizer)
    out = OutputFile(args.output)
    bar = tqdm(total=total, initial=done, desc="batch", unit="req", disable=not sys.stderr.isatty())

    def write(answer: dict) -> None:
        out.write(answer)
        bar.update(1)

    engine.start()
    try:
        asyncio.run(AppClient(app, name).answer_all(lines, write, args.concurrency or 2 * args.max_batch))
    finally:
        engine.stop()
        out.close()
        bar.close()
    print(f"rwkv-engine batch: {out.count} lines answered ({out.ok} ok, {out.errors} errors), "
          f"{done + out.count} of {total} in {args.output}", file=sys.stderr)
    return 0
