"""llama.cpp's GGUF files of RWKV-6 and RWKV-7 (architectures "rwkv6" / "rwkv7"), read with the
`gguf` package into BlinkDL's names and layouts.

llama.cpp's converter (convert_hf_to_gguf.py, Rwkv6Model / Rwkv7Model) renames every tensor
(blk.N.time_mix_*, channel_mix_*, token_embd, token_embd_norm = ln0, output, output_norm), drops
the unit axes, and changes a few layouts; each is undone here:

* RWKV-7: the six token-shift mixes x_r, x_w, x_k, x_v, x_a, x_g are stacked in that order into
  time_mix_lerp_fused; the LoRA matrices w1/w2, a1/a2, v1/v2, g1/g2 are stored transposed; r_k is
  flattened to (C,); layer 0 holds dummy v0/v1/v2 (copies of a0/a1/a2; unused here too).
* RWKV-6: time_maa_w, _k, _v, _r, _g are stacked in that order into time_mix_lerp_fused;
  time_maa_w1 and time_decay_w1/w2 are transposed, time_maa_w2 is (5, C, D) for our (5, D, C);
  with `rescale_every_n_layers` r > 0 in the metadata, layer i's att.output and ffn.value were
  divided by 2^(i // r) (llama.cpp halves its residual to match): multiplied back here, exactly.

ln0 stays a separate tensor (token_embd_norm), so the loader folds it as for a .pth. The
tokenizer must be the World vocabulary (tokenizer.ggml.model "rwkv"), id for id.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, UnsupportedModelError
from ..memory import release_pages
from ..quant.ggml_quants import BY_NAME, KQUANT, QUANTIZED, TYPES, dequantize, nbytes, q8_0_split, scale_blocks
from .ggml import GgmlTensors, RowSource

_ARCHS = ("rwkv6", "rwkv7")

_TOP = {
    "token_embd.weight": "emb.weight",
    "token_embd_norm.weight": "blocks.0.ln0.weight",
    "token_embd_norm.bias": "blocks.0.ln0.bias",
    "output_norm.weight": "ln_out.weight",
    "output_norm.bias": "ln_out.bias",
    "output.weight": "head.weight",
}

_BLOCK = {
    "attn_norm": "ln1",
    "attn_norm_2": "ln2",
    "time_mix_ln": "att.ln_x",
    "time_mix_key": "att.key",
    "time_mix_value": "att.value",
    "time_mix_receptance": "att.receptance",
    "time_mix_output": "att.output",
    "time_mix_gate": "att.gate",
    "channel_mix_key": "ffn.key",
    "channel_mix_value": "ffn.value",
    "channel_mix_receptance": "ffn.receptance",
}
# Vectors stored as "<name>.weight"; value: BlinkDL name per architecture.
_V6_VECTORS = {
    "time_mix_lerp_x": "att.time_maa_x",
    "time_mix_decay": "att.time_decay",
    "time_mix_first": "att.time_faaaa",
    "channel_mix_lerp_k": "ffn.time_maa_k",
    "channel_mix_lerp_r": "ffn.time_maa_r",
}
_V7_VECTORS = {
    "time_mix_w0": "att.w0",
    "time_mix_a0": "att.a0",
    "time_mix_v0": "att.v0",
    "time_mix_k_k": "att.k_k",
    "time_mix_k_a": "att.k_a",
    "time_mix_r_k": "att.r_k",
    "channel_mix_lerp_k": "ffn.x_k",
}
_V7_LORA = {f"time_mix_{x}{i}": f"att.{x}{i}" for x in "wavg" for i in "12"}
_V6_LORA = {
    "time_mix_w1": "att.time_maa_w1",
    "time_mix_w2": "att.time_maa_w2",
    "time_mix_decay_w1": "att.time_decay_w1",
    "time_mix_decay_w2": "att.time_decay_w2",
}
_FUSED = {
    "rwkv6": ("time_maa_w", "time_maa_k", "time_maa_v", "time_maa_r", "time_maa_g"),
    "rwkv7": tuple("x_" + c for c in "rwkvag"),
}


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # an old gguf package without contents(): the last part is the value
        v = f.parts[f.data[0]]
        return v.tobytes().decode() if v.dtype == np.uint8 else v.item()


def world_token_texts() -> list[str | None]:
    """The World vocabulary as llama.cpp's converter writes it: id 0 "<s>", then repr(bytes)[2:-1];
    None for the ids the vocabulary leaves unused (the converter pads them "[PAD<id>]")."""
    from ..tokenizer.world import load_vocab

    vocab = load_vocab()
    return ["<s>"] + [repr(t)[2:-1] if t is not None else None for t in vocab[1:]]


def check_tokenizer(reader, path: Path) -> None:
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        return  # no tokenizer in the file: the model's vocabulary size decides, as for a .pth
    if model != "rwkv":
        raise UnsupportedModelError(
            f"{path}: the GGUF's tokenizer is {model!r}, not the RWKV World tokenizer ('rwkv') this engine uses"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    world = world_token_texts()
    n = min(len(tokens), len(world))
    for i in range(n):
        if world[i] is not None and tokens[i] != world[i]:
            raise UnsupportedModelError(
                f"{path}: the GGUF's vocabulary differs from the RWKV World tokenizer at id {i} "
                f"({tokens[i][:40]!r}, World has {world[i][:40]!r}); only World-vocabulary files are supported"
            )
    extra = [t for t in tokens[n:] if not re.fullmatch(r"\[PAD\d+\]|<pad>|", t)]
    if extra:
        raise UnsupportedModelError(
            f"{path}: the GGUF's vocabulary has {len(tokens)} tokens, more than the World tokenizer's {len(world)}"
        )


def read(path: Path) -> GgmlTensors:
    """The BlinkDL-named tensors of an RWKV-6/7 GGUF file (nothing is read from them yet)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the `gguf` package (pip install gguf)") from None
    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path), "r")
    except (ValueError, KeyError, IndexError, OSError, TypeError) as e:
        msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        if isinstance(e, ValueError) and "GGMLQuantizationType" in msg:
            raise CheckpointError(f"{path}: the GGUF file has a tensor of an unknown ggml type ({msg})") from None
        raise CheckpointError(f"{path}: cannot read the GGUF file, truncated or corrupt ({msg})") from None
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(
            f"{path}: a GGUF of architecture {arch!r}; rwkv-engine reads RWKV-6 and RWKV-7 GGUFs ('rwkv6', 'rwkv7')"
        )
    check_tokenizer(reader, path)
    out = GgmlTensors(path, "GGUF")
    head_size = _field(reader, f"{arch}.wkv.head_size")
    rescale = int(_field(reader, f"{arch}.rescale_every_n_layers") or 0) if arch == "rwkv6" else 0
    for t in reader.tensors:
        tid = int(t.tensor_type)
        if tid not in TYPES:
            raise CheckpointError(
                f"{path}: tensor {t.name} is of ggml type {t.tensor_type.name}, which rwkv-engine does not read "
                f"(it reads {', '.join(sorted(BY_NAME))})"
            )
        end = t.data_offset + t.n_bytes
        if end > size:
            raise CheckpointError(
                f"{path}: the GGUF file is truncated (tensor {t.name} ends at byte {end}, the file has {size})"
            )
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml's ne is innermost first
        while len(shape) > 1 and shape[0] == 1:
            shape = shape[1:]

        def raw(off=t.data_offset, n=t.n_bytes) -> torch.Tensor:
            view = out.file_bytes(off, n)
            copy = view.clone()
            release_pages(view)  # read once: the file's pages need not stay in this process
            return copy

        def mapped(off=t.data_offset, n=t.n_bytes) -> torch.Tensor:
            return out.file_bytes(off, n)

        _add(out, t.name, tid, shape, raw, mapped, arch, head_size, rescale, path, t.data_offset)
    if not out.tensors:
        raise CheckpointError(f"{path}: the GGUF file has no tensors")
    return out


