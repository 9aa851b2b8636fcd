"""Loading RWKV checkpoints: BlinkDL .pth / .safetensors files, Hugging Face model directories, hub ids.

The steps, each done once:
1. resolve: a local file or directory, or a Hugging Face Hub id (downloaded through huggingface_hub);
2. open: the file type is sniffed from its bytes, never its name; tensors stay memory-mapped and
   are read one at a time, so no second full copy of the weights is made;
3. canonical names: Hugging Face names are mapped back to BlinkDL's (FORMATS B.1, B.2);
4. config: version and sizes from the keys and tensor shapes (and config.json when there is one);
5. transform: ln0 folded into the embedding, decays to log space, mixes squeezed, fp16 rescale,
   dtype cast; every tensor checked against the shape the model expects;
6. build: the module tree is created on the meta device and the tensors are assigned into it.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
import zipfile
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .errors import CheckpointError, InputError, UnsupportedModelError
from .models import RWKV

Tensor = torch.Tensor

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}

# With fp16 weights, halve the residual every this many blocks (FORMATS A.7, RESCALE_LAYER).
FP16_RESCALE_EVERY = 6

_PROGRESS_MIN_BYTES = 256 << 20

# Keys that only the `rwkv` pip package's own converted files contain.
_PIP_CONVERTED_KEYS = ("_strategy", "_version", "_rescale_layer")


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise InputError(f"dtype must be one of fp32, bf16, fp16; got {dtype!r}")


# --- 1. resolve ----------------------------------------------------------------------------

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w./-]+)?")


def resolve(path_or_id: str | os.PathLike) -> Path:
    """A local path, or a hub id `org/name` (or `org/name/file.pth`) fetched into the HF cache."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        return path
    text = str(path_or_id)
    if not _HUB_ID.fullmatch(text) or text.startswith((".", "/", "~")):
        raise CheckpointError(f"{text}: no such file or directory")
    try:
        import huggingface_hub as hub

        parts = text.split("/")
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        if filename:
            return Path(hub.hf_hub_download(repo, filename))
        files = hub.list_repo_files(repo)
        if "config.json" not in files:
            weights = [f for f in files if f.endswith((".pth", ".safetensors", ".bin"))]
            raise CheckpointError(
                f"{text}: the hub repository has no config.json; name one checkpoint file in it, "
                f"e.g. {repo}/{weights[0] if weights else 'FILE.pth'}"
            )
        patterns = ["*.json", "*.txt", "*.safetensors"]
        if not any(f.endswith(".safetensors") for f in files):
            patterns.append("*.bin")
        return Path(hub.snapshot_download(repo, allow_patterns=patterns))
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{text}: not a local file, and fetching it from the Hugging Face Hub failed ({type(e).__name__}: {e})"
        ) from None


# --- 2. open -------------------------------------------------------------------------------


class Checkpoint:
    """The tensors of a checkpoint, read lazily: names, shapes, and one tensor at a time."""

    def __init__(self, where: Path):
        self.where = where
        self._getters: dict[str, Callable[[], Tensor]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.hf_config: dict | None = None

    def add(self, name: str, shape: tuple[int, ...], getter: Callable[[], Tensor]) -> None:
        if name in self._getters:
            raise CheckpointError(f"{self.where}: tensor {name!r} appears twice")
        self._getters[name] = getter
        self._shapes[name] = tuple(shape)

    def keys(self) -> list[str]:
        return list(self._getters)

    def __contains__(self, name: str) -> bool:
        return name in self._getters

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str) -> Tensor:
        return self._getters[name]()

    def rename(self, mapping: Callable[[str], str]) -> None:
        getters, shapes = self._getters, self._shapes
        self._getters, self._shapes = {}, {}
        for k in getters:
            self.add(mapping(k), shapes[k], getters[k])


def _sniff(path: Path) -> str:
    """'torch-zip', 'torch-legacy' or 'safetensors', from the file's first bytes."""
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: the file is empty")
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
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
        if not isinstance(k, str) or not isinstance(v, Tensor):
            raise CheckpointError(f"{path}: expected a flat dict of tensors, but {k!r} is a {type(v).__name__}")
        ck.add(k, v.shape, lambda v=v: v)


def _add_safetensors_file(ck: Checkpoint, path: Path) -> None:
    from safetensors import safe_open

    try:
        f = safe_open(str(path), framework="pt", device="cpu")
        names = list(f.keys())
        shapes = {k: f.get_slice(k).get_shape() for k in names}
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read the safetensors file ({str(e).splitlines()[0][:200]})") from None
    for k in names:
        ck.add(k, shapes[k], lambda k=k, f=f: f.get_tensor(k))


