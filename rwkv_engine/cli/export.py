"""`rwkv-engine export MODEL OUT.pte`: an ExecuTorch program for phones and edge devices."""

from __future__ import annotations

import sys

from . import common

HELP = "export a model to an ExecuTorch program (.pte) for phones and edge devices"


def add_arguments(parser) -> None:
    parser.add_argument(
        "model",
        help="model: a .pth / .safetensors file, a Hugging Face model directory, or a Hugging Face Hub id (org/name)",
    )
    parser.add_argument("out", metavar="OUT.pte", help="the program file to write")
    common.add_threads_arg(parser)
    parser.add_argument(
        "--quantization",
        "-q",
        default="fp32",
        choices=["fp32", "q8", "q4"],
        help="weights: fp32; q8 (int8 per row, int8 dynamic activations, block 0 fp32); "
        "q4 (int4 per 32 columns, int8 dynamic activations, blocks 0-1 and the head "
        "int8); the embedding is int8 in q8 and q4 (default: %(default)s)",
    )
    parser.add_argument(
        "--prefill-len",
        type=int,
        default=32,
        metavar="T",
        help="tokens per call of the prefill method; the rest of a prompt goes through decode (default: %(default)s)",
    )
    parser.add_argument(
        "--backend",
        default="xnnpack",
        choices=["xnnpack", "portable"],
        help="xnnpack: delegated to XNNPACK (Android, iOS, Linux ARM / x86); portable: "
        "ExecuTorch's portable kernels only (default: %(default)s)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer whose identity goes into the program's metadata (default: the one the model implies)",
    )


def run(args) -> int:
    import rwkv_engine
    from rwkv_engine.export import export_program

    model = rwkv_engine.load(args.model, dtype="fp32", progress=sys.stderr.isatty())
    tok = None
    if args.tokenizer is not None:
        tok = rwkv_engine.load_tokenizer(model, args.tokenizer)
    print(
        f"exporting {model} ({args.quantization}, {args.backend}, prefill T={args.prefill_len}) ...",
        file=sys.stderr,
        flush=True,
    )
    report = export_program(
        model,
        args.out,
        quantization=args.quantization,
        prefill_len=args.prefill_len,
        backend=args.backend,
        tokenizer=tok,
    )
    meta = report.metadata
    print(f"wrote {report.path}: {report.bytes / 1e6:.1f} MB in {report.seconds:.1f} s")
    print(
        f"methods: decode(tokens [1, 1], *state), prefill(tokens [1, {args.prefill_len}], *state) "
        f"-> (logits [1, {model.config.vocab_size}], *state); initial_state(); rwkv_metadata()"
    )
    print("state: " + ", ".join(f"{s['name']} {s['shape']}" for s in meta["state"]))
    t = meta["tokenizer"]
    print(f"tokenizer: {t.get('kind')} {t.get('file', '')} sha256 {t.get('sha256', '-')[:16]}")
    return 0