def _add(
    out: GgmlTensors,
    name: str,
    tid: int,
    shape,
    raw,
    mapped,
    arch: str,
    head_size,
    rescale: int,
    path: Path,
    offset: int,
) -> None:
    tname = TYPES[tid][0]
    declared = {"F32": torch.float32, "F16": torch.float16}.get(tname, torch.bfloat16)

    def blocks(factor: float = 1.0):
        """A K-quant matrix's blocks [N, K/256 * bytes]: the mapped bytes, or scaled by `factor`."""

        def get():
            b = mapped().view(shape[0], -1)
            return b if factor == 1.0 else scale_blocks(b, tid, factor, f"{path}: {name}")

        return get

    def value(transform=None):
        def get():
            t = dequantize(raw(), tid, shape)
            return transform(t) if transform is not None else t

        return get

    if name in _TOP:
        out.tensors[_TOP[name]] = (shape, declared, value())
        out.types[_TOP[name]] = tname
        if tname == "Q8_0" and len(shape) == 2:
            out.q8[_TOP[name]] = lambda: q8_0_split(raw(), shape)
        if tname in KQUANT and len(shape) == 2:
            out.blocks[_TOP[name]] = blocks()
        if tname in QUANTIZED and len(shape) == 2 and name == "token_embd.weight":
            row_bytes = nbytes(tid, shape[1])

            def rows(r0, r1):
                return dequantize(mapped()[r0 * row_bytes : r1 * row_bytes], tid, (r1 - r0, shape[1]))

            out.rows[_TOP[name]] = RowSource(shape, rows, mapped, offset=offset)
        return
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m:
        raise CheckpointError(f"{path}: unexpected tensor {name!r} in an {arch} GGUF")
    i, part, leaf = int(m.group(1)), m.group(2), m.group(3)
    p = f"blocks.{i}."
    vectors, lora = (_V7_VECTORS, _V7_LORA) if arch == "rwkv7" else (_V6_VECTORS, _V6_LORA)
    if part in _BLOCK:
        target = p + _BLOCK[part] + "." + leaf
        factor = 1.0
        if rescale and part in ("time_mix_output", "channel_mix_value"):
            factor = float(2 ** (i // rescale))
        scaled = (lambda t, f=factor: t * f) if factor != 1.0 else None
        out.tensors[target] = (shape, declared, value(scaled))
        out.types[target] = tname
        if tname == "Q8_0" and len(shape) == 2:

            def q8(f=factor):
                q, s = q8_0_split(raw(), shape)
                return q, (s * f if f != 1.0 else s)

            out.q8[target] = q8
        if tname in KQUANT and len(shape) == 2:
            out.blocks[target] = blocks(factor)
        return
    if part == "time_mix_lerp_fused":
        names = _FUSED[arch]
        C = shape[-1]
        for j, n in enumerate(names):
            out.tensors[p + "att." + n] = ((C,), torch.float32, value(lambda t, j=j, k=len(names): t.reshape(k, -1)[j]))
            out.types[p + "att." + n] = tname
        return
    if part in vectors:
        target = p + vectors[part]
        fix = None
        if part == "time_mix_r_k":
            if not head_size:
                raise CheckpointError(f"{path}: {arch}.wkv.head_size is missing from the GGUF metadata")
            n = int(head_size)
            shape = (math.prod(shape) // n, n)
            fix = lambda t, s=shape: t.reshape(s)  # noqa: E731
        out.tensors[target] = (shape, torch.float32, value(fix))
        out.types[target] = tname
        return
    if part in lora:
        target = p + lora[part]
        if part == "time_mix_w2" and arch == "rwkv6":  # (5, C, D) -> (5, D, C)
            new = (shape[0], shape[2], shape[1])
            fix = lambda t: t.permute(0, 2, 1).contiguous()  # noqa: E731
        else:
            new = shape[::-1]
            fix = lambda t: t.t().contiguous()  # noqa: E731
        out.tensors[target] = (new, declared, value(fix))
        out.types[target] = tname
        return
    raise CheckpointError(f"{path}: unexpected tensor {name!r} in an {arch} GGUF")