def _add_file(ck: Checkpoint, path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    kind = _sniff(path)
    if kind == "safetensors":
        _add_safetensors_file(ck, path)
    else:
        _add_torch_file(ck, path, kind)


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


# --- 3. canonical (BlinkDL) names --------------------------------------------------------------

_HF_RENAMES = {
    "time_mix_key": "time_mix_k", "time_mix_value": "time_mix_v",
    "time_mix_receptance": "time_mix_r", "time_mix_gate": "time_mix_g",
}


def canonical_name(name: str) -> str:
    """BlinkDL's name for a transformers RWKV-4/5 (or BlinkDL) tensor name."""
    if name.startswith("rwkv."):
        name = name[5:]
        if name.startswith("embeddings."):
            return "emb." + name[len("embeddings."):]
        m = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.(.+)", name)
        if m:
            i, part, rest = m.groups()
            part = {"pre_ln": "ln0", "attention": "att", "feed_forward": "ffn"}.get(part, part)
            rest = _HF_RENAMES.get(rest, rest)
            return f"blocks.{i}.{part}.{rest}"
    return name


# --- 4. config -----------------------------------------------------------------------------


def _version(ck: Checkpoint) -> str:
    keys = ck.keys()
    if any(k.endswith((".att.r_k", ".att.x_r", ".att.w0")) for k in keys):
        raise UnsupportedModelError(f"{ck.where}: an RWKV-7 (x070) checkpoint; this version of rwkv-engine runs RWKV-4 and RWKV-5")
    if any("time_maa" in k for k in keys):
        raise UnsupportedModelError(f"{ck.where}: an RWKV-6 checkpoint; this version of rwkv-engine runs RWKV-4 and RWKV-5")
    if "emb.weight" not in ck or not any(k.startswith("blocks.") for k in keys):
        raise CheckpointError(f"{ck.where}: not an RWKV checkpoint (no emb.weight / blocks.* tensors)")
    version = "4"
    if any(".ln_x." in k for k in keys):
        version = "5.0"
        if any(k.endswith(".att.gate.weight") for k in keys):
            version = "5.1"
        shape = ck.shape("blocks.0.att.time_decay") if "blocks.0.att.time_decay" in ck else ()
        if len(shape) > 1 and shape[1] > 1:
            version = "5.2"
    return version


def infer_config(ck: Checkpoint) -> ModelConfig:
    hf = ck.hf_config
    if hf is not None:
        mt = hf.get("model_type")
        if mt in ("rwkv6", "rwkv7"):
            raise UnsupportedModelError(f"{ck.where}: a {mt} model; this version of rwkv-engine runs RWKV-4 and RWKV-5")
        if mt not in ("rwkv", "rwkv5"):
            raise CheckpointError(f"{ck.where}: config.json says model_type {mt!r}, not an RWKV-4/5 model")
    version = _version(ck)
    blocks = {int(m.group(1)) for k in ck.keys() if (m := re.match(r"blocks\.(\d+)\.", k))}
    n_layer = max(blocks) + 1
    missing = sorted(set(range(n_layer)) - blocks)
    if missing:
        raise CheckpointError(f"{ck.where}: blocks {missing[:5]} are missing (the file has blocks up to {n_layer - 1})")
    V, C = ck.shape("emb.weight")
    need = ["blocks.0.att.key.weight", "blocks.0.ffn.key.weight", "blocks.0.att.time_decay"]
    for k in need:
        if k not in ck:
            raise CheckpointError(f"{ck.where}: tensor {k} is missing")
    A = ck.shape("blocks.0.att.key.weight")[0]
    F_ = ck.shape("blocks.0.ffn.key.weight")[0]
    n_head = head_size = 0
    if version != "4":
        n_head = ck.shape("blocks.0.att.time_decay")[0]
        head_size = A // n_head if n_head else 0
    cfg = ModelConfig(version=version, n_layer=n_layer, n_embd=C, vocab_size=V, ffn_dim=F_, dim_att=A,
                      n_head=n_head, head_size=head_size)
    if hf is not None:
        for field, value in (("num_hidden_layers", n_layer), ("hidden_size", C), ("vocab_size", V)):
            if field in hf and hf[field] is not None and hf[field] != value:
                raise CheckpointError(f"{ck.where}: config.json says {field}={hf[field]} but the weights have {value}")
    return cfg


# --- 5. transform --------------------------------------------------------------------------


def _target_name(name: str) -> str | None:
    """Our module's parameter name for a canonical tensor name (None: consumed elsewhere)."""
    if name.startswith("blocks.0.ln0."):
        return None
    name = re.sub(r"\.time_mix_([kvrg])$", r".mix_\1", name)
    name = re.sub(r"\.att\.time_decay$", ".att.log_decay", name)
    name = re.sub(r"\.att\.time_(first|faaaa)$", ".att.bonus", name)
    return name


def _transform(name: str, t: Tensor, cfg: ModelConfig, dtype: torch.dtype, rescale_every: int, real_bonus: bool) -> Tensor:
    """The tensor our module holds for the canonical tensor `name`."""
    layer = int(name.split(".")[1]) if name.startswith("blocks.") else 0
    if name.endswith(".time_decay"):
        t = -torch.exp(t.float())
        if cfg.family == 4:
            t = t.reshape(-1)
        else:
            t = t.reshape(cfg.n_head, -1).expand(cfg.n_head, cfg.head_size)
        return t.contiguous()
    if name.endswith((".time_first", ".time_faaaa")):
        t = t.float()
        if cfg.family == 4:
            t = t.reshape(-1)
        else:
            if not real_bonus:  # RWKV-5.0/5.1 store log(u) as time_first
                t = torch.exp(t)
            t = t.reshape(cfg.n_head, -1).expand(cfg.n_head, cfg.head_size)
        return t.contiguous()
    if ".time_mix_" in name:
        return t.float().reshape(-1)
    if name.endswith(".weight") and t.dim() == 2:  # the big matrices and the head
        if rescale_every and name.endswith((".att.output.weight", ".ffn.value.weight")):
            return (t.float() / 2 ** (layer // rescale_every)).to(dtype)
        return t.to(dtype)
    return t.float()  # LayerNorm / GroupNorm weights and biases


def build_state_dict(ck: Checkpoint, cfg: ModelConfig, model: RWKV, dtype: torch.dtype, rescale_every: int,
                     progress: bool) -> dict[str, Tensor]:
    expected = model.state_dict()
    real_bonus = any(k.endswith(".time_faaaa") for k in ck.keys())
    mapping = {k: _target_name(k) for k in ck.keys()}
    unknown = sorted(k for k, t in mapping.items() if t is not None and t not in expected)
    if unknown:
        raise CheckpointError(
            f"{ck.where}: {len(unknown)} unknown tensor(s) for an RWKV-{cfg.version} model: {', '.join(unknown[:5])}"
        )
    have = {t for t in mapping.values() if t is not None}
    missing = sorted(k for k in expected if k not in have and k != "emb.weight")
    if "blocks.0.ln0.weight" not in ck or "blocks.0.ln0.bias" not in ck:
        missing.insert(0, "blocks.0.ln0.weight/bias")
    if missing:
        raise CheckpointError(f"{ck.where}: {len(missing)} tensor(s) missing: {', '.join(missing[:5])}")

    total = sum(math.prod(ck.shape(k)) for k in ck.keys()) * torch.finfo(dtype).bits // 8
    bar = None
    if progress and total >= _PROGRESS_MIN_BYTES:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading", file=sys.stderr, leave=False)
    out: dict[str, Tensor] = {}
    try:
        for name, target in mapping.items():
            if target is None:
                continue
            t = ck.get(name)
            if name == "emb.weight":
                t = F.layer_norm(t.float(), (cfg.n_embd,), ck.get("blocks.0.ln0.weight").float(),
                                 ck.get("blocks.0.ln0.bias").float()).to(dtype)
            else:
                t = _transform(name, t, cfg, dtype, rescale_every, real_bonus)
            want = tuple(expected[target].shape)
            if tuple(t.shape) != want:
                raise CheckpointError(
                    f"{ck.where}: tensor {name} has shape {tuple(ck.shape(name))}, expected {want} for this model"
                )
            out[target] = t
            if bar is not None:
                bar.update(t.numel() * torch.finfo(dtype).bits // 8)
    finally:
        if bar is not None:
            bar.close()
    return out


# --- 6. build ------------------------------------------------------------------------------


def load(
    path_or_id: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "fp32",
    *,
    rescale_every: int | None = None,
    progress: bool = True,
) -> RWKV:
    """Load an RWKV model from a checkpoint file, a model directory or a Hugging Face Hub id.

    dtype: "fp32" | "bf16" | "fp16" for the weights (the state and the recurrence are fp32).
    rescale_every: halve the residual every this many blocks (default: 6 for fp16, off otherwise).
    """
    dt = parse_dtype(dtype)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"device: {e}") from None
    if rescale_every is None:
        rescale_every = FP16_RESCALE_EVERY if dt == torch.float16 else 0
    path = resolve(path_or_id)
    ck = open_checkpoint(path)
    ck.rename(canonical_name)
    cfg = infer_config(ck)
    with torch.device("meta"):
        model = RWKV(cfg, dt, rescale_every)
    sd = build_state_dict(ck, cfg, model, dt, rescale_every, progress)
    model.load_state_dict(sd, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.path = path
    return model.to(device)
