"""Tensor names: BlinkDL's (the canonical ones) and the Hugging Face transformers RWKV-4/5/6 and
flash-linear-attention RWKV-7 names (docs/formats.md B.1-B.4), both ways: `canonical_name` reads a
checkpoint, `hf_name` / `fla_name` write one (rwkv_engine.testing)."""

from __future__ import annotations

import re

# transformers RWKV-4/5/6: rwkv.blocks.{i}.{part}.{rest}
HF_PARTS = {"ln0": "pre_ln", "att": "attention", "ffn": "feed_forward"}  # ln1, ln2 keep their names
HF_MIXES = {
    "time_mix_k": "time_mix_key",
    "time_mix_v": "time_mix_value",
    "time_mix_r": "time_mix_receptance",
    "time_mix_g": "time_mix_gate",
}

# flash-linear-attention RWKV-7 (fla-hub/rwkv7-*, docs/formats.md B.4): model.layers.{i}.{part}.{rest}
FLA_TOP = {
    "emb.weight": "model.embeddings.weight",
    "ln_out.weight": "model.norm.weight",
    "ln_out.bias": "model.norm.bias",
    "head.weight": "lm_head.weight",
}
FLA_PARTS = {"att": "attn", "ffn": "ffn", "ln0": "pre_norm", "ln1": "attn_norm", "ln2": "ffn_norm"}
FLA_PROJ = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj", "ln_x": "g_norm"}
# LoRA(x) = lora.2(act(lora.0(x))): lora.0.weight = w1^T, lora.2.weight = w2^T, lora.2.bias = w0.
FLA_LORA = {"1": "lora.0.weight", "2": "lora.2.weight", "0": "lora.2.bias"}

_inverse = {
    "hf_parts": {v: k for k, v in HF_PARTS.items()},
    "hf_mixes": {v: k for k, v in HF_MIXES.items()},
    "fla_top": {v: k for k, v in FLA_TOP.items()},
    "fla_parts": {v: k for k, v in FLA_PARTS.items()},
    "fla_proj": {v: k for k, v in FLA_PROJ.items()},
    "fla_lora": {v: k for k, v in FLA_LORA.items()},
}
_FLA_LORA_NAME = re.compile(r"([wavg])_lora\.(lora\.0\.weight|lora\.2\.weight|lora\.2\.bias)")


def _from_fla(name: str) -> str:
    if name in _inverse["fla_top"]:
        return _inverse["fla_top"][name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(\w+)\.(.+)", name)
    if not m:
        return name
    i, part, rest = m.groups()
    part = _inverse["fla_parts"].get(part, part)
    if part == "att":
        lora = _FLA_LORA_NAME.fullmatch(rest)
        if lora:
            rest = lora.group(1) + _inverse["fla_lora"][lora.group(2)]
        else:
            head, dot, tail = rest.partition(".")
            rest = _inverse["fla_proj"].get(head, head) + dot + tail
    return f"blocks.{i}.{part}.{rest}"


def stored_transposed(name: str) -> bool:
    """Whether a tensor is stored as the transpose of its BlinkDL counterpart (fla's LoRA weights)."""
    return name.startswith("model.layers.") and re.search(r"_lora\.lora\.[02]\.weight$", name) is not None


def canonical_name(name: str) -> str:
    """BlinkDL's name for a transformers RWKV-4/5/6, fla RWKV-7 (or BlinkDL) tensor name."""
    if name.startswith("model.") or name == "lm_head.weight":
        return _from_fla(name)
    if name.startswith("rwkv."):
        name = name[5:]
        if name.startswith("embeddings."):
            return "emb." + name[len("embeddings.") :]
        m = re.fullmatch(r"blocks\.(\d+)\.(\w+)\.(.+)", name)
        if m:
            i, part, rest = m.groups()
            part = _inverse["hf_parts"].get(part, part)
            rest = _inverse["hf_mixes"].get(rest, rest)
            return f"blocks.{i}.{part}.{rest}"
    return name


def hf_name(name: str) -> str:
    """The transformers name of a BlinkDL RWKV-4/5/6 tensor name (RWKV-6 keeps its time_maa_* names)."""
    if name == "emb.weight":
        return "rwkv.embeddings.weight"
    if name.startswith("ln_out."):
        return "rwkv." + name
    if name == "head.weight":
        return name
    _, i, part, rest = name.split(".", 3)
    if part not in ("ln0", "ln1", "ln2", "att", "ffn"):
        raise ValueError(f"hf_name: unexpected key {name}")
    if part in ("att", "ffn"):
        rest = HF_MIXES.get(rest, rest)
    return f"rwkv.blocks.{i}.{HF_PARTS.get(part, part)}.{rest}"


def fla_name(name: str) -> str:
    """The flash-linear-attention name of a BlinkDL RWKV-7 tensor name; LoRA matrices become
    nn.Linear weights (`stored_transposed`), w0/a0/v0 their biases."""
    if name in FLA_TOP:
        return FLA_TOP[name]
    _, i, part, rest = name.split(".", 3)
    if part == "att" and rest[0] in "wavg" and rest[1:] in FLA_LORA:
        rest = f"{rest[0]}_lora.{FLA_LORA[rest[1:]]}"
    elif part == "att":
        head, dot, tail = rest.partition(".")
        rest = FLA_PROJ.get(head, head) + dot + tail
    return f"model.layers.{i}.{FLA_PARTS[part]}.{rest}"
