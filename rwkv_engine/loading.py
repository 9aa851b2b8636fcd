"""Loading RWKV checkpoints: BlinkDL .pth / .safetensors files, Hugging Face model directories, hub ids.

The steps, each done once:
1. resolve: a local file or directory, or a Hugging Face Hub id (downloaded through huggingface_hub);
2. open: the file type is sniffed from its bytes, never its name; tensors stay memory-mapped and
   are read one at a time, so no second full copy of the weights is made;
3. canonical names: Hugging Face and flash-linear-attention names are mapped back to BlinkDL's
   (FORMATS B.1-B.4), with fla's transposed LoRA matrices turned back;
4. config: version and sizes from the keys and tensor shapes (and config.json when there is one);
5. transform: ln0 folded into the embedding, decays to log space (RWKV-6 keeps its raw base decay,
   the per-token part is data-dependent), mixes squeezed and put in one convention (RWKV-6/7's
   x + (prev - x) m is stored as 1 - m), fp16 rescale, dtype cast (RWKV-6/7's small LoRA matrices
   keep the checkpoint's type); every tensor checked against
   the shape the model expects; a state-tuned file's time_state (RWKV-6/7) becomes the model's
   initial state;
6. build: the module tree is created on the meta device and the tensors are assigned into it.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import converted
from .config import ModelConfig
from .errors import CheckpointError, InputError, UnsupportedModelError
from .memory import release_free_memory, release_pages, spill, to_huge_pages, tune_malloc
from .models import RWKV
from .models.layers import lora_dtype
from .quant.schemes import applied_scheme, convert_weight, describe, get_scheme, plan, replace_module

Tensor = torch.Tensor

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
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
        self._dtypes: dict[str, torch.dtype] = {}
        self.mapped: set[str] = set()  # tensors that live in a read-only file mapping
        self.hf_config: dict | None = None

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
        return self._getters[name]()

    def weights_dtype(self) -> torch.dtype:
        """The dtype that holds most of the bytes of the checkpoint's matrices."""
        share: dict[torch.dtype, int] = {}
        for k in self._getters:
            if len(self._shapes[k]) == 2 and self._dtypes[k].is_floating_point:
                share[self._dtypes[k]] = share.get(self._dtypes[k], 0) + math.prod(self._shapes[k])
        return max(share, key=share.get) if share else torch.float32

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
    if kind == "torch-legacy" and size >= _PROGRESS_MIN_BYTES:
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
        dtypes = {k: _SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.uint8) for k, sl in slices.items()}
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read the safetensors file ({str(e).splitlines()[0][:200]})") from None
    for k in names:
        ck.add(k, shapes[k], dtypes[k], lambda k=k, f=f: f.get_tensor(k), mapped=True)


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}


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
    "time_mix_key": "time_mix_k",
    "time_mix_value": "time_mix_v",
    "time_mix_receptance": "time_mix_r",
    "time_mix_gate": "time_mix_g",
}


# flash-linear-attention RWKV-7 (fla-hub/rwkv7-*, FORMATS B.4)
_FLA_TOP = {
    "model.embeddings.weight": "emb.weight",
    "model.norm.weight": "ln_out.weight",
    "model.norm.bias": "ln_out.bias",
    "lm_head.weight": "head.weight",
}
_FLA_PARTS = {"attn": "att", "ffn": "ffn", "pre_norm": "ln0", "attn_norm": "ln1", "ffn_norm": "ln2"}
_FLA_PROJ = {"r_proj": "receptance", "k_proj": "key", "v_proj": "value", "o_proj": "output", "g_norm": "ln_x"}
# LoRA(x) = lora.2(act(lora.0(x))): lora.0.weight = w1^T, lora.2.weight = w2^T, lora.2.bias = w0.
_FLA_LORA = re.compile(r"([wavg])_lora\.lora\.(0\.weight|2\.weight|2\.bias)")
_FLA_LORA_INDEX = {"0.weight": "1", "2.weight": "2", "2.bias": "0"}


