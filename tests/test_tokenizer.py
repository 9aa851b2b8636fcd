"""Tokenizers against independent references.

* WorldTokenizer (native C trie and pure-Python twin) against the reference
  `rwkv.rwkv_tokenizer.TRIE_TOKENIZER` of the `rwkv` package, id for id.
* HFTokenizer against the `tokenizers` package on a small BPE tokenizer.json trained here.
* IncrementalDetokenizer against one-shot decoding with Python's UTF-8 decoder.
* load_tokenizer rules with fake models.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from rwkv_engine.errors import RWKVEngineError
from rwkv_engine.testing.corpus import mixed_corpus
from rwkv_engine.tokenizer import (
    HFTokenizer,
    IncrementalDetokenizer,
    TokenizerError,
    WorldTokenizer,
    load_tokenizer,
    native_available,
)
from rwkv_engine.tokenizer import world as world_module

rwkv = pytest.importorskip("rwkv")
from rwkv.rwkv_tokenizer import TRIE_TOKENIZER  # noqa: E402

REF_VOCAB = Path(os.path.dirname(rwkv.__file__)) / "rwkv_vocab_v20230424.txt"

BACKENDS = [
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not native_available(),
            reason="rwkv_engine.tokenizer._native not built (pip install -e . or python setup.py build_ext --inplace)",
        ),
    ),
    "python",
]


@pytest.fixture(scope="module")
def ref():
    return TRIE_TOKENIZER(str(REF_VOCAB))


@pytest.fixture(scope="module")
def _tokenizers():
    made = {"python": WorldTokenizer(native=False)}
    if native_available():
        made["native"] = WorldTokenizer(native=True)
    return made


@pytest.fixture(params=BACKENDS)
def tok(request, _tokenizers):
    return _tokenizers[request.param]


def random_text(rng: random.Random, n: int) -> str:
    pools = [
        range(0x20, 0x7F),
        range(0x00, 0x20),
        range(0x80, 0x250),
        range(0x300, 0x370),
        range(0x370, 0x530),
        range(0x600, 0x700),
        range(0x3040, 0x3100),
        range(0x4E00, 0x9FFF),
        range(0xAC00, 0xD7A4),
        range(0xE000, 0xE100),
        range(0xFE00, 0xFE10),
        range(0xFFF0, 0x10000),
        range(0x1F300, 0x1FAFF),
        range(0x10000, 0x110000),
        [0x200D] * 4,
        [0x20] * 30,
        [0x0A, 0x09] * 6,
    ]
    return "".join(chr(rng.choice(rng.choice(pools))) for _ in range(n))


def random_token_soup(rng: random.Random, ref, n: int) -> bytes:
    """Bytes made of random vocab tokens glued together: tokens that run across each other."""
    return b"".join(ref.idx2token[rng.randrange(1, 65530)] for _ in range(n))


# ---- WorldTokenizer vs the reference ------------------------------------------------------------


def test_vocab_matches_reference(ref):
    table = world_module.load_vocab()
    assert len(table) == 65536
    assert {i: t for i, t in enumerate(table) if t is not None} == ref.idx2token
    assert table[0] is None and all(t is None for t in table[65530:])


# docs/formats.md C.1 test vectors; checked against both the documented ids and the reference.
@pytest.mark.parametrize(
    "text, documented",
    [
        ("User: hi\n\nAssistant:", [24281, 59, 4571, 261, 5585, 41693, 59]),
        ("Hello world", [33155, 40213]),
        ("你好", [10464, 11685]),
        ("\U0001f600", [3319, 153, 129]),
        ("  hello   world\t\n\n", [267, 34550, 3340, 36017, 258, 11]),
        ("", []),
    ],
)
def test_formats_vectors(tok, ref, text, documented):
    assert tok.encode(text) == ref.encode(text) == documented
    assert tok.decode(documented) == text


def test_useful_ids(tok, ref):
    for text in ("\n", "\n\n", " ", "User", ":", "Ass", "istant", "\n\n\n", " \n\n"):
        assert tok.encode(text) == ref.encode(text)


def test_random_unicode(tok, ref):
    rng = random.Random(1234)
    for _ in range(1500):
        text = random_text(rng, rng.randrange(0, 50))
        assert tok.encode(text) == ref.encode(text), repr(text)


def test_random_bytes(tok, ref):
    rng = random.Random(99)
    for _ in range(1500):
        data = rng.randbytes(rng.randrange(0, 40))
        assert tok.encode_bytes(data) == ref.encodeBytes(data), data


def test_token_soup(tok, ref):
    # Random tokens glued together make longest matches cross the pieces the Python matcher
    # guesses (its slow path); the second pass runs on a warm piece cache.
    rng = random.Random(7)
    for _ in range(2):
        for _ in range(40):
            data = random_token_soup(rng, ref, rng.randrange(1, 200))
            assert tok.encode_bytes(data) == ref.encodeBytes(data)


def test_long_runs(tok, ref):
    for text in (" " * 3000, "\n" * 1001, "a" * 777, "😀" * 300, "的" * 401, "\t \n" * 300, "=" * 129):
        assert tok.encode(text) == ref.encode(text)


@pytest.fixture(scope="module")
def megabyte():
    return mixed_corpus(1_000_000, seed=3)


def test_megabyte_mixed(tok, ref, megabyte):
    ids = tok.encode(megabyte)
    assert ids == ref.encode(megabyte)
    assert tok.decode(ids) == megabyte
    assert tok.encode(megabyte) == ids  # warm cache / repeat call


def test_native_equals_python(_tokenizers, megabyte):
    if "native" not in _tokenizers:
        pytest.skip("native extension not built")
    nat, py = _tokenizers["native"], _tokenizers["python"]
    assert nat.backend == "native" and py.backend == "python"
    rng = random.Random(5)
    text = megabyte[:200_000] + random_text(rng, 5000)
    data = text.encode("utf-8") + rng.randbytes(5000)
    assert nat.encode_bytes(data) == py.encode_bytes(data)
    ids = nat.encode_bytes(data) + [0, 65530, 65535]
    assert nat.decode_bytes(ids) == py.decode_bytes(ids)
    assert nat.decode(ids) == py.decode(ids)


def test_buffer_inputs(tok):
    data = "héllo wörld 😀".encode()
    expected = tok.encode_bytes(data)
    assert tok.encode_bytes(bytearray(data)) == expected
    assert tok.encode_bytes(memoryview(data)) == expected
    assert tok.encode_bytes(memoryview(data + data)[::2]) == tok.encode_bytes((data + data)[::2])


# ---- decoding ----------------------------------------------------------------------------------


def test_round_trips(tok):
    rng = random.Random(11)
    for _ in range(300):
        text = random_text(rng, rng.randrange(0, 60))
        assert tok.decode(tok.encode(text)) == text
        data = rng.randbytes(rng.randrange(0, 60))
        assert tok.decode_bytes(tok.encode_bytes(data)) == data


def test_decode_bytes_matches_reference(tok, ref):
    rng = random.Random(12)
    ids = [rng.randrange(1, 65530) for _ in range(5000)]
    assert tok.decode_bytes(ids) == ref.decodeBytes(ids)
    assert tok.decode_bytes(tuple(ids)) == tok.decode_bytes(iter(ids)) == ref.decodeBytes(ids)


def test_decode_invalid_utf8(tok, ref):
    rng = random.Random(13)
    for _ in range(300):
        data = rng.randbytes(rng.randrange(1, 30))
        ids = tok.encode_bytes(data)
        # Ours: U+FFFD per invalid sequence, valid text kept (Python's errors="replace").
        assert tok.decode(ids) == data.decode("utf-8", errors="replace")
        # The reference gives up on the whole call instead; they agree only on valid UTF-8.
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            assert ref.decode(ids) == "\ufffd"
        else:
            assert ref.decode(ids) == tok.decode(ids)
    # A space and a lone continuation byte: the space survives here, not in the reference.
    ids = tok.encode_bytes(b" \x80")
    assert tok.decode(ids) == " \ufffd" and ref.decode(ids) == "\ufffd"


def test_ids_without_text(tok):
    assert tok.vocab_size == 65536 and tok.eos_token_id == 0
    hello = tok.encode("Hello")
    for empty in (0, 65530, 65535):
        assert tok.decode_bytes([empty]) == b""
        assert tok.decode(hello + [empty] + hello) == "HelloHello"


@pytest.mark.parametrize("bad", [-1, 65536, 2**70, -(2**70)])
def test_ids_out_of_range(tok, bad):
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([33, bad])
    with pytest.raises(TokenizerError):
        tok.decode_bytes([bad])


def test_bad_inputs(tok):
    np = pytest.importorskip("numpy")
    assert tok.decode(np.array([33155, 40213])) == "Hello world"
    assert tok.decode([np.int64(33155)]) == "Hello"
    for bad in (["a"], [1.5], [None], 5):
        with pytest.raises(TokenizerError):
            tok.decode(bad)
    with pytest.raises(TokenizerError, match="surrogate"):
        tok.encode("a\ud800b")
    with pytest.raises(TokenizerError, match="encode_bytes"):
        tok.encode(b"abc")
    with pytest.raises(TokenizerError, match="encode\\(\\)"):
        tok.encode_bytes("abc")
    with pytest.raises(TokenizerError):
        tok.encode_bytes(12)
    assert issubclass(TokenizerError, RWKVEngineError)


def test_native_required_but_missing(monkeypatch):
    monkeypatch.setattr(world_module, "_native", None)
    with pytest.raises(TokenizerError, match="not built"):
        WorldTokenizer(native=True)
    assert WorldTokenizer().backend == "python"


# ---- the vocab file ----------------------------------------------------------------------------


def write_vocab(path: Path, lines: list[str], newline: str = "\n") -> Path:
    path.write_bytes(newline.join(lines).encode("utf-8") + newline.encode())
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_vocab_longest_match(tmp_path, backend):
    # "ab" is not a token but "abc" is: the match must not stop at the first miss
    # (the tokenizers-cpp bug of docs/formats.md C.1).
    lines = [
        "1 'a' 1",
        "2 'b' 1",
        "3 'c' 1",
        "4 'abc' 3",
        "5 ' ' 1",
        '6 "it\'s" 4',
        r"7 b'\xff' 1",
        "8 'a b' 3",
        "9 '\\u00e9' 2",
    ]
    path = write_vocab(tmp_path / "v.txt", lines, newline="\r\n")
    ours = WorldTokenizer(path, native=backend == "native")
    ref = TRIE_TOKENIZER(str(path))
    for data in (b"abcab", b"a b abc", b"it's", b"\xffab\xff", "é a".encode(), b"ababc"):
        assert ours.encode_bytes(data) == ref.encodeBytes(data)
    with pytest.raises(TokenizerError, match="starts no token"):
        ours.encode("abz")


@pytest.mark.parametrize(
    "lines, message",
    [
        (["1 'a' 2"], "2"),
        (["1 'a'"], "expected"),
        (["x 'a' 1"], "expected"),
        (["1 'a' 1", "1 'b' 1"], "twice"),
        (["1 'a' 1", "2 'a' 1"], "same bytes"),
        (["1 '' 0"], "empty"),
        (["1 __import__('os').getcwd() 1"], "bad token literal"),
        (["1 [1] 1"], "not str or bytes"),
        (["1 'a 1"], "bad token literal"),
        (["99999999999 'a' 1"], "too large"),
    ],
)
def test_bad_vocab_files(tmp_path, lines, message):
    path = write_vocab(tmp_path / "bad.txt", lines)
    with pytest.raises(TokenizerError, match=message):
        WorldTokenizer(path)


def test_missing_vocab_file(tmp_path):
    with pytest.raises(TokenizerError, match="cannot read"):
        WorldTokenizer(tmp_path / "nope.txt")


def test_lf_and_crlf_vocab_agree(tmp_path):
    text = REF_VOCAB.read_bytes().decode("utf-8")
    lf = tmp_path / "lf.txt"
    lf.write_bytes(text.replace("\r\n", "\n").encode("utf-8"))
    assert world_module.load_vocab(lf) == world_module.load_vocab()


# ---- IncrementalDetokenizer --------------------------------------------------------------------


def ids_split_at_random_bytes(tok, data: bytes, rng: random.Random) -> list[int]:
    """Ids of `data` encoded in random byte chunks, so that tokens cut characters anywhere."""
    ids, start = [], 0
    while start < len(data):
        stop = start + rng.randint(1, 5)
        ids += tok.encode_bytes(data[start:stop])
        start = stop
    return ids


def stream(detok, ids) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_detokenizer_random_splits(tok):
    rng = random.Random(21)
    detok = IncrementalDetokenizer(tok)
    for _ in range(200):
        text = "".join(
            rng.choice(["你好世界", "😀👍🏽", "👨\u200d👩\u200d👧", "é", "a b", "한국어", " "])
            for _ in range(rng.randint(1, 12))
        )
        ids = ids_split_at_random_bytes(tok, text.encode("utf-8"), rng)
        chunks = stream(detok, ids)
        assert "".join(chunks) == text
        assert all("\ufffd" not in c for c in chunks)
        assert len(detok.pending_bytes) == 0


def test_detokenizer_holds_partial_characters(tok):
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("\U0001f600")  # f0 9f | 98 | 80
    assert [detok.push(i) for i in ids[:-1]] == ["", ""]
    assert detok.pending_bytes == b"\xf0\x9f\x98"
    assert detok.push(ids[-1]) == "\U0001f600"


def test_detokenizer_invalid_bytes(tok):
    rng = random.Random(22)
    detok = IncrementalDetokenizer(tok)
    for _ in range(200):
        data = rng.randbytes(rng.randint(1, 20)) + "你".encode()[: rng.randint(0, 3)]
        ids = ids_split_at_random_bytes(tok, data, rng)
        chunks = stream(detok, ids)
        assert "".join(chunks) == data.decode("utf-8", errors="replace") == tok.decode(ids)
        assert len(detok.pending_bytes) == 0
    # A truncated character at the end comes out as U+FFFD on flush, not before.
    assert detok.push(tok.encode_bytes(b"\xe4\xbd")[0]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.push_many(tok.encode_bytes(b"ok\xe4\xbd")) == "ok"
    assert detok.flush() == "\ufffd"


# ---- HFTokenizer -------------------------------------------------------------------------------

HF_TEXTS = [
    "hello world\n\nthis is a test of the tokenizer 你好 😀",
    "the quick brown fox\n\njumps over   the lazy dog\n",
    "def f(x):\n    return x * 2\n\n",
    "Ünïcödé façade 👍🏽 한국어",
]


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(HF_TEXTS * 30, trainer=trainer)
    tok.add_tokens(["   ", "  "])  # NeoX adds runs of spaces as plain added tokens
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_byte_level_alphabet():
    from tokenizers import pre_tokenizers

    from rwkv_engine.tokenizer.hf import byte_level_alphabet

    table = byte_level_alphabet()
    assert sorted(table) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))


def test_hf_against_tokenizers(hf_json):
    from tokenizers import Tokenizer

    theirs = Tokenizer.from_file(str(hf_json))
    ours = HFTokenizer(hf_json)
    assert ours.vocab_size == theirs.get_vocab_size(with_added_tokens=True)
    assert ours.eos_token_id == theirs.token_to_id("<|endoftext|>")
    assert ours.byte_exact
    rng = random.Random(31)
    texts = HF_TEXTS + [random_text(rng, 40) for _ in range(100)] + ["a  b   c    d"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode_bytes(ids) == theirs.decode(ids).encode("utf-8")
        assert ours.encode_bytes(text.encode("utf-8")) == ids
        for i in ids:  # single tokens, which may be half characters
            assert ours.decode_bytes([i]).decode("utf-8", errors="replace") == theirs.decode([i])
    eos = ours.eos_token_id
    assert ours.decode([eos] + ours.encode("hi")) == theirs.decode([eos] + ours.encode("hi"))
    assert ours.decode_bytes([eos]) == b""


def test_hf_errors(hf_json, tmp_path):
    ours = HFTokenizer(hf_json)
    with pytest.raises(TokenizerError, match="outside"):
        ours.decode([ours.vocab_size])
    with pytest.raises(TokenizerError, match="outside"):
        ours.decode_bytes([-1])
    with pytest.raises(TokenizerError, match="UTF-8"):
        ours.encode_bytes(b"\xff")
    with pytest.raises(TokenizerError):
        ours.encode("a\ud800")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        HFTokenizer(bad)
    with pytest.raises(TokenizerError, match="cannot read"):
        HFTokenizer(tmp_path / "missing.json")


def test_hf_fix_trailing_newlines(hf_json):
    ours = HFTokenizer(hf_json)
    (nl,) = ours.encode("\n")
    (nn,) = ours.encode("\n\n")  # the trained BPE merges "\n\n", as GPT-NeoX does (535)
    ids = ours.encode("the quick brown fox\n\n")
    assert ids[-1] == nn
    fixed = ours.fix_trailing_newlines(ids)
    assert fixed == ids[:-1] + [nl, nl]
    assert ours.decode(fixed) == ours.decode(ids)
    assert ours.fix_trailing_newlines(ids[:-1]) == ids[:-1]
    assert ours.fix_trailing_newlines([]) == []


def test_hf_detokenizer(hf_json):
    ours = HFTokenizer(hf_json)
    detok = IncrementalDetokenizer(ours)
    for text in HF_TEXTS:
        ids = ours.encode(text)
        chunks = stream(detok, ids)
        assert "".join(chunks) == ours.decode(ids)
        assert all("\ufffd" not in c for c in chunks)


def test_hf_not_byte_level(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    ours = HFTokenizer(path)
    assert not ours.byte_exact and ours.vocab_size == 3 and ours.eos_token_id is None
    assert ours.encode("hello world") == [1, 2]
    assert ours.decode_bytes([1, 2]) == tok.decode([1, 2]).encode()
    with pytest.raises(TokenizerError, match="exact bytes"):
        IncrementalDetokenizer(ours)


# ---- load_tokenizer ----------------------------------------------------------------------------


def fake_model(vocab_size: int, path: Path):
    return SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size), path=path)


def test_load_world_by_vocab_size(tmp_path):
    tok = load_tokenizer(fake_model(65536, tmp_path / "model.pth"))
    assert isinstance(tok, WorldTokenizer)
    assert tok.encode("Hello world") == WorldTokenizer().encode("Hello world")


def test_load_tokenizer_json_next_to_model(tmp_path, hf_json):
    (tmp_path / "tokenizer.json").write_bytes(hf_json.read_bytes())
    rows = HFTokenizer(hf_json).vocab_size
    for path in (tmp_path / "model.pth", tmp_path):  # a checkpoint file, a model directory
        tok = load_tokenizer(fake_model(rows + 7, path))
        assert isinstance(tok, HFTokenizer) and tok.path == tmp_path / "tokenizer.json"


def test_load_no_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match=r"50277.*--tokenizer"):
        load_tokenizer(fake_model(50277, tmp_path / "model.pth"))


def test_load_explicit(tmp_path, hf_json):
    model = fake_model(65536, tmp_path / "model.pth")
    assert isinstance(load_tokenizer(model, "world"), WorldTokenizer)
    assert isinstance(load_tokenizer(model, "World"), WorldTokenizer)
    assert isinstance(load_tokenizer(model, REF_VOCAB), WorldTokenizer)
    assert isinstance(load_tokenizer(model, str(hf_json)), HFTokenizer)
    assert isinstance(load_tokenizer(model, hf_json.parent), HFTokenizer)
    # An explicit choice wins over a tokenizer.json next to the model.
    (tmp_path / "tokenizer.json").write_bytes(hf_json.read_bytes())
    assert isinstance(load_tokenizer(model, "world"), WorldTokenizer)
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(model, tmp_path / "missing.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(model, tmp_path / "empty")


def test_load_mismatch_errors(tmp_path, hf_json):
    with pytest.raises(TokenizerError, match=r"65536.*50277"):
        load_tokenizer(fake_model(50277, tmp_path / "m.pth"), "world")
    with pytest.raises(TokenizerError, match=r"65536.*65600"):
        load_tokenizer(fake_model(65600, tmp_path / "m.pth"), "world")
    hf_size = HFTokenizer(hf_json).vocab_size
    with pytest.raises(TokenizerError, match=rf"{hf_size}.*{hf_size - 10}"):
        load_tokenizer(fake_model(hf_size - 10, tmp_path / "m.pth"), hf_json)
    with pytest.raises(TokenizerError, match="loaded model"):
        load_tokenizer(SimpleNamespace(config=None))


def test_load_from_paths(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"vocab_size": 65536}')
    assert isinstance(load_tokenizer(hf_dir), WorldTokenizer)
    (hf_dir / "config.json").write_text('{"vocab_size": 50277}')
    with pytest.raises(TokenizerError, match="50277"):
        load_tokenizer(hf_dir)

    st = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"emb.weight": torch.zeros(65536, 1, dtype=torch.float16)}, str(st))
    assert isinstance(load_tokenizer(st), WorldTokenizer)
    pth = tmp_path / "model.pth"
    torch.save({"emb.weight": torch.zeros(50277, 1, dtype=torch.float16)}, pth)
    with pytest.raises(TokenizerError, match="50277"):
        load_tokenizer(pth, "world")
    unknown = tmp_path / "model.bin"
    unknown.write_bytes(b"\0" * 16)
    with pytest.raises(TokenizerError, match="cannot tell"):
        load_tokenizer(unknown)
    assert isinstance(load_tokenizer(unknown, "world"), WorldTokenizer)
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nothing.pth")


def test_tokenizer_pickles_as_its_vocabulary(tok):
    """A Ray replica hands its tokenizer to the ingress by pickle: the copy has the same
    vocabulary file and backend and gives the same ids (the native matcher itself cannot be
    pickled)."""
    import pickle

    copy = pickle.loads(pickle.dumps(tok))
    assert copy.vocab_path == tok.vocab_path and copy.backend == tok.backend
    text = "Hello, 世界! Ünïcode\n\n   spaces"
    assert copy.encode(text) == tok.encode(text)
