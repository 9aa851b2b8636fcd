"""The RWKV World tokenizer (rwkv_vocab_v20230424.txt), exact twin of the reference TRIE_TOKENIZER.

Encoding is a greedy longest-prefix match over the UTF-8 bytes of the text: at each position take
the longest vocab entry that is a prefix of the remaining bytes, emit its id, advance by its
length (docs/formats.md C.1). Every single byte is a token, so any byte string
encodes. There is no normalization, no pre-splitting and no BOS/EOS insertion.

Two interchangeable matchers do the work, with identical results:

* `rwkv_engine.tokenizer._native`, a small C extension built by `pip install` (setup.py);
* `_PythonTrie` below, a pure-Python dict trie used when the extension is not importable.

`WorldTokenizer(native=None)` picks the native one when it can; `native=False` forces Python,
`native=True` requires the extension.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from rwkv_engine.errors import TokenizerError

try:  # the optional C extension (setup.py); None when it was not built
    from rwkv_engine.tokenizer import _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

VOCAB_ROWS = 65536
"""Embedding rows of every World model: ids 1..65529 have text, 0 and 65530..65535 have none."""
EOS_TOKEN_ID = 0
"""End-of-text / document separator of World models (it has no text)."""

_MAX_ID = 1 << 22  # a sanity bound for custom vocab files: ids index a table of that size

DEFAULT_VOCAB_PATH = Path(__file__).resolve().parent.parent / "data" / "rwkv_vocab_v20230424.txt"


def native_available() -> bool:
    """Whether the C extension `rwkv_engine.tokenizer._native` was built and imports."""
    return _native is not None


# ---- the vocab file ---------------------------------------------------------------------------


def _parse_literal(literal: str) -> str | bytes:
    """The value of one Python str/bytes literal, without eval.

    Literals without backslashes and without their own quote character are plain text between
    the quotes (that is what almost every line of the vocab is); anything else goes through
    `ast.literal_eval`, which evaluates literals only.
    """
    if len(literal) >= 2 and literal[0] == literal[-1] and literal[0] in "'\"":
        inner = literal[1:-1]
        if "\\" not in inner and literal[0] not in inner:
            return inner
    elif len(literal) >= 3 and literal[0] == "b" and literal[1] == literal[-1] and literal[1] in "'\"":
        inner = literal[2:-1]
        if "\\" not in inner and literal[1] not in inner and inner.isascii():
            return inner.encode("ascii")
    return ast.literal_eval(literal)


def parse_vocab(text: str, source: str = "<vocab>") -> dict[int, bytes]:
    """Parse a World vocab file's text into {id: token bytes}.

    Each line is `<id> <python str or bytes literal> <byte length>`: the id is the text before
    the first space, the literal everything between the first and the last space (it may itself
    contain spaces), the length the text after the last space and must equal the token's UTF-8
    byte length. Lines end in "\\n" or "\\r\\n" (the shipped file uses CRLF); blank lines are
    skipped. Raises TokenizerError naming `source` and the line for anything malformed,
    duplicate ids, duplicate or empty tokens.
    """
    tokens: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if line.endswith("\r"):
            line = line[:-1]
        if not line.strip():
            continue
        where = f"{source}, line {number}"
        first, last = line.find(" "), line.rfind(" ")
        id_text, length_text = line[:first], line[last + 1 :]
        if first <= 0 or last <= first + 1 or not (id_text.isascii() and id_text.isdigit()):
            raise TokenizerError(f"{where}: expected '<id> <literal> <byte length>', got {line[:80]!r}")
        if not (length_text.isascii() and length_text.isdigit()):
            raise TokenizerError(f"{where}: the byte length {length_text!r} is not a number")
        try:
            value = _parse_literal(line[first + 1 : last])
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
            raise TokenizerError(f"{where}: bad token literal {line[first + 1 : last][:80]!r} ({e})") from None
        if isinstance(value, str):
            try:
                value = value.encode("utf-8")
            except UnicodeEncodeError:
                raise TokenizerError(f"{where}: the token is not encodable as UTF-8") from None
        elif not isinstance(value, bytes):
            raise TokenizerError(f"{where}: the literal is a {type(value).__name__}, not str or bytes")
        idx = int(id_text)
        if idx >= _MAX_ID:
            raise TokenizerError(f"{where}: token id {idx} is too large (at most {_MAX_ID - 1})")
        if len(value) != int(length_text):
            raise TokenizerError(f"{where}: token {idx} has {len(value)} bytes but the line says {int(length_text)}")
        if not value:
            raise TokenizerError(f"{where}: token {idx} is empty")
        if idx in tokens:
            raise TokenizerError(f"{where}: token id {idx} appears twice")
        if value in seen:
            raise TokenizerError(f"{where}: token {idx} has the same bytes as token {seen[value]}")
        tokens[idx] = value
        seen[value] = idx
    if not tokens:
        raise TokenizerError(f"{source}: no tokens")
    return tokens


@functools.lru_cache(maxsize=4)
def _load_vocab(path: str, mtime_ns: int, size: int) -> tuple[bytes | None, ...]:
    """Token bytes by id (None for ids without text), max(VOCAB_ROWS, max id + 1) entries."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TokenizerError(f"cannot read the World vocab {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text (byte {e.start}); is this a World vocab file?") from None
    tokens = parse_vocab(text, source=path)
    table: list[bytes | None] = [None] * max(VOCAB_ROWS, max(tokens) + 1)
    for idx, value in tokens.items():
        table[idx] = value
    return tuple(table)


def _vocab_key(path: str | os.PathLike | None) -> tuple[str, int, int]:
    """(path, mtime, size): the cache key of a vocab file."""
    path = os.fspath(DEFAULT_VOCAB_PATH if path is None else path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise TokenizerError(f"cannot read the World vocab {path}: {e.strerror or e}") from None
    return path, st.st_mtime_ns, st.st_size


def load_vocab(path: str | os.PathLike | None = None) -> tuple[bytes | None, ...]:
    """Token bytes by id of a World vocab file (default: the shipped one), cached per file."""
    return _load_vocab(*_vocab_key(path))


@functools.lru_cache(maxsize=8)
def _matcher(path: str, mtime_ns: int, size: int, use_native: bool):
    """The trie of a vocab file, shared by all tokenizers of that file (it is read-only)."""
    tokens = _load_vocab(path, mtime_ns, size)
    return _native.Trie(tokens) if use_native else _PythonTrie(tokens)


# ---- the pure-Python matcher -------------------------------------------------------------------


class _PythonTrie:
    """Pure-Python twin of `_native.Trie`: same constructor, methods, results and errors.

    A node is a tuple (token id or -1, {next byte: node} or None for a leaf); the root is a list
    indexed by the first byte.

    Speed comes from a piece cache that keeps the result exact. The input is cut into pieces
    (words with their leading space, numbers, punctuation runs, whitespace runs; the cut is only
    a guess of where tokens end) and each piece is matched once in isolation, recording its ids
    and the set of bytes that would have let a trie walk cut off by the piece's end go further.
    If greedy matching reaches the piece's start in the full input (true at offset 0, and then
    by induction) and the byte after the piece is not in that set, every walk inside the piece
    stops exactly where it stopped in isolation, so the full-input ids over the piece are the
    cached ones and the next piece also starts on a token boundary. Otherwise the matcher walks
    the input itself until it lands on a piece start again.
    """

    _PIECES = re.compile(rb" ?[A-Za-z\x80-\xff]+| ?[0-9]+| ?[^\sA-Za-z0-9\x80-\xff]+|\s+|.", re.DOTALL)
    _CACHE_MAX_PIECE = 48  # longer pieces are matched but not cached
    _CACHE_MAX_ENTRIES = 100_000

    def __init__(self, tokens: Sequence[bytes | None]):
        root: list = [None] * 256
        nodes: dict[bytes, list] = {}  # build form: prefix -> [token, children]
        for idx, token in enumerate(tokens):
            if token is None:
                continue
            if not token:
                raise ValueError(f"token {idx} is empty")
            for k in range(1, len(token) + 1):
                if token[:k] not in nodes:
                    nodes[token[:k]] = [-1, None]
            if nodes[token][0] >= 0:
                raise ValueError(f"tokens {nodes[token][0]} and {idx} have the same bytes")
            nodes[token][0] = idx
        # Freeze deepest first, so that a node's children dict is complete when it is frozen.
        for prefix in sorted(nodes, key=len, reverse=True):
            tok, kids = nodes[prefix]
            if len(prefix) == 1:
                root[prefix[0]] = (tok, kids)
            else:
                parent = nodes[prefix[:-1]]
                if parent[1] is None:
                    parent[1] = {}
                parent[1][prefix[-1]] = (tok, kids)
        self._root = root
        self._table = [b"" if t is None else t for t in tokens]
        self._cache: dict[bytes, tuple[list[int], frozenset[int]] | None] = {}
        self.vocab_size = len(tokens)
        self.n_nodes = len(nodes) + 1

    def _match_piece(self, piece: bytes) -> tuple[list[int], frozenset[int]] | None:
        """Ids of `piece` alone and the bytes that would extend a walk cut off by its end;
        None when the piece alone does not tokenize (a vocab without some single bytes)."""
        root = self._root
        out: list[int] = []
        cont: set[int] = set()
        n = len(piece)
        i = 0
        while i < n:
            node = root[piece[i]]
            if node is None:
                return None
            best, kids = node
            end = j = i + 1
            while kids is not None:
                if j == n:
                    cont.update(kids)
                    break
                node = kids.get(piece[j])
                if node is None:
                    break
                j += 1
                tok, kids = node
                if tok >= 0:
                    best = tok
                    end = j
            if best < 0:
                return None
            out.append(best)
            i = end
        return out, frozenset(cont)

    def encode(self, data) -> list[int]:
        data = bytes(data)
        n = len(data)
        # pieces[k] starts at pos, a token boundary; each piece is either taken whole from the
        # cache (fast path) or walked byte by byte until the walk lands on a piece start.
        pieces = self._PIECES.findall(data)
        cache = self._cache
        get = cache.get
        max_cached = self._CACHE_MAX_PIECE
        root = self._root
        out: list[int] = []
        n_pieces = len(pieces)
        k = pos = 0
        while k < n_pieces:
            piece = pieces[k]
            end = pos + len(piece)
            entry = get(piece, False)
            if entry is False:
                entry = self._match_piece(piece)
                if len(piece) <= max_cached:
                    if len(cache) >= self._CACHE_MAX_ENTRIES:
                        cache.clear()
                    cache[piece] = entry
            if entry is not None and (end == n or data[end] not in entry[1]):
                out += entry[0]
                pos = end
                k += 1
                continue
            # A token may run past this piece: walk the input until a piece start is reached.
            i = pos
            while True:
                node = root[data[i]]
                if node is None:
                    raise ValueError(f"byte 0x{data[i]:02x} at offset {i} starts no token")
                best, kids = node
                stop = j = i + 1
                try:
                    while kids is not None:
                        node = kids.get(data[j])
                        if node is None:
                            break
                        j += 1
                        tok, kids = node
                        if tok >= 0:
                            best = tok
                            stop = j
                except IndexError:  # ran off the end of data
                    pass
                if best < 0:
                    raise ValueError(f"byte 0x{data[i]:02x} at offset {i} starts no token")
                out.append(best)
                i = stop
                while pos < i:
                    pos += len(pieces[k])
                    k += 1
                if pos == i:
                    break
        if pos != n:  # the piece pattern matches every byte; this guards the pattern
            raise AssertionError(f"pieces cover {pos} of {n} bytes")
        return out

    def decode(self, ids) -> bytes:
        table = self._table
        try:
            if not ids or min(ids) >= 0:  # a negative id would index from the end
                return b"".join(map(table.__getitem__, ids))
        except (IndexError, TypeError):
            pass
        # Slow path, only to name the bad id.
        size = len(table)
        for m, i in enumerate(ids):
            try:
                value = int(i.__index__())
            except (AttributeError, TypeError):
                raise TypeError(f"token id at position {m} is {type(i).__name__}, not an int") from None
            if not 0 <= value < size:
                raise ValueError(f"token id {i!r} at position {m} is outside [0, {size})")
        raise AssertionError("unreachable")  # pragma: no cover


# ---- the tokenizer -----------------------------------------------------------------------------


class WorldTokenizer:
    """The RWKV World tokenizer: ids identical to the reference `rwkv.rwkv_tokenizer.TRIE_TOKENIZER`.

    Args:
        vocab_path: a vocab file in the World format; default the shipped rwkv_vocab_v20230424.txt.
        native: None uses the C extension when it is built, else Python; True requires the
            extension (TokenizerError if it is missing); False forces the pure-Python matcher.

    Ids: `vocab_size` is 65536, the embedding rows of World models. Ids 1..65529 are tokens;
    0 (`eos_token_id`, end of text) and 65530..65535 have no text and decode to nothing.
    Ids outside [0, vocab_size) raise TokenizerError.

    Decoding invalid UTF-8: `decode` replaces each invalid or truncated UTF-8 sequence in the
    concatenated token bytes with one U+FFFD (Python's errors="replace", which follows the Unicode
    "maximal subpart" practice) and keeps all valid text around it. The reference instead returns
    the single string "\\ufffd" for the whole call when anything is wrong (also for id 0). So the
    two agree whenever the bytes are valid UTF-8 and all ids have text. `decode_bytes` is exact.
    For streaming output use `IncrementalDetokenizer`, which never splits a character.
    """

    eos_token_id: int = EOS_TOKEN_ID

    def __init__(self, vocab_path: str | os.PathLike | None = None, *, native: bool | None = None):
        key = _vocab_key(vocab_path)
        tokens = _load_vocab(*key)
        self.vocab_path = Path(key[0])
        if native and _native is None:
            raise TokenizerError(
                "the native World tokenizer extension rwkv_engine.tokenizer._native is not built; "
                "reinstall with a C compiler (pip install -e .) or pass native=None"
            )
        use_native = _native is not None and native is not False
        try:
            self._trie = _matcher(*key, use_native)
        except (ValueError, TypeError) as e:
            raise TokenizerError(f"{self.vocab_path}: {e}") from None
        self.vocab_size: int = len(tokens)
        self.backend: str = "native" if use_native else "python"

    def __repr__(self) -> str:
        return f"WorldTokenizer({str(self.vocab_path)!r}, backend={self.backend!r})"

    def __reduce__(self):
        # Pickled as its vocabulary file (the native matcher cannot be): a Ray replica hands its
        # tokenizer to the ingress this way. The receiver uses its own backend choice, unless
        # this one was forced to Python.
        return (WorldTokenizer._rebuilt, (str(self.vocab_path), self.backend))

    @staticmethod
    def _rebuilt(vocab_path: str, backend: str) -> WorldTokenizer:
        return WorldTokenizer(vocab_path, native=False if backend == "python" else None)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (UTF-8 encoded). A lone surrogate raises TokenizerError."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, not {type(text).__name__}; use encode_bytes() for bytes")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(
                f"the text has a lone surrogate {text[e.start]!r} at index {e.start}, which is not encodable as UTF-8"
            ) from None
        return self._encode(data)

    def encode_bytes(self, data: bytes | bytearray | memoryview) -> list[int]:
        """Token ids of arbitrary bytes (need not be valid UTF-8)."""
        if isinstance(data, str):
            raise TokenizerError("encode_bytes() takes bytes, not str; use encode() for text")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TokenizerError(f"encode_bytes() takes bytes, not {type(data).__name__}")
        if isinstance(data, memoryview) and not data.contiguous:
            data = data.tobytes()
        return self._encode(data)

    def _encode(self, data) -> list[int]:
        try:
            return self._trie.encode(data)
        except (ValueError, TypeError, BufferError) as e:
            raise TokenizerError(str(e)) from None

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes of the tokens, concatenated; ids 0 and 65530..65535 give b""."""
        try:
            if not isinstance(ids, (list, tuple)):
                ids = list(ids)
            return self._trie.decode(ids)
        except (ValueError, TypeError, OverflowError) as e:
            raise TokenizerError(str(e)) from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the tokens; invalid UTF-8 becomes U+FFFD per bad sequence (see the class doc)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def fix_trailing_newlines(self, ids: Sequence[int]) -> list[int]:
        """No-op for World models (the quirk is RWKV-4 Pile only); returns a copy of `ids`."""
        return list(ids)
