"""`rwkv-engine verify MODEL [--against ...]`: layer-by-layer error of one configuration against another."""

from __future__ import annotations

import json
import sys

HELP = "compare two configurations of a model layer by layer (dtype, quantization, .pte, the rwkv package)"

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. In a shocking finding, scientists discovered"


def add_arguments(parser) -> None:
    from .common import add_model_args

    add_model_args(parser)
    parser.add_argument(
        "--against",
        default="fp32",
        metavar="REF",
        help="the reference: fp32 / bf16 / fp16 (the checkpoint in that dtype), a quantization "
        "scheme (q8, q4, ...), rwkv (the official rwkv package, fp32; a .pth only), or the "
        "path of an exported .pte (default: %(default)s)",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: a fixed English sentence)")
    parser.add_argument(
        "--prompt-ids", default=None, metavar="IDS", help="the prompt as comma-separated token ids instead of text"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=16,
        metavar="N",
        help="decode steps after the prompt, fed the reference's greedy tokens (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _describe(args) -> str:
    parts = [args.dtype or "", args.quantization or ""]
    return "as loaded" + (f" ({', '.join(p for p in parts if p)})" if any(parts) else " (fp32)")


def run(args) -> int:
    import rwkv_engine
    from rwkv_engine.errors import InputError
    from rwkv_engine.loading.formats import DTYPES
    from rwkv_engine.verify import compare, format_report, greedy_tokens, trace_model, trace_rwkv_package

    if args.steps < 0:
        raise InputError("--steps must be >= 0")
    subject = rwkv_engine.load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        group_size=args.group_size,
        progress=False,
    )
    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    else:
        prompt = rwkv_engine.load_tokenizer(subject, args.tokenizer).encode(args.prompt)
    if not prompt:
        raise InputError("the prompt is empty")
    cfg = subject.config
    ref = args.against
    if ref == "rwkv":
        reference, steps = trace_rwkv_package(subject.path, cfg.family, cfg.n_layer, prompt, args.steps)
    else:
        if ref.lower() in DTYPES:
            other = rwkv_engine.load(args.model, device=args.device, dtype=ref, progress=False)
        elif ref.endswith(".pte"):
            other = rwkv_engine.load(ref)
        else:
            other = rwkv_engine.load(args.model, device=args.device, quantization=ref, progress=False)
        if other.config != cfg:
            raise InputError(f"{ref} is another model ({other.config.state_signature()}), not {cfg.state_signature()}")
        steps = greedy_tokens(other, prompt, args.steps)
        reference = trace_model(other, prompt, steps)
        del other
    report = compare(trace_model(subject, prompt, steps), reference)
    report.update(model=str(args.model), subject=_describe(args), reference=ref, prompt_tokens=len(prompt))
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(format_report(report, _describe(args), ref))
    return 0