def _fla_name(name: str) -> str:
    if name in _FLA_TOP:
        return _FLA_TOP[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(\w+)\.(.+)", name)
    if not m:
        return name
    i, part, rest = m.groups()
    part = _FLA_PARTS.get(part, part)
    if part == "att":
        lora = _FLA_LORA.fullmatch(rest)
        if lora:
            rest = lora.group(1) + _FLA_LORA_INDEX[lora.group(2)]
        else:
            head, dot, tail = rest.partition(".")
            rest = _FLA_PROJ.get(head, head) + dot + tail
    return f"blocks.{i}.{part}.{rest}"


def stored_transposed(name: str) -> bool:
    """Whether a tensor is stored as the transpose of its BlinkDL counterpart (fla's LoRA weights)."""
    return name.startswith("model.layers.") and re.search(r"_lora\.lora\.[02]\.weight$", name) is not None


def canonical_name(name: str) -> str:
    """BlinkDL's name for a transformers RWKV-4/5/6, fla RWKV-7 (or BlinkDL) tensor name."""
    if name.startswith("model.") or name == "lm_head.weight":
        return _fla_name(name)
    if name.startswith("rwkv."):
        name = name[5:]
        if name.startswith("embeddings."):
            return "emb." + name[len("embeddings.") :]
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
    if keys and all(k.endswith(".att.time_state") for k in keys):
        raise CheckpointError(
            f"{ck.where}: a state-only file (time_state tensors, no weights); merge its tensors "
            "into the checkpoint of the model it was tuned on and load that"
        )
    if "emb.weight" not in ck or not any(k.startswith("blocks.") for k in keys):
        raise CheckpointError(f"{ck.where}: not an RWKV checkpoint (no emb.weight / blocks.* tensors)")
    if any(".att.time_misc_" in k for k in keys):
        raise UnsupportedModelError(
            f"{ck.where}: an RWKV-7 preview checkpoint (time_misc_* names); rwkv-engine runs the released x070 format"
        )
    if any(k.endswith((".att.r_k", ".att.x_r", ".att.w0")) for k in keys):
        if any(".ffn.s_emb" in k for k in keys):
            raise UnsupportedModelError(
                f"{ck.where}: an RWKV-7 DeepEmbed checkpoint (ffn.s_emb); rwkv-engine runs standard RWKV-7 only"
            )
        return "7"
    if any("time_maa" in k for k in keys):
        return "6.0"
    version = "4"
    if any(".ln_x." in k for k in keys):
        version = "5.0"
        if any(k.endswith(".att.gate.weight") for k in keys):
            version = "5.1"
        shape = ck.shape("blocks.0.att.time_decay") if "blocks.0.att.time_decay" in ck else ()
        if len(shape) > 1 and shape[1] > 1:
            version = "5.2"
    return version


def _size(ck: Checkpoint, name: str, axis: int) -> int:
    """The size of tensor `name` along `axis`, or a CheckpointError naming the tensor."""
    if name not in ck:
        raise CheckpointError(f"{ck.where}: tensor {name} is missing")
    shape = ck.shape(name)
    if len(shape) <= axis:
        raise CheckpointError(f"{ck.where}: tensor {name} has shape {shape}, expected at least {axis + 1} dimensions")
    return shape[axis]


# config.json model_type -> the RWKV family its weights must be
_HF_MODEL_TYPES = {"rwkv": 4, "rwkv5": 5, "rwkv6": 6, "rwkv7": 7}


def infer_config(ck: Checkpoint) -> ModelConfig:
    hf = ck.hf_config
    if hf is not None:
        mt = hf.get("model_type")
        if mt not in _HF_MODEL_TYPES:
            raise CheckpointError(f"{ck.where}: config.json says model_type {mt!r}, not an RWKV model")
    version = _version(ck)
    family = int(float(version))
    if hf is not None and _HF_MODEL_TYPES[mt] != family:
        raise CheckpointError(f"{ck.where}: config.json says model_type {mt!r} but the weights are RWKV-{version}")
    blocks = {int(m.group(1)) for k in ck.keys() if (m := re.match(r"blocks\.(\d+)\.", k))}
    n_layer = max(blocks) + 1
    missing = sorted(set(range(n_layer)) - blocks)
    if missing:
        raise CheckpointError(f"{ck.where}: blocks {missing[:5]} are missing (the file has blocks up to {n_layer - 1})")
    V, C = ck.shape("emb.weight")
    A = _size(ck, "blocks.0.att.key.weight", 0)
    F_ = _size(ck, "blocks.0.ffn.key.weight", 0)
    n_head, lora = 0, {}
    if family in (4, 5):
        n_head = _size(ck, "blocks.0.att.time_decay", 0) if family == 5 else 0
    elif family == 6:
        n_head = _size(ck, "blocks.0.att.time_faaaa", 0)
        lora = dict(
            lora_mix=_size(ck, "blocks.0.att.time_maa_w2", 1), lora_decay=_size(ck, "blocks.0.att.time_decay_w1", 1)
        )
    else:  # 7; layer 0's value-residual LoRA is unused (and absent in fla files): read layer 1's
        n_head = _size(ck, "blocks.0.att.r_k", 0)
        lora = dict(
            lora_decay=_size(ck, "blocks.0.att.w1", 1),
            lora_iclr=_size(ck, "blocks.0.att.a1", 1),
            lora_gate=_size(ck, "blocks.0.att.g1", 1),
            lora_value=_size(ck, "blocks.1.att.v1", 1) if n_layer > 1 else 0,
        )
    head_size = A // n_head if n_head else 0
    cfg = ModelConfig(
        version=version,
        n_layer=n_layer,
        n_embd=C,
        vocab_size=V,
        ffn_dim=F_,
        dim_att=A,
        n_head=n_head,
        head_size=head_size,
        **lora,
    )
    if hf is not None:
        checks = [("num_hidden_layers", n_layer), ("hidden_size", C), ("vocab_size", V)]
        if family == 6:
            checks += [("head_size", head_size), ("attention_hidden_size", A)]
        if family == 7:  # flash-linear-attention's config (FORMATS B.4)
            checks += [
                ("head_dim", head_size),
                ("num_heads", n_head),
                ("decay_low_rank_dim", cfg.lora_decay),
                ("a_low_rank_dim", cfg.lora_iclr),
                ("gate_low_rank_dim", cfg.lora_gate),
            ]
            if n_layer > 1:
                checks.append(("v_low_rank_dim", cfg.lora_value))
        for field, value in checks:
            if field in hf and hf[field] is not None and hf[field] != value:
                raise CheckpointError(f"{ck.where}: config.json says {field}={hf[field]} but the weights have {value}")
    return cfg


# --- 5. transform --------------------------------------------------------------------------


# RWKV-6/7 token-shift mixes, x + (prev - x) * m: stored as 1 - m, the shared `mix` convention
_REVERSED_MIX = re.compile(r"\.(att\.time_maa_[xwkvrg]|ffn\.time_maa_[kr]|att\.x_[rwkvag]|ffn\.x_k)$")


def _target_name(name: str, family: int) -> str | None:
    """Our module's parameter name for a canonical tensor name (None: consumed elsewhere)."""
    if name.startswith("blocks.0.ln0."):
        return None
    if family >= 6 and name.endswith(".att.time_state"):
        return None  # the initial state, see initial_state()
    if family == 6:
        name = re.sub(r"\.time_maa_([xwkvrg])$", r".mix_\1", name)
        name = re.sub(r"\.att\.time_maa_(w[12])$", r".att.maa_\1", name)
        name = re.sub(r"\.att\.time_decay$", ".att.decay_base", name)
        name = re.sub(r"\.att\.time_decay_(w[12])$", r".att.decay_\1", name)
        return re.sub(r"\.att\.time_faaaa$", ".att.bonus", name)
    if family == 7:
        if re.fullmatch(r"blocks\.0\.att\.v[012]", name):
            return None  # layer 0 has no value residual (its values are v_first)
        return re.sub(r"\.x_([rwkvag])$", r".mix_\1", name)
    name = re.sub(r"\.time_mix_([kvrg])$", r".mix_\1", name)
    name = re.sub(r"\.att\.time_decay$", ".att.log_decay", name)
    name = re.sub(r"\.att\.time_(first|faaaa)$", ".att.bonus", name)
    return name


def _transform(
    name: str, t: Tensor, cfg: ModelConfig, dtype: torch.dtype, rescale_every: int, real_bonus: bool
) -> Tensor:
    """The tensor our module holds for the canonical tensor `name`."""
    layer = int(name.split(".")[1]) if name.startswith("blocks.") else 0
    if cfg.family >= 6:
        if _REVERSED_MIX.search(name):
            return 1 - t.float().reshape(-1)
        if name.endswith(".att.time_decay"):  # RWKV-6: raw; each token adds its LoRA before -exp
            return t.float().reshape(-1)
        if name.endswith(".att.r_k"):
            return t.float().reshape(cfg.n_head, cfg.head_size)
        if re.search(r"\.att\.(w0|a0|v0|k_k|k_a)$", name):
            return t.float().reshape(-1)
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
    return t.float()  # LayerNorm / GroupNorm weights and biases (the LoRA matrices: Plan.tensors)


_CHUNK_ELEMS = 1 << 22  # elements per step of the chunked embedding transform


def _embedding(src: Tensor, ln0_w: Tensor, ln0_b: Tensor, dtype: torch.dtype) -> Tensor:
    """The embedding with ln0 folded in (FORMATS A.7), computed in row chunks: no fp32 copy of the
    whole table (1 GB at the 7B shape)."""
    V, C = src.shape
    out = torch.empty(V, C, dtype=dtype)
    w, b = ln0_w.float(), ln0_b.float()
    rows = max(1, _CHUNK_ELEMS // C)
    for r0 in range(0, V, rows):
        out[r0 : r0 + rows] = F.layer_norm(src[r0 : r0 + rows].float(), (C,), w, b).to(dtype)
    return out


class Progress:
    """Tensors and bytes done while loading or converting a big model: a tqdm bar on a terminal,
    else one summary line on stderr at the end; nothing for models under _PROGRESS_MIN_BYTES."""

    def __init__(self, what: str, total_bytes: int, n_tensors: int, enabled: bool):
        self.what, self.total, self.n = what, total_bytes, n_tensors
        self.done_tensors = 0
        self.enabled = enabled and total_bytes >= _PROGRESS_MIN_BYTES
        self.bar = None
        self.start = time.perf_counter()
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                desc=what,
                file=sys.stderr,
                leave=False,
                postfix=f"0/{n_tensors} tensors",
            )

    def update(self, nbytes: int) -> None:
        self.done_tensors += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.done_tensors}/{self.n} tensors", refresh=False)
            self.bar.update(nbytes)

    def close(self, ok: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled and ok:
            s = time.perf_counter() - self.start
            print(
                f"{self.what}: {self.done_tensors} tensors, {self.total / 1e9:.2f} GB in {s:.1f} s "
                f"({self.total / 1e9 / max(s, 1e-9):.2f} GB/s)",
                file=sys.stderr,
                flush=True,
            )


def _check_names(ck: Checkpoint, cfg: ModelConfig, expected) -> dict[str, str | None]:
    """{canonical name: our parameter name or None}, after checking no tensor is unknown or missing."""
    mapping = {k: _target_name(k, cfg.family) for k in ck.keys()}
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
    return mapping


class Plan:
    """A checkpoint about to be loaded: the model on the meta device with its final modules (the
    linear layers already of the kinds the scheme gives them), and `tensors()`, which reads,
    transforms and quantizes the checkpoint one tensor at a time.

    `load` assigns what `tensors()` yields into the model; `converted.convert` writes it to disk
    and keeps nothing. Either way, at most a couple of source tensors are in flight: the peak
    memory is the result (for `load`) plus about twice the largest tensor in fp32.
    """

    def __init__(
        self,
        ck: Checkpoint,
        cfg: ModelConfig,
        dtype: torch.dtype,
        rescale_every: int,
        scheme,
        policy,
        dtype_reason: str,
    ):
        self.ck, self.cfg, self.dtype, self.rescale_every = ck, cfg, dtype, rescale_every
        with torch.device("meta"):
            self.model = RWKV(cfg, dtype, rescale_every)
        self.model.dtype_reason = dtype_reason
        # The biggest tensors first (the embedding and the head): the transients of reading them
        # (their source pages, the folded embedding's rows) then add to a small result, not to
        # nearly the whole model's, which sets the peak of a quantizing load.
        self.mapping = dict(
            sorted(_check_names(ck, cfg, self.model.state_dict()).items(), key=lambda kv: -math.prod(ck.shape(kv[0])))
        )
        # The LoRA matrices keep a 16-bit checkpoint's type: their values exactly, in half the
        # memory of fp32 (770 MB at the 7B shape); the modules upcast them where they are used.
        self.lora = set(self.model.lora_names())
        self.lora_dtype = lora_dtype({ck.dtype(k) for k, t in self.mapping.items() if t in self.lora})
        self.model.set_lora_dtype(self.lora_dtype)
        self.expected = {k: (tuple(v.shape), v.dtype) for k, v in self.model.state_dict().items()}
        if scheme is None:
            scheme = _dense_scheme(dtype)
        self.targets = plan(self.model, scheme, policy=policy)
        report = {name: describe(t) for name, t in self.targets.items()}
        # The matrices the policy kept (too small to quantize) become DenseLinear in their own
        # dtype, so every matrix of a decode step runs through the same per-row kernels.
        for name, module in self.model.named_modules():
            if type(module) is nn.Linear and module.bias is None and name not in self.targets:
                self.targets[name] = _dense_scheme(module.weight.dtype)
        for name, target in self.targets.items():
            replace_module(self.model, name, convert_weight(self.model.get_submodule(name).weight, target, empty=True))
        self.model.quantization = applied_scheme(scheme, self.targets, dtype)
        self.model.quantization_report = report
        self.model.initial_state = {}
        self.huge_pages = False  # tensors() puts the weights on huge pages (load sets it on the CPU)

    def initial_state(self) -> dict[str, Tensor]:
        return initial_state(self.ck, self.cfg)

    def source_bytes(self) -> int:
        ck = self.ck
        return sum(math.prod(ck.shape(k)) * _itemsize(ck, k) for k, t in self.mapping.items() if t is not None)

    def tensors(self, progress: Progress | None = None):
        """Yield {our state-dict name: tensor} for one source tensor at a time (a quantized
        linear's weight gives its module's buffers)."""
        ck, cfg, dtype = self.ck, self.cfg, self.dtype
        real_bonus = any(k.endswith(".time_faaaa") for k in ck.keys())
        for name, target in self.mapping.items():
            if target is None:
                continue
            src = ck.get(name)
            nbytes = src.numel() * src.element_size()
            module, _, leaf = target.rpartition(".")
            linear = self.targets.get(module) if leaf == "weight" else None
            dt = dtype
            if linear is not None and linear.weights != "dense" and src.dtype.itemsize < dtype.itemsize:
                dt = src.dtype  # quantized from the narrower type: the same values, no wide copy
            if name == "emb.weight":
                t = _embedding(src, ck.get("blocks.0.ln0.weight"), ck.get("blocks.0.ln0.bias"), dtype)
            elif target in self.lora:
                t = src.to(self.lora_dtype)
            else:
                t = _transform(name, src, cfg, dt, self.rescale_every, real_bonus)
            want = self.expected[target][0]
            if tuple(t.shape) != want:
                raise CheckpointError(
                    f"{ck.where}: tensor {name} has shape {tuple(ck.shape(name))}, expected {want} for this model"
                )
            if linear is not None:
                new = convert_weight(t, linear)
                out = {f"{module}.{k}": v for k, v in new.state_dict().items()}
            else:
                out = {target: t}
            if self.huge_pages:  # the weights a decode step streams (memory.to_huge_pages)
                out = {k: v if k == "emb.weight" else to_huge_pages(v) for k, v in out.items()}
            if name in ck.mapped and all(
                v.untyped_storage().data_ptr() != src.untyped_storage().data_ptr() for v in out.values()
            ):
                release_pages(src)  # consumed: its file pages need not stay resident
            del src, t
            release_free_memory()  # the transients' pages, before the next tensor's
            yield out
            if progress is not None:
                progress.update(nbytes)


def _dense_scheme(dtype: torch.dtype):
    return get_scheme(_DENSE_SCHEME[dtype])


def _itemsize(ck: Checkpoint, name: str) -> int:
    return ck.dtype(name).itemsize


def initial_state(ck: Checkpoint, cfg: ModelConfig) -> dict[str, Tensor]:
    """A state-tuned RWKV-6/7 file's learned initial wkv state: {"att_kv": [L, H, N, N]}, or {}.

    Each block's time_state [H, N, N] is stored [value][key] in both versions, and att_kv is
    [key][value] in both (state.py), so one transpose (1, 2) serves both (FORMATS A.4, A.9).
    RWKV-6: the `rwkv` pip package starts from time_state.transpose(1, 2) (tested against it).
    RWKV-7: the pip package has no time_state path (0.8.32, the latest); the layout is the one
    of the trainer that writes these files and of an engine that reads them:
    * JL-er/RWKV-PEFT rwkvt/rwkv7/att.py @022e5653: time_state is an (H, N, N) parameter of each
      x070 block; rwkvt/operator/rwkvop.py @74f44431 (and Joluck/RWKV-PEFT @0283fcf1) hands
      time_state.transpose(1, 2) to fla's chunk_rwkv7 as initial_state, which fla documents as
      [B, H, K, V] (fla-org/flash-linear-attention fla/ops/rwkv7/fused_recurrent.py @0315a70e),
      the same transpose that file uses for x060; its Wind Triton path passes time_state as is
      to a kernel whose state rows are values (y = S r, S += v k^T);
    * cryscan/web-rwkv src/runtime/v7.rs @1991c4bb read_state is the same as v6.rs @063a9b39
      read_state, and its time_mix_v6/v7 kernels keep the state in the same orientation
      (Ai00-X/ai00_server loads state files and a model file's own time_state through it).
    The trainer also saves state-only files (the blocks.{i}.att.time_state tensors alone); they
    are merged into the base checkpoint (RWKV-PEFT merge/merge_state.py) before loading here.
    """
    names = [f"blocks.{i}.att.time_state" for i in range(cfg.n_layer)]
    present = [n in ck for n in names]
    if cfg.family < 6 or not any(present):
        return {}
    if not all(present):
        absent = [i for i, p in enumerate(present) if not p]
        raise CheckpointError(
            f"{ck.where}: time_state is missing in blocks {absent[:5]} (a state-tuned file has one per block)"
        )
    H, N = cfg.n_head, cfg.head_size
    states = []
    for n in names:
        shape = tuple(ck.shape(n))
        while len(shape) > 3 and shape[0] == 1:  # leading unit axes (a batch of one) are harmless
            shape = shape[1:]
        if shape != (H, N, N):
            raise CheckpointError(
                f"{ck.where}: tensor {n} has shape {tuple(ck.shape(n))}, expected {(H, N, N)} ({H} heads of {N}x{N})"
            )
        states.append(ck.get(n).float().reshape(H, N, N).transpose(1, 2))
    return {"att_kv": torch.stack(states).contiguous()}


# --- 6. build ------------------------------------------------------------------------------


_DENSE_SCHEME = {torch.float32: "q0f32", torch.bfloat16: "q0bf16", torch.float16: "q0f16"}


def load(
    path_or_id: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = "auto",
    *,
    quantization: str | None = None,
    group_size: int | None = None,
    policy=None,
    rescale_every: int | None = None,
    progress: bool = True,
) -> RWKV:
    """Load an RWKV model from a checkpoint file, a model directory or a Hugging Face Hub id.

    dtype: "auto" (default; None means the same), "fp32", "bf16" or "fp16": the model dtype, in
    which the matrices are stored (unless quantized) and the activations enter them; the state,
    the recurrence and the norms are fp32. "auto" keeps a 16-bit checkpoint's type (fp32 stays
    fp32); quantized, the activations take the checkpoint's 16-bit type where the device computes
    in it fast and fp32 elsewhere (`auto_dtype`); a quantization name that implies a dtype
    (e.g. "q4f16_1" -> fp16) gives that one. `model.dtype_reason` says which rule chose it.
    quantization: a scheme of rwkv_engine.quant ("q8", "q4", "q0bf16", MLC names like
    "q4f16_1"); the weights are quantized while they are read, one tensor at a time. group_size
    and policy go to `rwkv_engine.quant.quantize_model`.
    rescale_every: halve the residual every this many blocks (default: 6 for fp16, off otherwise).
    progress: for a model of 256 MB or more, a progress bar on stderr when it is a terminal, else
    one summary line there.
    """
    tune_malloc()
    plan_ = prepare(
        path_or_id,
        device,
        dtype,
        quantization=quantization,
        group_size=group_size,
        policy=policy,
        rescale_every=rescale_every,
    )
    if not isinstance(plan_, Plan):  # a converted directory or an exported program: loaded as it is
        return plan_
    device = plan_.device
    plan_.huge_pages = device.type == "cpu"  # each tensor as it comes: no second copy of the model
    model = plan_.model
    bar = Progress("loading", plan_.source_bytes(), len(plan_.mapping), progress)
    sd: dict[str, Tensor] = {}
    rows = None
    ok = False
    try:
        for tensors in plan_.tensors(bar):
            if "emb.weight" in tensors and device.type == "cpu":  # its rows read from a file, as a directory's
                tensors["emb.weight"], rows = spill(tensors["emb.weight"])
            sd.update(tensors)
        ok = True
    finally:
        bar.close(ok)
    model.load_state_dict(sd, strict=True, assign=True)
    model.emb.file_rows = rows
    model.initial_state = plan_.initial_state()
    del sd, plan_
    return _finish(model, model.path, device)


def prepare(
    path_or_id: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = "auto",
    *,
    quantization: str | None = None,
    group_size: int | None = None,
    policy=None,
    rescale_every: int | None = None,
):
    """The Plan of loading a checkpoint (see `load`), or the loaded model for a converted directory
    or an exported program."""
    scheme = None
    if quantization is not None:
        scheme = get_scheme(quantization, group_size)
    elif group_size is not None:
        raise InputError("group_size is only meaningful with a quantization scheme")
    auto = dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto")
    explicit = None if auto else parse_dtype(dtype)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"device: {e}") from None
    path = resolve(path_or_id)
    if _is_exported_program(path):  # an ExecuTorch .pte: its own runtime, nothing to convert
        return _load_program(path, device, dtype, quantization, group_size, policy)
    hf_config = _peek_config(path)
    if converted.is_converted(hf_config):  # already transformed and quantized: map it in
        model = converted.load(path, hf_config, explicit, quantization)
        model.dtype_reason = "explicit" if explicit is not None else "the converted directory's"
        return _finish(model, path, device)
    ck = open_checkpoint(path)
    ck.rename(canonical_name, transposed=stored_transposed)
    cfg = infer_config(ck)
    implied = scheme.dtype if scheme is not None else None
    if explicit is not None:
        if implied is not None and implied != explicit:
            raise InputError(
                f"quantization {quantization!r} implies dtype {str(implied)[6:]}, but dtype {dtype!r} was asked for"
            )
        dt, reason = explicit, "explicit"
    elif implied is not None:
        dt, reason = implied, f"implied by {quantization}"
    else:
        dt, reason = auto_dtype(ck.weights_dtype(), device, quantized=scheme is not None and scheme.weights != "dense")
    if scheme is not None and scheme.weights == "dense" and scheme.dtype is None:
        scheme = None
    if rescale_every is None:
        rescale_every = FP16_RESCALE_EVERY if dt == torch.float16 else 0
    p = Plan(ck, cfg, dt, rescale_every, scheme, policy, reason)
    p.device = device
    p.model.path = path
    return p


