"""`rwkv-engine generate MODEL`: continue a prompt and stream the text to stdout.

The prompt comes from --prompt, --prompt-file or stdin, and is used exactly as given (no
trailing newline is stripped or added). Generation ends at end-of-text (token 0), at a --stop
string (not printed) or after --max-tokens. Sampling defaults are the `rwkv` pip package's
PIPELINE_ARGS (docs/formats.md D): temperature 1.0, top-p 0.85, presence and frequency penalty 0.2,
decay 0.996.

--json-schema FILE makes the output JSON that validates against the schema in FILE, --json any
JSON object (constrained decoding, rwkv_engine/structured.py); the output then ends when the JSON
is complete (or at --max-tokens, with the JSON cut short: --stats says finish: length).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ..errors import InputError
from ..sampling_params import COMPLETION
from . import common

HELP = "Continue a prompt with an RWKV model, streaming the text to stdout."

# SamplingParams fields: the completion preset
DEFAULTS = dataclasses.asdict(COMPLETION.replace(max_tokens=200))


def add_arguments(parser) -> None:
    common.add_model_args(parser)
    common.add_state_arg(parser)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", "-p", metavar="TEXT", help="the prompt (default: read stdin)")
    source.add_argument("--prompt-file", "-f", metavar="FILE", help="read the prompt from a UTF-8 file")
    common.add_sampling_args(parser, DEFAULTS)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="FILE",
        help="constrain the output to JSON that validates against the JSON schema in FILE",
    )
    shape.add_argument("--json", action="store_true", help="constrain the output to a JSON object")
    common.add_speculative_args(parser)
    parser.add_argument(
        "--stats", action="store_true", help="print token counts, speeds and the finish reason to stderr at the end"
    )


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{args.prompt_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise InputError("no prompt: give --prompt TEXT or --prompt-file FILE, or pipe the prompt on stdin")
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as e:
        raise InputError(f"stdin: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_schema(path: str | None):
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--json-schema {path}: cannot read it ({e})") from None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise InputError(f"--json-schema {path}: not valid JSON ({e})") from None
    from ..structured import check_json_schema

    check_json_schema(schema)
    return schema


def run(args) -> int:
    from ..generation import generate

    # Check everything the user typed before the (slow) model load.
    params = common.sampling_params(args, DEFAULTS)
    common.check_speculative_args(args)
    if args.json_schema is not None or args.json:
        params = params.replace(json_schema=read_schema(args.json_schema), json_object=args.json)
    prompt = read_prompt(args)
    if not prompt:
        raise InputError("the prompt is empty: there is nothing to continue")
    model, tokenizer = common.load_model(args)
    drafter = common.load_drafter(args, model)
    gen = generate(model, tokenizer, prompt, params, speculative=drafter, max_draft=args.max_draft)
    out = sys.stdout
    for chunk in gen:
        out.write(chunk)
        out.flush()
    if out.isatty() and not gen.text.endswith("\n"):
        out.write("\n")
    out.flush()
    if args.stats:
        s = gen.stats
        print(
            f"prompt: {s.prompt_tokens} tokens, {s.prefill_tokens_per_second:.1f} tok/s; "
            f"generated: {s.generated_tokens} tokens, {s.decode_tokens_per_second:.1f} tok/s; "
            f"finish: {s.finish_reason}",
            file=sys.stderr,
        )
        if s.speculative is not None:
            print(common.speculative_line(s.speculative), file=sys.stderr)
    return 0
