"""`rwkv-engine perplexity MODEL FILE`: how well a model predicts a text file.

The text is tokenized whole, end-of-text (id 0) is put in front as the context of the first
token (as RWKV's own evaluations do), and the model reads it in windows of --chunk tokens with
its state carried across, so the file can be of any length. Perplexity is exp of the mean
negative log-likelihood of every token given all the tokens before it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ..errors import InputError
from ..tokenizer import EOS_TOKEN_ID
from . import common

HELP = "Measure the perplexity of a model on a text file (and the speed it reads it at)."


def add_arguments(parser) -> None:
    common.add_model_args(parser)
    parser.add_argument("file", help="a UTF-8 text file")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per forward (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def perplexity(model, ids: list[int], chunk: int = 512) -> tuple[float, int, float]:
    """(mean NLL in nats, tokens scored, seconds) of ids[1:] given their prefixes."""
    from ..scoring import sequence_nll

    t0 = time.perf_counter()
    nll, n = sequence_nll(model, ids, chunk)
    return nll / n, n, time.perf_counter() - t0


def run(args) -> int:
    path = Path(args.file)
    if args.chunk < 1:
        raise InputError(f"--chunk must be at least 1, got {args.chunk}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    model, tokenizer = common.load_model(args)
    ids = [EOS_TOKEN_ID] + tokenizer.encode(text)
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            raise InputError(f"--max-tokens must be at least 1, got {args.max_tokens}")
        ids = ids[: args.max_tokens + 1]
    if len(ids) < 2:
        raise InputError(f"{path}: no text to score")
    mean_nll, n, seconds = perplexity(model, ids, args.chunk)
    result = {
        "file": str(path),
        "tokens": n,
        "nll_per_token": round(mean_nll, 5),
        "perplexity": round(math.exp(mean_nll), 4),
        "tok_s": round(n / seconds, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{path}: {n} tokens, perplexity {result['perplexity']:.4f} "
            f"(NLL {result['nll_per_token']:.4f} nats/token), {result['tok_s']:.1f} tok/s"
        )
    return 0
