"""`rwkv-engine eval MODEL --tasks T1,T2`: lm-evaluation-harness tasks on the engine.

Runs lm_eval's `simple_evaluate` with `rwkv_engine.evaluation.RWKVEngineLM` (no server, no HTTP)
and prints lm_eval's results table. Needs the `eval` extra: pip install "rwkv-engine[eval]".
Standard tasks (lambada_openai, piqa, hellaswag, ...) download their data sets from the Hugging
Face Hub on first use; `--include-path DIR` adds task YAMLs of your own (e.g. local JSON files).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import InputError
from . import common

HELP = "Run lm-evaluation-harness tasks on a model (needs the [eval] extra)."


def add_arguments(parser) -> None:
    common.add_model_args(parser)
    parser.add_argument("--tasks", required=True, help="comma-separated lm_eval task or group names")
    parser.add_argument(
        "--include-path",
        default=None,
        metavar="DIR",
        help="a directory of task YAMLs of your own, as lm_eval's --include_path",
    )
    parser.add_argument("--num-fewshot", type=int, default=None, metavar="N", help="few-shot examples per prompt")
    parser.add_argument(
        "--limit",
        type=float,
        default=None,
        metavar="N",
        help="only the first N documents of each task (a fraction if below 1)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="N",
        help="sequences decoded together by generate_until tasks (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for few-shot sampling (default: %(default)s)")
    parser.add_argument("--output-path", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument(
        "--log-samples", action="store_true", help="with --output-path: include every request and response in the JSON"
    )
    parser.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        type=common.template_arg,
        default=None,
        help="render each prompt as a chat with this template (lm_eval's apply_chat_template): world, g1, "
        "a Jinja file, or auto (as chat and serve choose; thinking off). Default: plain prompts",
    )


def run(args) -> int:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise InputError("--tasks names no task")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise InputError(f"--include-path {args.include_path}: not a directory")
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.limit is not None and args.limit <= 0:
        raise InputError(f"--limit must be positive, got {args.limit:g}")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    from ..evaluation import RWKVEngineLM, evaluate

    model, tokenizer = common.load_model(args)
    template = None
    if args.chat_template is not None:
        from ..settings import ChatSettings

        template = ChatSettings(args.chat_template).resolve(
            model, args.model, log=lambda line: print(line, file=sys.stderr)
        )
    lm = RWKVEngineLM(model, tokenizer, batch_size=args.batch_size, chat_template=template)
    results = evaluate(
        lm,
        tasks,
        include_path=args.include_path,
        num_fewshot=args.num_fewshot,
        limit=limit,
        seed=args.seed,
        log_samples=args.log_samples,
    )
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output_path:
        keep = results if args.log_samples else {k: v for k, v in results.items() if k != "samples"}
        Path(args.output_path).write_text(json.dumps(keep, indent=2, default=handle_non_serializable))
        print(f"results written to {args.output_path}", file=sys.stderr)
    return 0
