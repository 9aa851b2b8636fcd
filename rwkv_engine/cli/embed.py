"""`rwkv-engine embed MODEL INPUT`: embed a file of texts (rwkv_engine/embedding.py).

INPUT is one text a line, or JSONL (by its .jsonl / .ndjson name, or --input-format jsonl): each
line a JSON string or an object with a string "text" (and optionally an "id", copied to the
output). The whole file is read and checked before the model loads, so a bad line costs nothing.
The output is JSONL ({"index", "embedding"}, and "id" where the input had one) on stdout or in
-o FILE, or a float32 [N, D] array in -o FILE.npy, in the input's order.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..errors import InputError
from . import common

HELP = "Embed a file of texts (one a line, or JSONL) into JSONL or a .npy array."

_JSONL_SUFFIXES = (".jsonl", ".ndjson")


def add_arguments(parser) -> None:
    common.add_model_args(parser)
    parser.add_argument("input", help='the texts: one a line, or JSONL (a string or {"text": ...} a line); - for stdin')
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="where the embeddings go: FILE.npy (a float32 array, one row per text) or a JSONL file "
        "(default: JSONL on stdout)",
    )
    parser.add_argument(
        "--input-format",
        choices=("auto", "text", "jsonl"),
        default="auto",
        help="auto (default): JSONL for a .jsonl / .ndjson name, else one text a line",
    )
    parser.add_argument(
        "--task",
        choices=("retr", "cls", "sts"),
        default=None,
        help="an EmbeddingRWKV model's task head: retrieval (default), classification, similarity",
    )
    norm = parser.add_mutually_exclusive_group()
    norm.add_argument(
        "--normalize",
        dest="normalize",
        action="store_true",
        default=None,
        help="scale every embedding to unit length (the default for models other than EmbeddingRWKV)",
    )
    norm.add_argument(
        "--no-normalize", dest="normalize", action="store_false", help="keep the pooled vectors' own lengths"
    )
    parser.add_argument(
        "--batch-tokens",
        type=common.positive_int,
        default=4096,  # embedding.BATCH_TOKENS (this module stays free of torch until run)
        metavar="N",
        help="texts per forward: at most N tokens of rows x the longest (default: %(default)s)",
    )


def read_texts(name: str, fmt: str) -> tuple[list[str], list]:
    """(texts, ids: each JSONL object's "id" or None) of the input; InputError naming the line."""
    try:
        data = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
    except IsADirectoryError:
        raise InputError(f"{name}: is a directory, not a file of texts") from None
    except FileNotFoundError:
        raise InputError(f"{name}: no such file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    jsonl = fmt == "jsonl" or (fmt == "auto" and name.lower().endswith(_JSONL_SUFFIXES))
    texts, ids = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if jsonl:
            if not line.strip():
                continue  # (blank lines between JSON values are no texts)
            line, ident = _json_line(name, n, line)
        else:
            ident = None
        if not line.strip():
            raise InputError(f"{name} line {n}: the text is empty (one text a line)")
        texts.append(line)
        ids.append(ident)
    if not texts:
        raise InputError(f"{name}: no texts")
    return texts, ids


def _json_line(name: str, n: int, line: str) -> tuple[str, object]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{name} line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(value, str):
        return value, None
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return value["text"], value.get("id")
    raise InputError(f'{name} line {n}: expected a JSON string or an object with a string "text"')


def run(args) -> int:
    from tqdm import tqdm

    from ..embedding import embed_ids, encode

    if args.output is not None and args.input != "-" and Path(args.output).resolve() == Path(args.input).resolve():
        raise InputError("the output file must not be the input file")
    texts, ids = read_texts(args.input, args.input_format)
    model, tokenizer = common.load_model(args)
    seqs = encode(model, tokenizer, texts)
    tokens = sum(map(len, seqs))
    bar = tqdm(total=len(seqs), desc="embed", unit="text", disable=not sys.stderr.isatty())
    t0 = time.perf_counter()
    try:
        vectors = embed_ids(model, seqs, args.task, args.normalize, args.batch_tokens, bar.update)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    _write(args.output, vectors, ids)
    print(
        f"rwkv-engine embed: {len(seqs)} texts ({tokens} tokens) into {vectors.shape[1]} dimensions in "
        f"{seconds:.1f} s ({tokens / max(seconds, 1e-9):.0f} tokens/s)" + (f" -> {args.output}" if args.output else ""),
        file=sys.stderr,
        flush=True,
    )
    return 0


def _write(output: str | None, vectors, ids: list) -> None:
    if output is not None and output.lower().endswith(".npy"):
        import numpy as np

        np.save(output, vectors.numpy())
        return
    out = sys.stdout if output is None else open(output, "w", encoding="utf-8")
    try:
        for i, row in enumerate(vectors.tolist()):
            line = {"index": i, "embedding": row}
            if ids[i] is not None:
                line["id"] = ids[i]
            out.write(json.dumps(line) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
