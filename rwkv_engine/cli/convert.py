"""`rwkv-engine convert SRC OUT`: write a model as an rwkv-engine directory, quantized or in another dtype.

The directory holds config.json (with the scheme), model.safetensors (packed weights, every
load-time transform already applied) and the tokenizer. `rwkv_engine.load(OUT)` maps it in
without transforming or quantizing again. OUT must not exist; the directory appears only when
it is complete, so an interrupted convert leaves nothing that loads.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from . import common

HELP = "Convert a checkpoint to an rwkv-engine directory (quantized, or in another dtype)."


def add_arguments(parser) -> None:
    common.add_model_args(parser, device=False)  # (it converts on the CPU; the output loads on any device)
    parser.add_argument("out", help="output directory (must not exist)")


def _tokenizer_file(path: Path, vocab_size: int, args) -> Path | None:
    """The tokenizer file to ship beside the weights."""
    if args.tokenizer:
        p = Path(args.tokenizer)
        return p / "tokenizer.json" if p.is_dir() else p
    src = path if path.is_dir() else path.parent
    if (src / "tokenizer.json").is_file():
        return src / "tokenizer.json"
    if vocab_size == 65536:
        from ..tokenizer.world import DEFAULT_VOCAB_PATH

        return DEFAULT_VOCAB_PATH
    return None


def run(args) -> int:
    import torch

    from ..loading import converted, prepare

    out = Path(args.out)
    if out.exists():
        raise InputError(f"{out}: already exists; choose a new output directory")
    if not out.resolve().parent.is_dir():
        raise InputError(f"{out.parent}: no such directory")
    plan = prepare(args.model, "cpu", args.dtype, quantization=args.quantization, group_size=args.group_size)
    model = plan.model
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"{args.model} is an exported program; convert the checkpoint it was exported from")
    converted.convert(plan, out, _tokenizer_file(model.path, model.config.vocab_size, args))
    size = sum(f.stat().st_size for f in out.iterdir())
    scheme = model.quantization.name if model.quantization else "none"
    print(
        f"wrote {out} (RWKV-{model.config.version}, {str(model.dtype).removeprefix('torch.')} [{model.dtype_reason}], "
        f"quantization {scheme}, {size / 1e6:.1f} MB)"
    )
    return 0
