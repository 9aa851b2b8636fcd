"""A Hugging Face `tokenizer.json` behind the WorldTokenizer interface (RWKV-4 Pile / Raven models).

RWKV-4 Pile models use the GPT-NeoX-20B tokenizer (`20B_tokenizer.json`): byte-level BPE, NFC
normalization, 50,277 ids, "\\n" = 187, "\\n\\n" = 535, <|endoftext|> = 0 (docs/formats.md,
section C.2). Encoding and `decode` are done by the `tokenizers` package itself; this wrapper adds
id range checks, byte-exact `decode_bytes` for byte-level tokenizers (what streaming needs) and
the trailing-"\\n\\n" fix of ChatRWKV.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from rwkv_engine.errors import TokenizerError

_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2 style): printable character -> the byte it stands for.

    Bytes that are printable and not a space keep their own Latin-1 character ('!'..'~',
    '¡'..'¬', '®'..'ÿ'); the other 68 bytes, in increasing order, take the characters U+0100,
    U+0101, ... so that every token is printable text.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        steps = decoder.get("decoders") or []
        return len(steps) == 1 and _is_byte_level(steps[0])
    return False


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json with the WorldTokenizer interface.

    Args:
        path: a tokenizer.json file.

    `encode` never adds special tokens (no BOS/EOS), as ChatRWKV does for RWKV-4. `decode` is the
    `tokenizers` decode with special tokens (e.g. <|endoftext|>) skipped. `encode_bytes` needs
    valid UTF-8 (this tokenizer encodes text). `decode_bytes` is exact for byte-level BPE
    tokenizers (`byte_exact` is True), such as GPT-NeoX-20B; for others it is
    `decode(ids).encode()` and streaming is refused. Ids outside [0, vocab_size) raise
    TokenizerError; ids inside that range that name no token (gaps) decode to nothing.
    """

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - a declared dependency
            raise TokenizerError("reading tokenizer.json needs the 'tokenizers' package") from None
        self.path = Path(path)
        try:
            text = self.path.read_text(encoding="utf-8")
            spec = json.loads(text)
            self._tok = Tokenizer.from_str(text)
        except OSError as e:
            raise TokenizerError(f"cannot read the tokenizer {self.path}: {e.strerror or e}") from None
        except Exception as e:  # json errors and the tokenizers package's own Exception
            raise TokenizerError(f"{self.path} is not a valid Hugging Face tokenizer.json: {e}") from None
        if not isinstance(spec, dict):
            raise TokenizerError(f"{self.path} is not a Hugging Face tokenizer.json")

        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise TokenizerError(f"{self.path}: the tokenizer has no tokens")
        self.vocab_size: int = max(vocab.values()) + 1
        added = {int(t["id"]): t for t in spec.get("added_tokens") or []}
        self._special_ids = frozenset(i for i, t in added.items() if t.get("special"))
        self.eos_token_id: int | None = next(
            (vocab[name] for name in _EOS_NAMES if name in vocab and vocab[name] in self._special_ids),
            None,
        )
        self.byte_exact: bool = _is_byte_level(spec.get("decoder"))
        self._table: list[bytes] | None = None
        if self.byte_exact:
            self._table = self._byte_table(vocab)

        newline, double_newline = self.encode("\n"), self.encode("\n\n")
        self._newline_fix = (
            (double_newline[0], [newline[0], newline[0]]) if len(newline) == 1 and len(double_newline) == 1 else None
        )

    def _byte_table(self, vocab: dict[str, int]) -> list[bytes]:
        """Exact bytes per id: what the ByteLevel decoder does, token by token.

        A token whose characters are all in the byte-level alphabet stands for those bytes; any
        other token (added tokens such as runs of spaces) stands for its own UTF-8 text. Special
        tokens give b"" because `decode` skips them.
        """
        alphabet = byte_level_alphabet()
        table = [b""] * self.vocab_size
        for token, idx in vocab.items():
            if idx in self._special_ids:
                continue
            try:
                table[idx] = bytes([alphabet[c] for c in token])
            except KeyError:
                table[idx] = token.encode("utf-8")
        return table

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, not {type(text).__name__}; use encode_bytes() for bytes")
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except Exception as e:  # e.g. a lone surrogate, which is not valid text
            raise TokenizerError(f"cannot encode the text: {e}") from None

    def encode_bytes(self, data: bytes | bytearray | memoryview) -> list[int]:
        """Token ids of UTF-8 bytes; invalid UTF-8 raises TokenizerError."""
        if isinstance(data, str):
            raise TokenizerError("encode_bytes() takes bytes, not str; use encode() for text")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(
                f"{self.path.name} encodes text and the bytes are not valid UTF-8 (offset {e.start})"
            ) from None
        return self.encode(text)

    def _check(self, ids: Iterable[int]) -> list[int]:
        try:
            checked = [int(i.__index__()) for i in ids]
        except (AttributeError, TypeError):
            raise TokenizerError("token ids must be ints") from None
        if checked and (min(checked) < 0 or max(checked) >= self.vocab_size):
            m, bad = next((m, i) for m, i in enumerate(checked) if not 0 <= i < self.vocab_size)
            raise TokenizerError(f"token id {bad} at position {m} is outside [0, {self.vocab_size})")
        return checked

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the tokens (`tokenizers` decode, special tokens skipped)."""
        return self._tok.decode(self._check(ids), skip_special_tokens=True)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Exact bytes of the tokens for byte-level tokenizers; else decode(ids) as UTF-8."""
        checked = self._check(ids)
        if self._table is None:
            return self.decode(checked).encode("utf-8")
        return b"".join(map(self._table.__getitem__, checked))

    def fix_trailing_newlines(self, ids: Sequence[int]) -> list[int]:
        """Replace a trailing "\\n\\n" token (535 in GPT-NeoX) by two "\\n" tokens ([187, 187]).

        RWKV-4 Pile / Raven chat models saw "\\n\\n" as two newline tokens, but the tokenizer
        makes one token of it at the end of a prompt; ChatRWKV and RWKV-Runner fix the prompt
        this way. A no-op when "\\n" or "\\n\\n" is not a single token.
        """
        ids = list(ids)
        if self._newline_fix is not None and ids and ids[-1] == self._newline_fix[0]:
            ids[-1:] = self._newline_fix[1]
        return ids
