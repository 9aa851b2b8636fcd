"""Every kind of file a user can hand rwkv-engine, damaged on purpose (issue 28, item 3).

Each kind is a `FileKind`: how to write a good file, how a user's command uses it (load, then one
step of real work), and the damaged variants that only make sense for it (NaN and huge values,
wrong dtypes and shapes, oversized entries). Every kind also gets the generic damage:
truncated at several points, and bits flipped in its header and anywhere.

What must hold for every variant: the use ends in one `RWKVEngineError` (the CLI prints its
message as one line, exit 1: see `cli._run`), never another exception (a traceback), and the
process's peak memory stays bounded (an entry claiming gigabytes is refused before it is
read). A flip in the middle of weight data may go unnoticed (a checkpoint has no checksum): that
variant may also load and work, but not fail any other way.

A new reader joins by adding its `FileKind` to KINDS (the GGUF / rwkv.cpp readers: a writer of
a good tiny file, and `use` = `rwkv_engine.load` + one step, as `_checkpoint_kind` does).
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import rwkv_engine
from rwkv_engine import SamplingParams
from rwkv_engine.errors import RWKVEngineError
from rwkv_engine.sampling import Sampler
from rwkv_engine.testing import random_state_dict, save_pth

VOCAB = 512
MATRIX = "blocks.0.att.key.weight"
# Variants whose values are finite and whose step may be computed in range: weights scaled by
# 1e37 overflow the PyTorch modules' fp32 norms (NaN logits: an error at sampling), while the
# fused native step, which sums its norms in fp64, gives the finite logits of those weights.
# Either outcome is right; a traceback or a NaN turned finite is not.
IN_RANGE = {"huge-weights"}


@dataclass
class FileKind:
    name: str
    write: Callable[[Path], Path]  # a good file (or directory) under the given folder
    use: Callable[[Path], object]  # what a command does with it: load it and do one step
    variants: Callable[[Path], list[tuple[str, Path]]] = lambda d: []  # damage specific to the kind
    target: Callable[[Path], Path] = lambda p: p  # the file of a directory the generic damage hits
    variants_may_pass: bool = False  # a damaged variant may be accepted (its `use` checks the outcome)


def _sd(seed: int = 1) -> dict:
    return random_state_dict(version="7", n_layer=2, n_embd=64, vocab_size=VOCAB, head_size=16, seed=seed)


def _one_step(model) -> int:
    logits, _ = model.forward([1, 2, 3])
    return Sampler(SamplingParams(temperature=0), VOCAB)(logits)


def _use_checkpoint(path: Path) -> int:
    return _one_step(rwkv_engine.load(path))


def _save_safetensors(sd: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def _weight_variants(save: Callable[[dict, Path], Path], ext: str) -> Callable[[Path], list[tuple[str, Path]]]:
    def variants(d: Path) -> list[tuple[str, Path]]:
        out = []

        def put(label: str, change: Callable[[dict], None]) -> None:
            sd = _sd()
            change(sd)
            out.append((label, save(sd, d / f"{label}.{ext}")))

        put("nan", lambda sd: sd[MATRIX].__setitem__((0, 0), float("nan")))
        put("inf", lambda sd: sd[MATRIX].__setitem__((0, 0), float("inf")))
        put("huge-weights", lambda sd: sd[MATRIX].mul_(1e37))
        for dtype in (torch.int64, torch.bool, torch.complex64):
            put(
                f"dtype-{str(dtype).removeprefix('torch.')}",
                lambda sd, t=dtype: sd.__setitem__(MATRIX, sd[MATRIX].to(t)),
            )
        put("shape", lambda sd: sd.__setitem__(MATRIX, sd[MATRIX][:, :-1].contiguous()))
        put("0-dim", lambda sd: sd.__setitem__(MATRIX, torch.tensor(1.0)))
        put("missing", lambda sd: sd.pop(MATRIX))
        put("far-block", lambda sd: sd.__setitem__("blocks.4000000.att.key.weight", torch.zeros(64, 64)))
        put("empty", lambda sd: sd.clear() or sd.__setitem__("x", torch.zeros(1)))
        return out

    return variants


def _safetensors_oversized(d: Path) -> list[tuple[str, Path]]:
    """Headers that claim more than the file holds: a 1 TB header, a 2**31 x 2**31 tensor."""
    good = _save_safetensors(_sd(), d / "good.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + n])
    huge_header = d / "huge-header.safetensors"
    huge_header.write_bytes(struct.pack("<Q", 1 << 40) + good[8:])
    header[MATRIX]["shape"] = [2**31, 2**31]
    text = json.dumps(header).encode()
    huge_shape = d / "huge-shape.safetensors"
    huge_shape.write_bytes(struct.pack("<Q", len(text)) + text + good[8 + n :])
    return [("huge-header", huge_header), ("huge-shape", huge_shape)]


def _checkpoint_kind(ext: str) -> FileKind:
    save = save_pth if ext == "pth" else _save_safetensors
    weight = _weight_variants(save, ext)

    def variants(d: Path) -> list[tuple[str, Path]]:
        return weight(d) + (_safetensors_oversized(d) if ext == "safetensors" else [])

    return FileKind(
        f"checkpoint .{ext}",
        write=lambda d: save(_sd(), d / f"model.{ext}"),
        use=_use_checkpoint,
        variants=variants,
    )


def _write_converted(d: Path) -> Path:
    from rwkv_engine.cli import main

    out = d / "converted"
    assert main(["convert", str(save_pth(_sd(), d / "src.pth")), str(out)]) == 0
    return out


def _converted_variants(d: Path) -> list[tuple[str, Path]]:
    (d / "base").mkdir()
    good = _write_converted(d / "base")
    out = []

    def meta(c: str, **changes) -> str:
        c = json.loads(c)
        section = c["rwkv_engine"]
        config = {**section["config"], **changes.pop("config", {})}
        return json.dumps({**c, "rwkv_engine": {**section, **changes, "config": config}})

    for label, change in (
        ("config-not-json", lambda c: "{not json"),
        ("config-list", lambda c: "[]"),
        ("config-wrong-types", lambda c: json.dumps({k: [v] for k, v in json.loads(c).items()})),
        ("meta-layers", lambda c: meta(c, config={"n_layer": 3})),
        ("meta-width-text", lambda c: meta(c, config={"n_embd": "64"})),
        ("meta-scheme", lambda c: meta(c, quantization={"name": "q3"})),
        ("meta-linears", lambda c: meta(c, linears={"blocks.0.att.key": ["int4", "x"]})),
        ("meta-dtype", lambda c: meta(c, dtype="int64")),
        ("meta-missing", lambda c: json.dumps({k: v for k, v in json.loads(c).items() if k != "rwkv_engine"})),
    ):
        target = d / label
        shutil.copytree(good, target)
        cfg = target / "config.json"
        cfg.write_text(change(cfg.read_text()))
        out.append((label, target))
    target = d / "no-weights"
    shutil.copytree(good, target)
    (target / "model.safetensors").unlink()
    out.append(("no-weights", target))
    return out


_STATE_MODEL = []


def _state_model():
    """The model the state files are for (loaded once)."""
    if not _STATE_MODEL:
        path = save_pth(_sd(), Path(tempfile.mkdtemp(prefix="fuzz-state-")) / "state-model.pth")
        _STATE_MODEL.append(rwkv_engine.load(path))
    return _STATE_MODEL[0]


def _use_state(path: Path) -> int:
    model = _state_model()
    state = rwkv_engine.State.load(path)
    state.check_usable(model)
    logits, _ = model.forward([1, 2, 3], state=state)
    return Sampler(SamplingParams(temperature=0), VOCAB)(logits)


def _write_state_tensors(path: Path, tensors: dict, signature: str) -> Path:
    from safetensors.torch import save_file

    meta = {"format": "rwkv-engine-state/1", "signature": signature, "fields": ",".join(tensors)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def _state_variants(d: Path) -> list[tuple[str, Path]]:
    model = _state_model()
    sig = model.config.state_signature()
    good = {k: t.clone() for k, t in model.new_state(1).items()}
    first = next(iter(good))
    out = []
    for label, change in (
        ("nan", lambda t: {**t, first: torch.full_like(t[first], float("nan"))}),
        ("huge", lambda t: {k: torch.full_like(v, 3e38) for k, v in t.items()}),
        ("0-dim", lambda t: {**t, first: torch.tensor(1.0)}),
        ("shape", lambda t: {**t, first: t[first][..., :-1]}),
        ("dtype", lambda t: {**t, first: t[first].double()}),
        ("batch-2", lambda t: {k: torch.cat([v, v]) for k, v in t.items()}),
        ("missing-field", lambda t: {k: v for k, v in t.items() if k != first}),
    ):
        out.append((label, _write_state_tensors(d / f"{label}.safetensors", change(dict(good)), sig)))
    out.append(("other-model", _write_state_tensors(d / "other.safetensors", good, "rwkv7:L9:C64:H4")))
    return out


def _use_jsonl(path: Path) -> int:
    """`rwkv-engine batch`'s reading of IN: a file that is not UTF-8 is an InputError; every line
    is a request (endpoint, body) or its error answer, numbered as the line."""
    from rwkv_engine.batch import parse_line, read_lines

    lines = read_lines(path)
    for line in lines:
        parsed = parse_line(line)
        if isinstance(parsed, dict):
            assert parsed["line"] == line.number + 1 and parsed["response"]["status_code"] == 400, parsed
            assert f"line {line.number + 1}" in parsed["error"]["message"], parsed
        else:
            assert isinstance(parsed, tuple) and isinstance(parsed[2], dict), parsed
    return len(lines)


def _write_jsonl(d: Path) -> Path:
    path = d / "in.jsonl"
    path.write_text('{"prompt": "x"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    return path


def _jsonl_variants(d: Path) -> list[tuple[str, Path]]:
    out = []
    for label, data in (
        ("not-utf8", b'{"prompt": "caf\xe9"}\n'),
        ("nul-bytes", b'{"prompt": "x"}\n\x00\x00\x00\n'),
        ("deep-nesting", b"[" * 100000 + b"]" * 100000 + b"\n"),
        ("huge-number", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}\n"),
        ("nan-literals", b'{"prompt": "x", "temperature": NaN, "top_p": Infinity}\n'),
        ("long-line", b'{"prompt": "' + b"a" * (8 << 20) + b'"}\n'),
    ):
        path = d / f"{label}.jsonl"
        path.write_bytes(data)
        out.append((label, path))
    return out


_CHAT = []


def _chat_session():
    """A chat session on a tiny World-vocabulary model (built once)."""
    if not _CHAT:
        from rwkv_engine.chat import ChatSession

        sd = random_state_dict(version="7", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=2)
        model = rwkv_engine.load(save_pth(sd, Path(tempfile.mkdtemp(prefix="fuzz-chat-")) / "chat-model.pth"))
        _CHAT.append(ChatSession(model, rwkv_engine.WorldTokenizer(), SamplingParams(temperature=0, max_tokens=2)))
    return _CHAT[0]


def _write_session(d: Path) -> Path:
    s = _chat_session()
    s.reset()
    "".join(s.ask("Hello"))
    return s.save(d / "session.zip")


def _use_session(path: Path) -> str:
    s = _chat_session()
    s.load(path)
    return "".join(s.ask("Again"))  # the first message after loading: a bad state failed here


def _rezip(good: Path, out: Path, change: Callable[[str, bytes], object]) -> Path:
    import zipfile

    with zipfile.ZipFile(good) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as w:
        for name in z.namelist():
            data = change(name, z.read(name))
            if isinstance(data, bytes):
                w.writestr(name, data)
            elif data is not None:  # chunks: an entry too big to build in memory
                with w.open(name, "w") as f:
                    for chunk in data:
                        f.write(chunk)
    return out


def _padded(data: bytes, megabytes: int, before: bool):
    """`data` with `megabytes` MB of padding, as chunks (a "zip bomb" entry, built without the memory)."""
    if not before:
        yield data
    pad = (b" " if before else b"\0") * (1 << 20)
    for _ in range(megabytes):
        yield pad
    if before:
        yield data


def _session_variants(d: Path) -> list[tuple[str, Path]]:
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    good = _write_session(d)
    model = _chat_session().model
    out = []

    def state_change(f):
        def change(name, data):
            if name != "state.safetensors":
                return data
            tensors = st_load(data)
            header_len = int.from_bytes(data[:8], "little")
            metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__")
            return st_save(f(tensors), metadata)

        return change

    def meta_change(f):
        def change(name, data):
            if name != "session.json":
                return data
            return json.dumps(f(json.loads(data))).encode()

        return change

    first = next(iter(model.new_state(1).fields))
    for label, change in (
        ("state-shape", state_change(lambda t: {**t, first: t[first][..., :-1].contiguous()})),
        ("state-nan", state_change(lambda t: {**t, first: torch.full_like(t[first], float("nan"))})),
        ("state-dtype", state_change(lambda t: {**t, first: t[first].double()})),
        ("turns-not-list", meta_change(lambda m: {**m, "turns": "many"})),
        ("turn-wrong-types", meta_change(lambda m: {**m, "turns": [{**m["turns"][0], "user": 5}]})),
        ("turn-ids-text", meta_change(lambda m: {**m, "turns": [{**m["turns"][0], "prompt_ids": ["a"]}]})),
        ("turn-ids-outside", meta_change(lambda m: {**m, "turns": [{**m["turns"][0], "reply_ids": [70000]}]})),
        ("params-wrong", meta_change(lambda m: {**m, "params": {**m["params"], "temperature": "hot"}})),
        ("generator-junk", meta_change(lambda m: {**m, "generator": "!!"})),
        ("no-state", lambda name, data: None if name == "state.safetensors" else data),
        # Entries that inflate far beyond what a session holds: refused before they are read.
        ("json-bomb", lambda name, data: _padded(data, 150, True) if name == "session.json" else data),
        ("state-bomb", lambda name, data: _padded(data, 64, False) if name == "state.safetensors" else data),
    ):
        out.append((label, _rezip(good, d / f"{label}.zip", change)))
    return out


KINDS: list[FileKind] = [
    _checkpoint_kind("pth"),
    _checkpoint_kind("safetensors"),
    FileKind(
        "converted directory",
        write=_write_converted,
        use=_use_checkpoint,
        variants=_converted_variants,
        target=lambda p: p / "model.safetensors",
    ),
    FileKind(
        "state file",
        write=lambda d: _state_model().new_state(1).save(d / "state.safetensors"),
        use=_use_state,
        variants=_state_variants,
    ),
    FileKind(
        "batch JSONL",
        write=_write_jsonl,
        use=_use_jsonl,
        variants=_jsonl_variants,
        variants_may_pass=True,  # a bad line gets its error answer (checked by `use`); the run goes on
    ),
    FileKind("chat session zip", write=_write_session, use=_use_session, variants=_session_variants),
]


def _generic(kind: FileKind, good: Path, d: Path) -> list[tuple[str, Path, bool]]:
    """(label, path, may pass) of the truncated and bit-flipped copies of `good`."""
    rng = random.Random(kind.name)
    data = kind.target(good).read_bytes()
    n = len(data)
    out = []

    def copy(label: str, blob: bytes, may_pass: bool) -> None:
        if good.is_dir():
            target = d / label
            shutil.copytree(good, target)
            kind.target(target).write_bytes(blob)
        else:
            target = d / f"{label}{good.suffix}"
            target.write_bytes(blob)
        out.append((label, target, may_pass))

    for cut in sorted({0, 1, 7, 8, 64, n // 3, n // 2, n - 1}):
        copy(f"truncated-{cut}", data[:cut], kind.variants_may_pass)
    for i in range(6):
        blob = bytearray(data)
        head = i < 3
        for _ in range(4):
            j = rng.randrange(min(n, 512) if head else n)
            blob[j] ^= 1 << rng.randrange(8)
        # A flip in a header is caught or harmless; one in the data may go unnoticed.
        copy(f"flip-{'header' if head else 'anywhere'}-{i}", bytes(blob), True)
    return out


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_damaged_files_give_one_clear_error(kind, tmp_path):
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    good = kind.write(tmp_path)
    kind.use(good)  # the good file works
    cases = [(label, path, kind.variants_may_pass or label in IN_RANGE) for label, path in kind.variants(tmp_path)]
    generic = tmp_path / "generic"
    generic.mkdir()
    cases += _generic(kind, good, generic)
    wrong = []
    for label, path, may_pass in cases:
        try:
            kind.use(path)
        except RWKVEngineError as e:
            assert str(e).strip(), label
            continue
        except Exception as e:  # noqa: BLE001 (what must never happen: gathered, then reported)
            wrong.append(f"{label}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if not may_pass:
            wrong.append(f"{label}: accepted")
    assert not wrong, f"{kind.name}:\n" + "\n".join(wrong)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mb < 200, f"{kind.name}: peak memory grew by {grown_mb:.0f} MB"
