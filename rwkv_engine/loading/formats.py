"""Checkpoint files: the dtype table, sniffing a file's type from its bytes, the lazy readers of
.pth / .safetensors files and Hugging Face model directories, and a streaming safetensors writer."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import CheckpointError, InputError
from . import ggml, progress

Tensor = torch.Tensor

# (our name, torch dtype, safetensors code); the names without a code of ours are storage types only.
_TABLE = [
    ("fp32", torch.float32, "F32"),
    ("bf16", torch.bfloat16, "BF16"),
    ("fp16", torch.float16, "F16"),
    (None, torch.float64, "F64"),
    (None, torch.int8, "I8"),
    (None, torch.uint8, "U8"),
    (None, torch.int16, "I16"),
    (None, torch.int32, "I32"),
    (None, torch.int64, "I64"),
]
# The model dtypes by name, with torch's long names as synonyms.
DTYPES = {alias: dt for name, dt, _ in _TABLE if name for alias in (name, str(dt).removeprefix("torch."))}
DTYPE_NAMES = {dt: name for name, dt, _ in _TABLE if name}  # torch dtype -> fp32 / bf16 / fp16
SAFETENSORS_CODES = {dt: code for _, dt, code in _TABLE}
SAFETENSORS_DTYPES = {code: dt for _, dt, code in _TABLE}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise InputError(f"dtype must be one of fp32, bf16, fp16; got {dtype!r}")


def dtype_of(name: str) -> torch.dtype:
    """The model dtype of a name of DTYPE_NAMES (as written in a converted directory)."""
    return DTYPES[name]


# The one non-tensor entry a checkpoint may hold: an EmbeddingRWKV reranker's list of the
# embedder layers whose states its blocks start from (loading/reranker.py); read as an int64 tensor.
RERANKER_LAYERS = "reranker_layer_idx"

# Keys that only the `rwkv` pip package's own converted files contain.
_PIP_CONVERTED_KEYS = ("_strategy", "_version", "_rescale_layer")


def check_finite(t: Tensor, what: str) -> None:
    """CheckpointError naming `what` (a file and a tensor) unless every value of `t` is finite.

    A NaN or infinite weight loads, then makes the logits NaN at the first token (or at the
    first use of an embedding row), so the loaders refuse it while they read: each tensor once,
    as it is read (`Checkpoint.get`; converted.load for directories written before `convert`
    checked, see converted._meta), never in a second pass over the model.
    One `aminmax`: exact (a NaN propagates into both, an infinity is one of them), no
    temporary the size of the tensor (as `isfinite().all()` makes), and cheaper than the copy
    the load makes of each tensor anyway (benchmarks/bench_load_check.py)."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    lo, hi = (float(v) for v in torch.aminmax(t))
    if math.isfinite(lo) and math.isfinite(hi):
        return
    kind = "NaN" if math.isnan(lo) or math.isnan(hi) else "infinite"
    raise CheckpointError(f"{what} holds {kind} values: the file is damaged (no finite logits can come from it)")


