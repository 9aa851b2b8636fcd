"""GGUF and rwkv.cpp files written the way their own converters write them, from a BlinkDL state
dict: for tests and benchmarks (the readers are proven against files of the producers' layouts).

GGUF: llama.cpp's convert_hf_to_gguf.py naming and layouts (see gguf.py), written by the
`gguf` package's GGUFWriter, matrices quantized by `gguf.quants` (K-quants, which it cannot
quantize, by our own quantizers, quant/kquantize.py).
rwkv.cpp: python/convert_pytorch_to_ggml.py of RWKV/rwkv.cpp (header, per-tensor dims / name /
type, its time_decay / time_first transforms), and its quantizer's choice of what to quantize
(2-D tensors but emb and head).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..quant.ggml_quants import BY_NAME, QK_K
from ..quant.kquantize import K_TYPES, quantize_k

Tensor = torch.Tensor


# --- quantizing -----------------------------------------------------------------------------


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """Raw blocks (uint8 [rows, bytes per row]) of x [rows, K] (float32) in a ggml type."""
    if type_name in K_TYPES:
        return quantize_k(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), type_name).numpy()
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(x.astype(np.float32), GGMLQuantizationType[type_name])


# --- GGUF -----------------------------------------------------------------------------------


def _version(sd: dict[str, Tensor]) -> str:
    if "blocks.0.att.r_k" in sd:
        return "7"
    if "blocks.0.att.time_maa_x" in sd:
        return "6"
    raise ValueError("GGUF files hold RWKV-6 or RWKV-7 models")


def write_gguf(
    sd: dict[str, Tensor],
    path: str | os.PathLike,
    type_name: str | Callable[[str], str] = "F16",
    *,
    rescale_every: int = 0,
    tokens: list[str] | None = None,
    arch: str | None = None,
) -> Path:
    """A GGUF of the RWKV-6/7 state dict `sd` as llama.cpp's converter names and lays it out; the
    matrices in `type_name` (F32, F16, BF16, Q8_0, Q4_0, ...; or a function of the GGUF tensor
    name giving each its own, as llama.cpp's Q4_K_M mixes do; a matrix whose width the type's
    block does not divide stays F16, as llama.cpp falls back), vectors in F32.
    rescale_every: RWKV-6, the converter's fp16 guard (weights divided, metadata set).
    tokens: the vocabulary to store (default: the World one, cut to the model's rows)."""
    import gguf

    from ..loading.gguf import world_token_texts

    version = _version(sd)
    arch = arch or ("rwkv7" if version == "7" else "rwkv6")
    L = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    V, C = sd["emb.weight"].shape
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(1048576)
    w.add_embedding_length(C)
    w.add_block_count(L)
    w.add_layer_norm_eps(1e-5)
    w.add_feed_forward_length(sd["blocks.0.ffn.key.weight"].shape[0])
    w.add_head_count(0)
    if version == "7":
        H, N = sd["blocks.0.att.r_k"].shape
        w.add_wkv_head_size(N)
    else:
        H, N = sd["blocks.0.att.time_faaaa"].shape
        w.add_wkv_head_size(N)
        w.add_rescale_every_n_layers(rescale_every)
    w.add_tokenizer_model("rwkv")
    if tokens is None:
        tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(world_token_texts()[:V])]
    w.add_token_list(tokens)

    def put(name: str, t: Tensor, matrix: bool = False) -> None:
        x = t.detach().float().contiguous().numpy()
        tn = (type_name(name) if callable(type_name) else type_name) if matrix else "F32"
        block = {"F32": 1, "F16": 1, "BF16": 1}.get(tn, QK_K if tn.endswith("_K") else 32)
        if x.shape[-1] % block:
            tn = "F16"
        if tn == "F32":
            w.add_tensor(name, x)
        elif tn == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            q = quantize(x.reshape(-1, x.shape[-1]), tn) if tn != "BF16" else _bf16(x)
            w.add_tensor(name, q.reshape(*x.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[tn])

    put("token_embd.weight", sd["emb.weight"], True)
    put("token_embd_norm.weight", sd["blocks.0.ln0.weight"])
    put("token_embd_norm.bias", sd["blocks.0.ln0.bias"])
    for i in range(L):
        p, b = f"blocks.{i}.", f"blk.{i}."
        for ours, theirs in (("ln1", "attn_norm"), ("ln2", "attn_norm_2"), ("att.ln_x", "time_mix_ln")):
            put(b + theirs + ".weight", sd[p + ours + ".weight"])
            put(b + theirs + ".bias", sd[p + ours + ".bias"])
        scale = 2 ** (i // rescale_every) if rescale_every else 1
        for m in ("key", "value", "receptance", "output", "gate"):
            if p + "att." + m + ".weight" in sd:
                t = sd[p + "att." + m + ".weight"]
                put(b + "time_mix_" + m + ".weight", t / scale if m == "output" else t, True)
        for m in ("key", "value", "receptance"):
            if p + "ffn." + m + ".weight" in sd:
                t = sd[p + "ffn." + m + ".weight"]
                put(b + "channel_mix_" + m + ".weight", t / scale if m == "value" else t, True)
        if version == "7":
            put(
                b + "time_mix_lerp_fused.weight", torch.stack([sd[p + "att.x_" + c].reshape(1, 1, C) for c in "rwkvag"])
            )
            for x in "wavg":
                for j in "012" if x != "g" else "12":
                    src = p + f"att.{x}{j}"
                    if i == 0 and x == "v":  # the converter's dummy: copies of a0/a1/a2
                        src = p + f"att.a{j}"
                    t = sd[src]
                    put(b + f"time_mix_{x}{j}.weight", t.reshape(-1) if j == "0" else t.t(), j != "0")
            put(b + "time_mix_k_k.weight", sd[p + "att.k_k"].reshape(-1))
            put(b + "time_mix_k_a.weight", sd[p + "att.k_a"].reshape(-1))
            put(b + "time_mix_r_k.weight", sd[p + "att.r_k"].reshape(-1))
            put(b + "channel_mix_lerp_k.weight", sd[p + "ffn.x_k"].reshape(-1))
        else:
            put(b + "time_mix_lerp_x.weight", sd[p + "att.time_maa_x"].reshape(-1))
            put(
                b + "time_mix_lerp_fused.weight",
                torch.stack([sd[p + "att.time_maa_" + c].reshape(1, 1, C) for c in "wkvrg"]),
            )
            put(b + "time_mix_w1.weight", sd[p + "att.time_maa_w1"].t(), True)
            put(b + "time_mix_w2.weight", sd[p + "att.time_maa_w2"].permute(0, 2, 1), True)
            put(b + "time_mix_decay.weight", sd[p + "att.time_decay"].reshape(-1))
            put(b + "time_mix_decay_w1.weight", sd[p + "att.time_decay_w1"].t(), True)
            put(b + "time_mix_decay_w2.weight", sd[p + "att.time_decay_w2"].t(), True)
            put(b + "time_mix_first.weight", sd[p + "att.time_faaaa"].reshape(H, N))
            put(b + "channel_mix_lerp_k.weight", sd[p + "ffn.time_maa_k"].reshape(-1))
            put(b + "channel_mix_lerp_r.weight", sd[p + "ffn.time_maa_r"].reshape(-1))
    put("output_norm.weight", sd["ln_out.weight"])
    put("output_norm.bias", sd["ln_out.bias"])
    put("output.weight", sd["head.weight"], True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.uint8).numpy()


# --- rwkv.cpp -------------------------------------------------------------------------------

RWKVCPP_TYPES = {"FP32": 0, "FP16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 7, "Q5_1": 8, "Q8_0": 9}
_KEEP_FP32 = (".time_", ".k_k", ".k_a", ".r_k", ".x_rwkvag", ".x_k", ".w0", ".a0", ".v0")


def rwkvcpp_tensors(sd: dict[str, Tensor]) -> tuple[str, dict[str, Tensor]]:
    """(version, the fp32 tensors rwkv.cpp's converter writes), its transforms applied."""
    v7 = "blocks.0.att.k_k" in sd
    v6 = "blocks.0.att.time_maa_x" in sd
    v5 = "blocks.0.att.ln_x.weight" in sd
    v52 = "blocks.0.att.gate.weight" in sd
    if v7:  # the six mixes concatenated in the file's key order (r, w, k, v, a, g)
        new: dict[str, Tensor] = {}
        for k, t in sd.items():
            if ".att.x_" in k:
                key = k.rsplit(".", 1)[0] + ".x_rwkvag"
                new[key] = torch.cat([new[key], t]) if key in new else t
            else:
                new[k] = t
        sd = new
    out = {}
    n_head = sd["blocks.0.att.time_faaaa"].shape[0] if v6 else 0
    for k, t in sd.items():
        t = t.float()
        if ".time_" in k:
            t = t.squeeze()
        if v7:
            if any(s in k for s in (".w1", ".w2", ".a1", ".a2", ".v1", ".v2", ".g1", ".g2")):
                t = t.transpose(0, 1)
        elif v6:
            if ".time_faaaa" in k:
                t = t.unsqueeze(-1)
            if ".time_maa_w1" in k or ".time_decay_w" in k:
                t = t.transpose(0, 1)
            if ".time_maa_w2" in k:
                t = t.transpose(1, 2)
            if ".time_decay" in k and "_w" not in k:
                t = t.reshape(n_head, -1, 1)
        elif v5:
            if ".time_decay" in k:
                t = torch.exp(-torch.exp(t))
                t = t.unsqueeze(-1) if v52 else t.reshape(-1, 1, 1)
            if ".time_first" in k:
                t = torch.exp(t).reshape(-1, 1, 1)
            if ".time_faaaa" in k:
                t = t.unsqueeze(-1)
        elif ".time_decay" in k:
            t = -torch.exp(t)
        out[k] = t.contiguous()
    return ("7" if v7 else "6" if v6 else "5" if v5 else "4"), out


def write_rwkvcpp(sd: dict[str, Tensor], path: str | os.PathLike, data_type: str = "FP16", version: int = 101) -> Path:
    """An rwkv.cpp model file of `sd`: FP32 / FP16 as its converter writes it, quantized types as
    its quantizer then makes them (every 2-D tensor but emb.weight and head.weight)."""
    _, tensors = rwkvcpp_tensors(sd)
    V, C = sd["emb.weight"].shape
    L = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    fp16 = data_type != "FP32"
    with open(path, "wb") as f:
        f.write(struct.pack("=iiiiii", 0x67676D66, version, V, C, L, RWKVCPP_TYPES[data_type]))
        for k, t in tensors.items():
            dtype = "FP32"
            if fp16 and t.dim() > 1 and all(s not in k for s in _KEEP_FP32):
                dtype = "FP16"
            x = t.numpy()
            quantizable = t.dim() == 2 and t.shape[-1] % 32 == 0  # (rwkv.cpp's quantizer fails on others)
            if data_type not in ("FP32", "FP16") and quantizable and k not in ("emb.weight", "head.weight"):
                dtype = data_type
                data = quantize(x, data_type).tobytes()
            elif dtype == "FP16":
                data = x.astype(np.float16).tobytes()
            else:
                data = x.astype(np.float32).tobytes()
            name = k.encode()
            f.write(struct.pack("=iii", t.dim(), len(name), RWKVCPP_TYPES[dtype]))
            for dim in reversed(t.shape):
                f.write(struct.pack("=i", dim))
            f.write(name)
            f.write(data)
    return Path(path)


__all__ = ["BY_NAME", "quantize", "write_gguf", "write_rwkvcpp", "rwkvcpp_tensors"]
