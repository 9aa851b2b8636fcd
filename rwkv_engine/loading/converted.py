"""rwkv-engine's own model directory: a loaded (and possibly quantized) model written to disk.

    OUT/config.json          {"model_type": "rwkv-engine", "rwkv_engine": {format, config, dtype,
                              rescale_every, quantization, linears: {name: [kind, group_size]},
                              checked_finite}}
                              (kind "kquant": [kind, ggml type], the blocks as KQuantLinear holds them)
    OUT/model.safetensors    the model's state dict after every load-time transform (log decays,
                              folded ln0, fp16 rescale) and quantization: packed weights and scales;
                              RWKV-6/7 LoRA matrices in the source's 16-bit type (fp32 in older
                              directories, which load as they are)
    OUT/tokenizer.json or rwkv_vocab_v20230424.txt   the tokenizer the model uses

Loading it maps the safetensors file and assigns its tensors into modules of the recorded kinds:
nothing is transformed or quantized again. `save` writes into a temporary directory beside OUT and
renames it into place at the end, so an interrupted convert never leaves a directory that loads.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import CheckpointError, InputError
from ..quant.schemes import replace_module
from .formats import DTYPE_NAMES, SafetensorsWriter, check_finite, dtype_of
from .progress import Progress

FORMAT = 1
MODEL_TYPE = "rwkv-engine"
_INITIAL = "initial_state."


def is_converted(hf_config: dict | None) -> bool:
    return isinstance(hf_config, dict) and hf_config.get("model_type") == MODEL_TYPE


def _linear_kinds(model) -> dict[str, list]:
    from ..quant import DenseLinear, Int4Linear, Int8Linear, KQuantLinear

    kinds = {}
    for name, m in model.named_modules():
        if isinstance(m, KQuantLinear):
            kinds[name] = ["kquant", m.qtype]
        elif isinstance(m, Int4Linear):
            kinds[name] = ["int4", m.group_size]
        elif isinstance(m, Int8Linear):
            kinds[name] = ["int8", m.group_size if m.group_size != m.in_features else None]
        elif isinstance(m, DenseLinear):
            kinds[name] = ["dense", DTYPE_NAMES[m.weight.dtype]]
        elif isinstance(m, torch.nn.Linear):
            kinds[name] = ["linear", DTYPE_NAMES[m.weight.dtype]]
    return kinds


def _meta(model, scheme) -> dict:
    return {
        "format": FORMAT,
        "config": dataclasses.asdict(model.config),
        "dtype": DTYPE_NAMES[model.dtype],
        "rescale_every": model.rescale_every,
        "quantization": scheme.to_dict() if scheme is not None else None,
        "linears": _linear_kinds(model),
        # Every tensor was checked finite as it was read for writing (convert: the checkpoint's,
        # by Checkpoint.get; save: the model's): `load` need not read them all a second time.
        # Directories written before this record are checked when loaded.
        "checked_finite": True,
    }


OWNER_FILE = ".writer"  # in a partial directory: {"pid", "host"} of the process writing it


def _remove_stale_partials(out: Path) -> None:
    """Remove the partial directories beside `out` that a killed convert left (their writer, on
    this host, is no longer running); say so on stderr. A live writer's directory is kept."""
    removed = 0
    for d in out.resolve().parent.glob(f".{glob.escape(out.name)}.partial-*"):
        try:
            owner = json.loads((d / OWNER_FILE).read_text())
            pid, host = int(owner["pid"]), owner["host"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to judge (no owner file: an older version's, or not a convert's)
        if host != socket.gethostname() or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or another user's process): kept
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    if removed:
        print(
            f"rwkv-engine: removed {removed} partial director{'y' if removed == 1 else 'ies'} of interrupted "
            f"converts beside {out}",
            file=sys.stderr,
        )


def _write_dir(out: Path, model, specs: dict, write_tensors, tokenizer_source: Path | None) -> Path:
    """Write the directory beside `out` and rename it into place once complete. write_tensors(writer)
    writes every tensor of `specs` through the SafetensorsWriter it is given."""
    out = Path(out)
    if out.exists():
        raise InputError(f"{out}: already exists; choose a new output directory")
    if not out.resolve().parent.is_dir():
        raise InputError(f"{out.parent}: no such directory")
    _remove_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.resolve().parent))
    try:
        (tmp / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        writer = SafetensorsWriter(tmp / "model.safetensors", specs, {"format": "pt"})
        try:
            write_tensors(writer)
        except BaseException:
            writer.close(check=False)
            raise
        writer.close()
        meta = _meta(model, model.quantization)
        config = {
            "architectures": ["RWKV"],
            "model_type": MODEL_TYPE,
            "vocab_size": model.config.vocab_size,
            "num_hidden_layers": model.config.n_layer,
            "hidden_size": model.config.n_embd,
            "rwkv_engine": meta,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer_source is not None:
            shutil.copy(tokenizer_source, tmp / tokenizer_source.name)
        (tmp / OWNER_FILE).unlink()
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save(model, out: str | os.PathLike, tokenizer_source: Path | None = None) -> Path:
    """Write `model` (in memory) as an rwkv-engine directory at `out`, which must not exist."""
    tensors = dict(model.state_dict())
    tensors.update({_INITIAL + k: v for k, v in model.initial_state.items()})
    specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}

    def write(w: SafetensorsWriter) -> None:
        for k, v in tensors.items():
            check_finite(v, f"{out}: tensor {k}")
            w.write(k, v)

    return _write_dir(Path(out), model, specs, write, tokenizer_source)


def convert(plan, out: str | os.PathLike, tokenizer_source: Path | None = None, progress: bool = True) -> Path:
    """Write the checkpoint of a Plan as an rwkv-engine directory at `out`, one tensor at a
    time: each is read, transformed, quantized and written before the next is read, so the peak
    memory is a few tensors, not the model. A built plan's model (a converted directory) is
    written again as it is."""
    if plan.built:
        return save(plan.model, out, tokenizer_source)
    model = plan.model
    initial = plan.initial_state()
    specs = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    specs.update({_INITIAL + k: (tuple(v.shape), v.dtype) for k, v in initial.items()})

    def write(w: SafetensorsWriter) -> None:
        for k, v in initial.items():
            w.write(_INITIAL + k, v.contiguous())
        bar = Progress("converting", plan.source_bytes(), len(plan.mapping), progress)
        ok = False
        try:
            for tensors in plan.tensors(bar):
                for k, v in tensors.items():
                    w.write(k, v)
                del tensors
            ok = True
        finally:
            bar.close(ok)

    return _write_dir(Path(out), model, specs, write, tokenizer_source)


def _tensor_offset(weights: Path, name: str) -> int:
    """Byte offset of tensor `name`'s data in a safetensors file: after the 8-byte header length
    and the JSON header, at the tensor's `data_offsets[0]`."""
    with open(weights, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return 8 + n + int(header[name]["data_offsets"][0])


def _read_embedding_rows(model, weights: Path) -> None:
    """Let the embedding read its rows from the file (memory.FileRows) instead of faulting in
    pages of the mapping, where the platform has pread."""
    from ..memory import FileRows

    emb = model.emb
    if not FileRows.available() or not emb.weight.is_contiguous():
        return
    offset = _tensor_offset(weights, "emb.weight")
    emb.file_rows = FileRows(weights, offset, tuple(emb.weight.shape), emb.weight.dtype, emb.weight)


def load(path: Path, hf_config: dict, dtype: torch.dtype | None, quantization) -> torch.nn.Module:
    """Build the model recorded in an rwkv-engine directory (on the CPU) from its mapped tensors."""
    from safetensors import safe_open

    from ..memory import release_pages, to_huge_pages
    from ..models.layers import lora_dtype
    from ..quant import get_scheme

    meta = hf_config.get("rwkv_engine")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: an rwkv-engine directory of an unknown format version")
    try:
        cfg = ModelConfig(**meta["config"])
        dt = dtype_of(meta["dtype"])
        linears = meta["linears"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path}/config.json: incomplete rwkv_engine section ({e})") from None
    if dtype is not None and dtype != dt:
        raise InputError(f"{path} was converted for dtype {meta['dtype']}; convert it again for another dtype")
    q = meta.get("quantization")
    if quantization is not None and (q is None or get_scheme(quantization).name != q.get("name")):
        raise InputError(
            f"{path} is already converted (quantization {q and q.get('name')}); "
            "load it without --quantization, or convert the original checkpoint"
        )
    model = _empty_model(cfg, dt, meta.get("rescale_every", 0), linears)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{path}: model.safetensors is missing")
    try:
        f = safe_open(str(weights), framework="pt", device="cpu")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{weights}: cannot read ({str(e).splitlines()[0][:200]})") from None
    initial = {k[len(_INITIAL) :]: tensors.pop(k) for k in list(tensors) if k.startswith(_INITIAL)}
    # The LoRA matrices are in the source checkpoint's 16-bit type, or fp32 (every directory
    # written before they kept it): the type they have in the file.
    model.set_lora_dtype(lora_dtype({tensors[k].dtype for k in model.lora_names() if k in tensors}))
    _check_tensors(weights, tensors, model.state_dict())
    unchecked = not meta.get("checked_finite")  # (written before convert checked every tensor)
    for k, t in tensors.items():  # the weights a decode step streams, to huge pages (memory.py)
        if k != "emb.weight" and (moved := to_huge_pages(t, mapped=True)) is not t:
            release_pages(t)  # the file's pages of it, now copied
            tensors[k] = t = moved
        if unchecked:
            check_finite(t, f"{weights}: tensor {k}")  # each as it is loaded (the copy's pages are resident)
    for k, t in initial.items() if unchecked else ():
        check_finite(t, f"{weights}: tensor {_INITIAL}{k}")
    model.load_state_dict(tensors, strict=True, assign=True)
    _read_embedding_rows(model, weights)
    model.initial_state = initial
    model.quantization = get_scheme(q["name"], q.get("group_size")) if q else None
    model.quantization_report = {
        name: " ".join(str(a) for a in kind if a is not None) for name, kind in linears.items()
    }
    return model


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, rescale_every: int, linears: dict) -> torch.nn.Module:
    """The model on the meta device, each linear of the kind the directory records."""
    from ..models import RWKV
    from ..quant import DenseLinear, Int4Linear, Int8Linear, KQuantLinear

    with torch.device("meta"):
        model = RWKV(cfg, dtype, rescale_every)
        for name, (kind, arg) in linears.items():
            old = model.get_submodule(name)
            K, N = old.in_features, old.out_features
            if kind == "kquant":
                new = KQuantLinear(K, N, arg)
            elif kind == "int4":
                new = Int4Linear(K, N, arg)
            elif kind == "int8":
                new = Int8Linear(K, N, arg)
            elif kind == "dense":
                new = DenseLinear(K, N, dtype=dtype_of(arg))
            else:  # kept as the model builds it; DenseLinear for the same CPU paths as the rest
                new = DenseLinear(K, N, dtype=old.weight.dtype)
            replace_module(model, name, new)
    return model


def _check_tensors(weights: Path, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every tensor the model expects, of its shape and dtype (old directories' fp32 int8 scales
    are converted in `tensors`)."""
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise CheckpointError(
            f"{weights}: does not match its config.json (missing {missing[:3]}, unknown {unknown[:3]})"
        )
    for k, t in list(tensors.items()):
        if k.endswith(".scales") and t.dtype == torch.float32 and expected[k].dtype == torch.float16:
            # int8 scales were fp32 in directories written before they became fp16 (Q8_0-style)
            tensors[k] = t = t.half()
        if tuple(t.shape) != tuple(expected[k].shape) or t.dtype != expected[k].dtype:
            raise CheckpointError(
                f"{weights}: tensor {k} is {tuple(t.shape)} {t.dtype}, "
                f"expected {tuple(expected[k].shape)} {expected[k].dtype}"
            )