class Checkpoint:
    """The tensors of a checkpoint, read lazily: names, shapes, and one tensor at a time."""

    def __init__(self, where: Path):
        self.where = where
        self._getters: dict[str, Callable[[], Tensor]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self.mapped: set[str] = set()  # tensors that live in a read-only file mapping
        self.hf_config: dict | None = None
        self.ggml = None  # the GgmlTensors of a GGUF / rwkv.cpp file
        self._finite: set[str] = set()  # the tensors `get` has checked (one read twice is checked once)

    def add(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, getter: Callable[[], Tensor], mapped: bool = False
    ) -> None:
        if name in self._getters:
            raise CheckpointError(f"{self.where}: tensor {name!r} appears twice")
        if mapped:
            self.mapped.add(name)
        self._getters[name] = getter
        self._shapes[name] = tuple(shape)
        self._dtypes[name] = dtype

    def keys(self) -> list[str]:
        return list(self._getters)

    def __contains__(self, name: str) -> bool:
        return name in self._getters

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        return self._dtypes[name]

    def get(self, name: str) -> Tensor:
        """The tensor `name` as read (dequantized, in BlinkDL's layout), refused if it holds NaN or
        infinite values: every reader's tensors come through here, each as the load needs it, so
        the check reads the pages the load's transform or copy reads right after."""
        t = self._getters[name]()
        if name not in self._finite:
            check_finite(t, f"{self.where}: tensor {name}")
            self._finite.add(name)
        return t

    def weights_dtype(self) -> torch.dtype:
        """The dtype that holds most of the bytes of the checkpoint's matrices."""
        share: dict[torch.dtype, int] = {}
        for k in self._getters:
            if len(self._shapes[k]) == 2 and self._dtypes[k].is_floating_point:
                share[self._dtypes[k]] = share.get(self._dtypes[k], 0) + math.prod(self._shapes[k])
        return max(share, key=share.get) if share else torch.float32

    def select(self, names: dict[str, str], where: Path | None = None) -> Checkpoint:
        """A checkpoint of some of these tensors, under new names ({old: new}), read lazily as these are."""
        sub = Checkpoint(where or self.where)
        for old, new in names.items():
            sub.add(new, self._shapes[old], self._dtypes[old], self._getters[old], mapped=old in self.mapped)
        return sub

    def rename(self, mapping: Callable[[str], str], transposed: Callable[[str], bool] = lambda name: False) -> None:
        """New names for every tensor; the 2-D ones for which `transposed(old name)` holds are transposed."""
        getters, shapes, dtypes, mapped = self._getters, self._shapes, self._dtypes, self.mapped
        self._getters, self._shapes, self._dtypes, self.mapped = {}, {}, {}, set()
        for k in getters:
            if transposed(k) and len(shapes[k]) == 2:  # a copy: no longer the mapped tensor
                self.add(mapping(k), shapes[k][::-1], dtypes[k], lambda g=getters[k]: g().t().contiguous())
            else:
                self.add(mapping(k), shapes[k], dtypes[k], getters[k], mapped=k in mapped)


def _sniff(path: Path) -> str:
    """'torch-zip', 'torch-legacy' or 'safetensors', from the file's first bytes."""
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: the file is empty")
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    ggml_kind = ggml.sniff(head)
    if ggml_kind is not None:
        return ggml_kind
    if head[:1] == b"\x80" and len(head) > 1 and head[1] <= 5:
        return "torch-legacy"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= size - 8 and head[8:9] == b"{":
            return "safetensors"
        if head[8:9] == b"{":
            raise CheckpointError(f"{path}: the safetensors file is truncated (header of {n} bytes, file of {size})")
    raise CheckpointError(f"{path}: not a checkpoint (neither a PyTorch .pth/.bin nor a safetensors file)")


def _add_torch_file(ck: Checkpoint, path: Path, kind: str) -> None:
    size = path.stat().st_size
    if kind == "torch-legacy" and size >= progress.MIN_BYTES:
        print(
            f"note: {path} is in PyTorch's legacy (pre-1.6, non-zip) format, which cannot be memory-mapped: "
            f"its {size / 1e9:.1f} GB are read into memory whole before converting. Re-save it once in the "
            f'zip format to load it one tensor at a time: python -c "import torch, sys; '
            f'torch.save(torch.load(sys.argv[1], weights_only=True), sys.argv[2])" OLD.pth NEW.pth',
            file=sys.stderr,
            flush=True,
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=kind == "torch-zip")
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "central directory" in msg or "zip archive" in msg or isinstance(e, EOFError):
            msg = "the file is truncated or corrupt"
        raise CheckpointError(f"{path}: cannot read the PyTorch checkpoint: {msg}") from None
    except Exception as e:  # pickle.UnpicklingError for weights_only violations and garbage
        raise CheckpointError(f"{path}: not a plain PyTorch state dict ({type(e).__name__}: {str(e)[:200]})") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, found a {type(obj).__name__}")
    for k, v in obj.items():
        if isinstance(k, str) and k in _PIP_CONVERTED_KEYS:
            raise CheckpointError(
                f"{path}: this file was converted by the `rwkv` pip package (it has a {k!r} entry); "
                "load the original checkpoint instead"
            )
        if k == RERANKER_LAYERS and isinstance(v, (list, tuple)) and all(type(i) is int for i in v):
            v = torch.tensor(v, dtype=torch.long)
        if not isinstance(k, str) or not isinstance(v, Tensor):
            raise CheckpointError(f"{path}: expected a flat dict of tensors, but {k!r} is a {type(v).__name__}")
        ck.add(k, v.shape, v.dtype, lambda v=v: v, mapped=kind == "torch-zip")


def _add_safetensors_file(ck: Checkpoint, path: Path) -> None:
    from safetensors import safe_open

    try:
        f = safe_open(str(path), framework="pt", device="cpu")
        names = list(f.keys())
        slices = {k: f.get_slice(k) for k in names}
        shapes = {k: sl.get_shape() for k, sl in slices.items()}
        dtypes = {k: SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.uint8) for k, sl in slices.items()}
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read the safetensors file ({str(e).splitlines()[0][:200]})") from None
    for k in names:
        ck.add(k, shapes[k], dtypes[k], lambda k=k, f=f: f.get_tensor(k), mapped=True)


