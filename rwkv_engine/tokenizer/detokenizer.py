"""Streaming detokenization that never splits a UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from rwkv_engine.errors import TokenizerError


class IncrementalDetokenizer:
    """Turns token ids, fed one at a time, into text, for streaming generation.

        detok = IncrementalDetokenizer(tokenizer)
        for token_id in generated:
            print(detok.push(token_id), end="", flush=True)
        print(detok.flush())

    A token can end in the middle of a UTF-8 character (emoji and CJK are often split over two or
    three byte-level tokens). `push` returns only whole characters and keeps an incomplete tail
    (at most 3 bytes) until the bytes that complete it arrive; it never drops one. Bytes that can
    never become valid UTF-8 (a stray continuation byte, an invalid lead byte, a sequence broken
    by a byte that cannot continue it) come out at once as U+FFFD, one per invalid sequence.
    `flush` emits what is left, with U+FFFD for a tail that was never completed, and resets.

    The concatenation of every `push` and the final `flush` equals `tokenizer.decode(all_ids)`
    for the World tokenizer (both use Python's errors="replace" rule).

    `tokenizer` needs `decode_bytes(ids) -> bytes` returning the exact bytes of the tokens
    (WorldTokenizer; HFTokenizer with a byte-level decoder).
    """

    def __init__(self, tokenizer):
        if not callable(getattr(tokenizer, "decode_bytes", None)):
            raise TokenizerError(
                f"{type(tokenizer).__name__} has no decode_bytes(); streaming needs byte-exact decoding"
            )
        if getattr(tokenizer, "byte_exact", True) is False:
            raise TokenizerError(
                f"{tokenizer!r} cannot decode single tokens to exact bytes (no byte-level decoder), "
                "so it cannot be streamed without splitting characters"
            )
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token id; return the text that is now complete (maybe "")."""
        return self._decoder.decode(self.tokenizer.decode_bytes([token_id]))

    def push_many(self, token_ids: Iterable[int]) -> str:
        """Add several token ids at once; same result as pushing them one by one."""
        return self._decoder.decode(self.tokenizer.decode_bytes(list(token_ids)))

    def flush(self) -> str:
        """Emit the held tail (U+FFFD for an incomplete character) and start over."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text

    def reset(self) -> None:
        """Drop any held bytes without emitting them."""
        self._decoder.reset()

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they may be the start of a character."""
        return self._decoder.getstate()[0]