def auto_dtype(weights: torch.dtype, device: torch.device, quantized: bool) -> tuple[torch.dtype, str]:
    """(model dtype, why) for `dtype="auto"`, given the dtype of the checkpoint's matrices.

    Dense: the checkpoint's own type (a 16-bit file stays 16-bit in memory; fp32 stays fp32);
    each GEMM then runs in `compute_dtype` of it (bf16 with AVX512-BF16 / AMX and on CUDA, fp32
    tiles on CPUs where bf16 matmuls are slow). Quantized: the weights no longer need the type,
    so the activations take `compute_dtype` of it directly.
    """
    from .quant.linear import compute_dtype

    name = converted.DTYPE_NAMES.get(weights, "fp32")
    if weights not in (torch.bfloat16, torch.float16):
        return torch.float32, f"auto: {name} checkpoint"
    if not quantized:
        return weights, f"auto: {name} checkpoint"
    ct = compute_dtype(weights, device)
    return ct, f"auto: {name} checkpoint, {converted.DTYPE_NAMES[ct]} matmuls on {device.type}"


def _is_exported_program(path: Path) -> bool:
    from .export.runtime import is_program

    return is_program(path)


def _load_program(path: Path, device, dtype, quantization, group_size, policy):
    """An exported program (rwkv_engine/export): its weights and quantization are fixed at export."""
    if str(device) != "cpu":
        raise InputError(f"{path} is an exported ExecuTorch program: it runs on the CPU (device cpu), not {device}")
    fixed = dtype not in (None, "auto", "fp32", torch.float32)
    if fixed or any(x is not None for x in (quantization, group_size, policy)):
        raise InputError(
            f"{path} is an exported ExecuTorch program: its dtype and quantization were fixed "
            f"when it was exported (drop --dtype / --quantization)"
        )
    from .export.runtime import ProgramModel

    return ProgramModel(path)


def _finish(model: RWKV, path: Path, device: torch.device) -> RWKV:
    model.requires_grad_(False)
    model.eval()
    model.path = path
    return model.to(device)


def _peek_config(path: Path) -> dict | None:
    """config.json of a model directory, if it has a readable one (open_checkpoint reports errors)."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return None