def _add_file(ck: Checkpoint, path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    kind = _sniff(path)
    if kind in ("gguf", "rwkv.cpp"):
        _add_ggml_file(ck, path, kind)
    elif kind == "safetensors":
        _add_safetensors_file(ck, path)
    else:
        _add_torch_file(ck, path, kind)


def _add_ggml_file(ck: Checkpoint, path: Path, kind: str) -> None:
    """A GGUF or rwkv.cpp file: its tensors under BlinkDL's names, dequantized when read; the
    Q8_0 matrices also as our int8 layout (`Plan.tensors` takes them as they are for q8)."""
    from . import gguf, rwkvcpp

    found = (gguf if kind == "gguf" else rwkvcpp).read(path)
    for name, (shape, dtype, getter) in found.tensors.items():
        ck.add(name, shape, dtype, getter)
    ck.ggml = found


_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def open_checkpoint(path: Path) -> Checkpoint:
    ck = Checkpoint(path)
    if path.is_file():
        _add_file(ck, path)
        return ck
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory")
    config = path / "config.json"
    if config.is_file():
        try:
            ck.hf_config = json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{config}: not valid JSON ({e})") from None
        if not isinstance(ck.hf_config, dict):
            raise CheckpointError(f"{config}: not a JSON object")
        for name in _HF_WEIGHTS:
            if (path / name).is_file():
                break
        else:
            raise CheckpointError(f"{path}: a model directory needs one of {', '.join(_HF_WEIGHTS)}")
        if name.endswith(".index.json"):
            try:
                weight_map = json.loads((path / name).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{path / name}: not a valid shard index ({e})") from None
            for shard in sorted(set(weight_map.values())):
                _add_file(ck, path / shard)
        else:
            _add_file(ck, path / name)
        return ck
    candidates = sorted(p for p in path.iterdir() if p.suffix in (".pth", ".safetensors", ".pt"))
    if len(candidates) == 1:
        _add_file(ck, candidates[0])
        ck.where = candidates[0]
        return ck
    if not candidates:
        raise CheckpointError(f"{path}: no config.json and no checkpoint file in this directory")
    raise CheckpointError(f"{path}: several checkpoints here ({', '.join(p.name for p in candidates[:5])}); name one")


class SafetensorsWriter:
    """A safetensors file written one tensor at a time, in any order, from the names, shapes and
    dtypes known up front (the header comes first in the format). Nothing is buffered: each
    tensor's bytes go straight from its memory to the file, so a whole model never sits in
    memory twice (safetensors' own save_file copies every tensor into bytes first)."""

    def __init__(self, path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], metadata: dict | None = None):
        # Widest elements first (then by name), as safetensors lays files out: every tensor aligned.
        order = sorted(specs, key=lambda k: (-specs[k][1].itemsize, k))
        header: dict = {"__metadata__": metadata or {}}
        self.slots: dict[str, tuple[int, int]] = {}
        pos = 0
        for k in order:
            shape, dt = specs[k]
            n = math.prod(shape) * dt.itemsize
            header[k] = {"dtype": SAFETENSORS_CODES[dt], "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-(8 + len(blob)) % 8)
        base = 8 + len(blob)
        self.slots = {
            k: (base + header[k]["data_offsets"][0], header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
            for k in order
        }
        self.specs = specs
        self.written: set[str] = set()
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        os.pwrite(self.fd, len(blob).to_bytes(8, "little") + blob, 0)
        os.ftruncate(self.fd, base + pos)

    def write(self, name: str, t: torch.Tensor) -> None:
        if name not in self.slots or name in self.written:
            raise CheckpointError(
                f"{self.path}: unexpected tensor {name!r}" + (" (twice)" if name in self.written else "")
            )
        shape, dt = self.specs[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dt:
            raise CheckpointError(f"{self.path}: tensor {name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dt}")
        offset, n = self.slots[name]
        if n:
            data = memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < n:
                done += os.pwrite(self.fd, data[done:], offset + done)
        self.written.add(name)

    def close(self, check: bool = True) -> None:
        missing = sorted(set(self.slots) - self.written)
        os.close(self.fd)
        if check and missing:
            raise CheckpointError(f"{self.path}: {len(missing)} tensor(s) never written: {', '.join(missing[:3])}")
