"""Pick the tokenizer of a model, and refuse one that cannot fit it."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from rwkv_engine.errors import TokenizerError
from rwkv_engine.tokenizer.hf import HFTokenizer
from rwkv_engine.tokenizer.world import VOCAB_ROWS, WorldTokenizer

_HINT = "pass --tokenizer PATH (a tokenizer.json or a World vocab .txt) or --tokenizer world"


def load_tokenizer(model_or_path, tokenizer: str | os.PathLike | None = None):
    """The tokenizer for a model: a WorldTokenizer or an HFTokenizer.

    Args:
        model_or_path: a loaded model (uses `model.config.vocab_size` and `model.path`, the
            checkpoint file or the model directory), or the path of a checkpoint file or model
            directory (then the vocab size is read from config.json or the safetensors / .pth
            embedding when that is cheap, else it is unknown).
        tokenizer: an explicit choice: "world", or the path of a tokenizer.json (or a directory
            holding one), or of a vocab file in the World format.

    Rules, first match wins:
        1. an explicit `tokenizer`;
        2. a tokenizer.json in the model's directory (RWKV-4 Pile / Hugging Face models);
        3. the World tokenizer when the model has 65536 embedding rows (every World model);
        4. otherwise TokenizerError asking for --tokenizer.

    Then, when the model's vocab size is known, a World tokenizer on a model without 65536
    rows, or any tokenizer with ids beyond the model's rows, raises TokenizerError naming both
    sizes: that mismatch would otherwise crash in the embedding or produce gibberish.
    """
    rows, model_path = _model_info(model_or_path)
    if tokenizer is not None:
        tok = _explicit(tokenizer)
    else:
        model_dir = model_path if model_path.is_dir() else model_path.parent
        if (model_dir / "tokenizer.json").is_file():
            tok = HFTokenizer(model_dir / "tokenizer.json")
        elif rows == VOCAB_ROWS:
            tok = WorldTokenizer()
        elif rows is None:
            raise TokenizerError(
                f"cannot tell which tokenizer {model_path} needs (no tokenizer.json next to it and "
                f"its vocab size is unknown); {_HINT}"
            )
        else:
            raise TokenizerError(
                f"no tokenizer found for {model_path}: it has {rows} embedding rows, which is not a "
                f"World model ({VOCAB_ROWS}), and there is no tokenizer.json in {model_dir}; {_HINT}"
            )
    check_fit(tok, rows, model_path)
    return tok


def check_fit(tok, rows: int | None, model_path: Path | None = None) -> None:
    """Raise TokenizerError when `tok` cannot be the tokenizer of a model with `rows` embedding rows."""
    if rows is None:
        return
    model = f"the model {model_path}" if model_path is not None else "the model"
    if isinstance(tok, WorldTokenizer) and rows != tok.vocab_size:
        raise TokenizerError(
            f"the World tokenizer has {tok.vocab_size} ids but {model} has {rows} embedding rows, "
            f"so it is not a World model; pass its own tokenizer with --tokenizer PATH/tokenizer.json"
        )
    if tok.vocab_size > rows:
        raise TokenizerError(
            f"the tokenizer {tok!r} has {tok.vocab_size} ids but {model} has only {rows} embedding "
            f"rows; it is not this model's tokenizer ({_HINT})"
        )


def _explicit(tokenizer: str | os.PathLike):
    if isinstance(tokenizer, str) and tokenizer.strip().lower() == "world":
        return WorldTokenizer()
    path = Path(tokenizer)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(path / "tokenizer.json")
        raise TokenizerError(f"the tokenizer directory {path} has no tokenizer.json; {_HINT}")
    if not path.is_file():
        raise TokenizerError(f"the tokenizer file {path} does not exist; {_HINT}")
    if path.suffix.lower() == ".json" or _starts_with_brace(path):
        return HFTokenizer(path)
    return WorldTokenizer(path)


def _starts_with_brace(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(64).lstrip().startswith(b"{")
    except OSError:
        return False


def _model_info(model_or_path) -> tuple[int | None, Path]:
    """(embedding rows or None, model path) of a loaded model or a path."""
    if isinstance(model_or_path, (str, os.PathLike)):
        path = Path(model_or_path)
        if not path.exists():
            raise TokenizerError(f"the model path {path} does not exist")
        return _rows_from_path(path), path
    config = getattr(model_or_path, "config", None)
    rows = getattr(config, "vocab_size", None)
    path = getattr(model_or_path, "path", None)
    if path is None:
        raise TokenizerError(
            f"load_tokenizer() takes a loaded model (with .config.vocab_size and .path) or a path, "
            f"not {type(model_or_path).__name__}"
        )
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0):
        raise TokenizerError(f"the model's config.vocab_size is {rows!r}, not a positive int")
    return rows, Path(path)


def _rows_from_path(path: Path) -> int | None:
    """Embedding rows of a checkpoint, when it is cheap to find; None otherwise."""
    try:
        if path.is_dir():
            config = path / "config.json"
            if config.is_file():
                value = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
                return value if isinstance(value, int) and not isinstance(value, bool) else None
            return None
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > 100_000_000:
                    return None
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name == "emb.weight" or name.endswith("embeddings.weight"):
                    return int(entry["shape"][0])
            return None
        if path.suffix == ".pth":
            import torch

            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            emb = state.get("emb.weight") if isinstance(state, dict) else None
            return int(emb.shape[0]) if emb is not None else None
    except Exception:  # an unreadable file only means "unknown" here; the loader reports it
        return None
    return None
