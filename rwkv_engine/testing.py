"""Random-weight RWKV checkpoints in the real file formats, for tests and benchmarks.

Nothing here downloads anything: `random_state_dict` builds a BlinkDL-style flat state dict with
the key names and shapes of the official releases (../shared/FORMATS.md, section A), and the
`save_*` functions write it as a `.pth`, a `.safetensors` or a Hugging Face model directory.

Weights are scaled so that a random model behaves like a trained one numerically: activations
of order one, decays spread between fast (near 0) and slow (near 1), logits with a real spread.
`outliers=True` adds heavy-tailed rows and columns, as trained weights have, which is what makes
quantization hard.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

Tensor = torch.Tensor

SUPPORTED_RANDOM_VERSIONS = ("4", "5.0", "5.1", "5.2")


def _linear(gen: torch.Generator, out_f: int, in_f: int, outliers: bool) -> Tensor:
    w = torch.randn(out_f, in_f, generator=gen) / math.sqrt(in_f)
    if outliers:
        # A few input columns and output rows an order of magnitude larger, plus a heavy
        # (Student-t like) tail on individual entries.
        n_col = max(1, in_f // 64)
        n_row = max(1, out_f // 64)
        cols = torch.randperm(in_f, generator=gen)[:n_col]
        rows = torch.randperm(out_f, generator=gen)[:n_row]
        w[:, cols] *= 8.0
        w[rows, :] *= 4.0
        tail = torch.randn(out_f, in_f, generator=gen) / torch.rand(out_f, in_f, generator=gen).clamp_min(0.05)
        w += 0.02 * tail / math.sqrt(in_f)
    return w


def _ln(gen: torch.Generator, c: int, prefix: str, sd: dict[str, Tensor]) -> None:
    sd[prefix + ".weight"] = 1.0 + 0.1 * torch.randn(c, generator=gen)
    sd[prefix + ".bias"] = 0.1 * torch.randn(c, generator=gen)


def _mix(gen: torch.Generator, c: int) -> Tensor:
    return torch.rand(1, 1, c, generator=gen)


def random_state_dict(
    version: str = "5.2",
    n_layer: int = 2,
    n_embd: int = 64,
    vocab_size: int = 256,
    head_size: int = 16,
    ffn_dim: int | None = None,
    seed: int = 0,
    outliers: bool = False,
) -> dict[str, Tensor]:
    """A BlinkDL-format state dict (fp32) of an RWKV model with random weights.

    version: "4", "5.0", "5.1" or "5.2". ffn_dim defaults to 4*n_embd for RWKV-4 and
    int(3.5*n_embd)//32*32 for RWKV-5 (at least 32).
    """
    if version not in SUPPORTED_RANDOM_VERSIONS:
        raise ValueError(f"random_state_dict: unknown version {version!r}; use one of {SUPPORTED_RANDOM_VERSIONS}")
    gen = torch.Generator().manual_seed(seed)
    C = n_embd
    if ffn_dim is None:
        ffn_dim = 4 * C if version == "4" else max(32, int(3.5 * C) // 32 * 32)
    H = C // head_size
    sd: dict[str, Tensor] = {}
    sd["emb.weight"] = torch.randn(vocab_size, C, generator=gen)
    _ln(gen, C, "blocks.0.ln0", sd)
    for i in range(n_layer):
        p = f"blocks.{i}."
        _ln(gen, C, p + "ln1", sd)
        _ln(gen, C, p + "ln2", sd)
        a = p + "att."
        sd[a + "time_mix_k"] = _mix(gen, C)
        sd[a + "time_mix_v"] = _mix(gen, C)
        sd[a + "time_mix_r"] = _mix(gen, C)
        if version in ("5.1", "5.2"):
            sd[a + "time_mix_g"] = _mix(gen, C)
        if version == "4":
            # w = -exp(time_decay): per-step log-decay from about -0.0025 to -7.
            sd[a + "time_decay"] = torch.empty(C).uniform_(-6.0, 2.0, generator=gen)
            sd[a + "time_first"] = 0.5 * torch.randn(C, generator=gen) + math.log(0.3)
        elif version == "5.2":
            sd[a + "time_decay"] = torch.empty(H, head_size).uniform_(-6.0, 1.5, generator=gen)
            sd[a + "time_faaaa"] = 0.5 * torch.randn(H, head_size, generator=gen)
        else:  # 5.0 / 5.1: one decay and one bonus per head, bonus stored as log (time_first)
            sd[a + "time_decay"] = torch.empty(H).uniform_(-6.0, 1.5, generator=gen)
            sd[a + "time_first"] = 0.5 * torch.randn(H, generator=gen) - 1.0
        for name in ("key", "value", "receptance"):
            sd[a + name + ".weight"] = _linear(gen, C, C, outliers)
        if version in ("5.1", "5.2"):
            sd[a + "gate.weight"] = _linear(gen, C, C, outliers)
        sd[a + "output.weight"] = _linear(gen, C, C, outliers)
        if version != "4":
            _ln(gen, C, a + "ln_x", sd)
        f = p + "ffn."
        sd[f + "time_mix_k"] = _mix(gen, C)
        sd[f + "time_mix_r"] = _mix(gen, C)
        sd[f + "key.weight"] = _linear(gen, ffn_dim, C, outliers)
        sd[f + "receptance.weight"] = _linear(gen, C, C, outliers)
        sd[f + "value.weight"] = _linear(gen, C, ffn_dim, outliers)
    _ln(gen, C, "ln_out", sd)
    sd["head.weight"] = 2.0 * _linear(gen, vocab_size, C, outliers)
    return sd


def cast(sd: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """The state dict with every tensor in `dtype` (official files are bf16)."""
    return {k: v.to(dtype) for k, v in sd.items()}


def save_pth(sd: dict[str, Tensor], path: str | os.PathLike) -> Path:
    path = Path(path)
    torch.save(sd, path)
    return path


def save_safetensors(sd: dict[str, Tensor], path: str | os.PathLike) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


# --- Hugging Face layouts (FORMATS.md B.1 / B.2) -------------------------------------------

_HF_ATT_RENAMES = {
    "time_mix_k": "time_mix_key",
    "time_mix_v": "time_mix_value",
    "time_mix_r": "time_mix_receptance",
    "time_mix_g": "time_mix_gate",
}
_HF_FFN_RENAMES = {"time_mix_k": "time_mix_key", "time_mix_r": "time_mix_receptance"}


def to_hf(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a BlinkDL RWKV-4/5 state dict to the transformers naming (values unchanged)."""
    out = {}
    for k, v in sd.items():
        if k == "emb.weight":
            nk = "rwkv.embeddings.weight"
        elif k.startswith("ln_out."):
            nk = "rwkv." + k
        elif k == "head.weight":
            nk = k
        else:
            _, i, part, rest = k.split(".", 3)
            if part == "ln0":
                nk = f"rwkv.blocks.{i}.pre_ln.{rest}"
            elif part in ("ln1", "ln2"):
                nk = f"rwkv.blocks.{i}.{part}.{rest}"
            elif part == "att":
                nk = f"rwkv.blocks.{i}.attention.{_HF_ATT_RENAMES.get(rest, rest)}"
            elif part == "ffn":
                nk = f"rwkv.blocks.{i}.feed_forward.{_HF_FFN_RENAMES.get(rest, rest)}"
            else:
                raise ValueError(f"to_hf: unexpected key {k}")
        out[nk] = v
    return out


