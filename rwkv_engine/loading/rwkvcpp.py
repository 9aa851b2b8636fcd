"""rwkv.cpp model files (`.bin`, RWKV-4 / 5 / 6 / 7), read into BlinkDL's names and layouts.

The file (rwkv.cpp docs/FILE_FORMAT.md): an int32 header (magic 0x67676d66, version 100 or 101,
n_vocab, n_embed, n_layer, data type), then until the end of the file, per tensor: int32
dim_count, key_length, data type; dim_count int32 sizes (innermost first); the UTF-8 name; the
data. Types: 0 FP32, 1 FP16, 2 Q4_0, 3 Q4_1, 7 Q5_0, 8 Q5_1, 9 Q8_0 (ggml's blocks; version 100
holds the older quantized layouts, refused).

Its converter (python/convert_pytorch_to_ggml.py) squeezed every `.time_` tensor and applied,
undone here:
* RWKV-4: time_decay -> -exp(time_decay); so time_decay = log(-w);
* RWKV-5: time_decay -> exp(-exp(time_decay)) (-> log(-log(w))), time_first -> exp(time_first)
  (-> log u), both with trailing unit axes; time_faaaa unsqueezed;
* RWKV-6: time_faaaa unsqueezed, time_decay reshaped (H, N, 1), time_maa_w1 and time_decay_w1/w2
  transposed, time_maa_w2 transposed to (5, C, D);
* RWKV-7: x_r, x_w, x_k, x_v, x_a, x_g concatenated into x_rwkvag; the LoRA matrices transposed.
ln0 stays in the file (blocks.0.ln0.*); the loader folds it as for a .pth.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError
from ..quant.ggml_quants import TYPES, dequantize, nbytes, q8_0_split
from .ggml import GgmlTensors

# rwkv.cpp's type ids -> ggml's
_TYPE = {0: 0, 1: 1, 2: 2, 3: 3, 7: 6, 8: 7, 9: 8}
_MAGIC = 0x67676D66


def _inverse(name: str, t: torch.Tensor, version: str, shape: tuple[int, ...]) -> torch.Tensor:
    if version == "7" and any(name.endswith(s) for s in (".w1", ".w2", ".a1", ".a2", ".v1", ".v2", ".g1", ".g2")):
        return t.t().contiguous()
    if version == "6":
        if name.endswith((".time_maa_w1", ".time_decay_w1", ".time_decay_w2")):
            return t.t().contiguous()
        if name.endswith(".time_maa_w2"):
            return t.transpose(1, 2).contiguous()
        if name.endswith((".time_faaaa", ".time_decay")):
            return t.reshape(shape)
    if version == "5":
        if name.endswith(".time_decay"):
            return torch.log(-torch.log(t.double())).float().reshape(shape)
        if name.endswith(".time_first"):
            return torch.log(t.double()).float().reshape(shape)
        if name.endswith(".time_faaaa"):
            return t.reshape(shape)
    if version == "4" and name.endswith(".time_decay"):
        return torch.log(-t.double()).float()
    return t


def read(path: Path) -> GgmlTensors:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24:
            raise CheckpointError(f"{path}: the rwkv.cpp file is truncated (a header of {len(head)} bytes)")
        magic, version, n_vocab, n_embed, n_layer, _ = struct.unpack("<6i", head)
        if magic != _MAGIC:
            raise CheckpointError(f"{path}: not an rwkv.cpp model file")
        if version not in (100, 101):
            raise CheckpointError(f"{path}: rwkv.cpp file version {version}; versions 100 and 101 are read")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    entries = []
    pos = 24
    while pos < size:
        if pos + 12 > size:
            raise CheckpointError(f"{path}: the rwkv.cpp file is truncated (a tensor header at byte {pos})")
        n_dims, key_len, dtype = struct.unpack_from("<3i", mm, pos)
        if not 1 <= n_dims <= 4 or not 0 < key_len < 1024:
            raise CheckpointError(f"{path}: corrupt tensor header at byte {pos} ({n_dims} dims, a name of {key_len})")
        pos += 12
        if pos + 4 * n_dims + key_len > size:
            raise CheckpointError(f"{path}: the rwkv.cpp file is truncated (a tensor header at byte {pos})")
        dims = struct.unpack_from(f"<{n_dims}i", mm, pos)
        pos += 4 * n_dims
        name = bytes(mm[pos : pos + key_len]).decode("utf-8", errors="replace")
        pos += key_len
        if dtype not in _TYPE:
            raise CheckpointError(
                f"{path}: tensor {name} has rwkv.cpp data type {dtype}, which is not one of {sorted(_TYPE)}"
            )
        tid = _TYPE[dtype]
        if version == 100 and tid not in (0, 1):
            raise CheckpointError(
                f"{path}: a version-100 rwkv.cpp file with quantized tensors (the pre-2023-05-27 layouts); "
                "re-quantize it with a current rwkv.cpp"
            )
        shape = tuple(reversed(dims))
        numel = math.prod(shape)
        bs = TYPES[tid][1]
        if shape[-1] % bs:
            raise CheckpointError(f"{path}: tensor {name} of shape {shape} does not fit {TYPES[tid][0]} blocks")
        n = nbytes(tid, numel)
        if pos + n > size:
            raise CheckpointError(
                f"{path}: the rwkv.cpp file is truncated (tensor {name} needs {n} bytes at {pos}, the file has {size})"
            )
        entries.append((name, tid, shape, pos, n))
        pos += n
    names = {e[0] for e in entries}
    if "blocks.0.att.k_k" in names:
        version_ = "7"
    elif "blocks.0.att.time_maa_x" in names:
        version_ = "6"
    elif "blocks.0.att.ln_x.weight" in names:
        version_ = "5"
    else:
        version_ = "4"
    out = GgmlTensors(path, "rwkv.cpp")
    for name, tid, shape, off, n in entries:

        def raw(off=off, n=n) -> torch.Tensor:
            return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=n, offset=off).copy())

        tname = TYPES[tid][0]
        declared = {"F32": torch.float32, "F16": torch.float16}.get(tname, torch.bfloat16)
        if name.endswith(".x_rwkvag"):
            p = name[: -len("x_rwkvag")]
            C = shape[-1]
            for j, c in enumerate("rwkvag"):
                out.tensors[p + "x_" + c] = (
                    (C,),
                    torch.float32,
                    lambda r=raw, t=tid, s=shape, j=j: dequantize(r(), t, s).reshape(6, -1)[j],
                )
                out.types[p + "x_" + c] = tname
            continue
        target = _target_shape(name, shape, version_)

        def get(r=raw, t=tid, s=shape, nm=name, ts=target):
            return _inverse(nm, dequantize(r(), t, s), version_, ts)

        out.tensors[name] = (target, declared, get)
        out.types[name] = tname
        if tname == "Q8_0" and len(shape) == 2 and name.endswith(".weight"):  # a linear layer's matrix
            out.q8[name] = lambda r=raw, s=shape: q8_0_split(r(), s)
    if not out.tensors:
        raise CheckpointError(f"{path}: the rwkv.cpp file has no tensors")
    if "emb.weight" in out.tensors and out.tensors["emb.weight"][0] != (n_vocab, n_embed):
        raise CheckpointError(
            f"{path}: emb.weight is {out.tensors['emb.weight'][0]}, the header says {(n_vocab, n_embed)}"
        )
    del n_layer
    return out


def _target_shape(name: str, shape: tuple[int, ...], version: str) -> tuple[int, ...]:
    """The BlinkDL shape of a tensor after _inverse (the converter's unit axes dropped)."""
    lora = (".w1", ".w2", ".a1", ".a2", ".v1", ".v2", ".g1", ".g2")
    if version == "7" and name.endswith(lora):
        return shape[::-1]
    if version == "6":
        if name.endswith((".time_maa_w1", ".time_decay_w1", ".time_decay_w2")):
            return shape[::-1]
        if name.endswith(".time_maa_w2"):
            return (shape[0], shape[2], shape[1])
        if name.endswith(".time_faaaa"):
            return shape[:2]
        if name.endswith(".time_decay"):
            return (math.prod(shape),)
    if version == "5" and name.endswith((".time_decay", ".time_first", ".time_faaaa")):
        while len(shape) > 1 and shape[-1] == 1:
            shape = shape[:-1]
        return shape
    return shape