def hf_config(sd: dict[str, Tensor], version: str) -> dict:
    """config.json for `sd` as the transformers RWKV-4 / remote-code RWKV-5 repos write it."""
    V, C = sd["emb.weight"].shape
    L = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    cfg = {
        "attention_hidden_size": sd["blocks.0.att.key.weight"].shape[0],
        "bos_token_id": 0,
        "eos_token_id": 0,
        "context_length": 4096,
        "hidden_size": C,
        "layer_norm_epsilon": 1e-05,
        "num_hidden_layers": L,
        "rescale_every": 6,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": V,
    }
    if version == "4":
        cfg.update(architectures=["RwkvForCausalLM"], model_type="rwkv",
                   intermediate_size=sd["blocks.0.ffn.key.weight"].shape[0])
    else:
        td = sd["blocks.0.att.time_decay"]
        cfg.update(architectures=["Rwkv5ForCausalLM"], model_type="rwkv5", intermediate_size=None,
                   head_size=cfg["attention_hidden_size"] // td.shape[0], head_size_divisor=8)
    return cfg


def save_hf_dir(
    sd: dict[str, Tensor],
    directory: str | os.PathLike,
    version: str,
    weights: str = "safetensors",
    shards: int = 1,
) -> Path:
    """Write `sd` as a Hugging Face model directory.

    weights: "safetensors" (model.safetensors) or "bin" (pytorch_model.bin); shards > 1 splits
    the tensors over several files with the matching `*.index.json`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(sd, version), indent=2))
    hf = {k: v.contiguous() for k, v in to_hf(sd).items()}
    base, ext = ("model", "safetensors") if weights == "safetensors" else ("pytorch_model", "bin")

    def write(part: dict[str, Tensor], name: str) -> None:
        if weights == "safetensors":
            from safetensors.torch import save_file

            save_file(part, str(directory / name), metadata={"format": "pt"})
        else:
            torch.save(part, directory / name)

    if shards <= 1:
        write(hf, f"{base}.{ext}")
        return directory
    keys = list(hf)
    weight_map = {}
    for s in range(shards):
        name = f"{base}-{s + 1:05d}-of-{shards:05d}.{ext}"
        part = {k: hf[k] for k in keys[s::shards]}
        write(part, name)
        weight_map.update({k: name for k in part})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in hf.values())},
             "weight_map": weight_map}
    (directory / f"{base}.{ext}.index.json").write_text(json.dumps(index, indent=2))
    return directory
