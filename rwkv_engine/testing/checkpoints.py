"""Random-weight RWKV checkpoints in the real file formats, for tests and benchmarks.

Nothing here downloads anything: `random_state_dict` builds a BlinkDL-style flat state dict with
the key names and shapes of the official releases (docs/formats.md A), and the
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

SUPPORTED_RANDOM_VERSIONS = ("4", "5.0", "5.1", "5.2", "6.0", "7")


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
    lora: dict[str, int] | None = None,
    time_state: bool = False,
    deep_embed: bool = False,
) -> dict[str, Tensor]:
    """A BlinkDL-format state dict (fp32) of an RWKV model with random weights.

    version: "4", "5.0", "5.1", "5.2", "6.0" or "7". ffn_dim defaults to 4*n_embd for RWKV-4 and
    RWKV-7 and int(3.5*n_embd)//32*32 for RWKV-5/6 (at least 32).
    lora: LoRA ranks overriding the defaults of `lora_ranks` (RWKV-6/7).
    time_state: add a state-tuned initial state per block (RWKV-6/7): blocks.{i}.att.time_state
    [H, N, N], stored [value][key] like the files state tuning writes.
    deep_embed: RWKV-7a (DeepEmbed): per block ffn.s_emb.weight [V, 1024], ffn.s_emb_x.weight
    [1024, C], ffn.s0 [1, 1, F], ffn.s1 [C, 32], ffn.s2 [32, F], the shapes of BlinkDL's rwkv7a files.
    """
    if version not in SUPPORTED_RANDOM_VERSIONS:
        raise ValueError(f"random_state_dict: unknown version {version!r}; use one of {SUPPORTED_RANDOM_VERSIONS}")
    if deep_embed and version != "7":
        raise ValueError(f"random_state_dict: DeepEmbed is an RWKV-7 feature, not {version!r}")
    if time_state and version not in ("6.0", "7"):
        raise ValueError(f"random_state_dict: time_state exists for RWKV-6 and RWKV-7 only, not {version!r}")
    gen = torch.Generator().manual_seed(seed)
    C = n_embd
    if ffn_dim is None:
        ffn_dim = 4 * C if version in ("4", "7") else max(32, int(3.5 * C) // 32 * 32)
    H = C // head_size
    sd: dict[str, Tensor] = {}
    sd["emb.weight"] = torch.randn(vocab_size, C, generator=gen)
    _ln(gen, C, "blocks.0.ln0", sd)
    if version in ("6.0", "7"):
        ranks = {**lora_ranks(version, C), **(lora or {})}
        block = _random_block_v6 if version == "6.0" else _random_block_v7
        for i in range(n_layer):
            block(gen, sd, f"blocks.{i}.", C, H, head_size, ffn_dim, ranks, outliers)
            if deep_embed:
                f = f"blocks.{i}.ffn."
                sd[f + "s_emb.weight"] = 0.1 * torch.randn(vocab_size, 1024, generator=gen)
                sd[f + "s_emb_x.weight"] = 0.02 * torch.randn(1024, C, generator=gen)
                sd[f + "s0"] = 1.0 + 0.2 * torch.randn(1, 1, ffn_dim, generator=gen)
                sd[f + "s1"] = 0.3 * torch.randn(C, 32, generator=gen)
                sd[f + "s2"] = 0.3 * torch.randn(32, ffn_dim, generator=gen)
            if time_state:
                sd[f"blocks.{i}.att.time_state"] = 0.5 * torch.randn(H, head_size, head_size, generator=gen)
        _ln(gen, C, "ln_out", sd)
        sd["head.weight"] = 2.0 * _linear(gen, vocab_size, C, outliers)
        return sd
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


def lora_ranks(version: str, n_embd: int) -> dict[str, int]:
    """The LoRA ranks the official releases use for width n_embd (docs/formats.md A.4, A.5).

    RWKV-6: 32 for the mix and 64 for the decay (64 / 128 at C = 4096). RWKV-7: about 2.5 sqrt(C)
    (decay, learning rate), 1.7 sqrt(C) (value) and 5 sqrt(C) (gate), multiples of 32, at least 32.
    """
    C = n_embd
    if version == "6.0":
        return {"mix": 64 if C >= 4096 else 32, "decay": 128 if C >= 4096 else 64}

    def rank(scale: float) -> int:
        return max(32, int(round(scale * math.sqrt(C) / 32)) * 32)

    return {"decay": rank(2.5), "iclr": rank(2.5), "value": rank(1.7), "gate": rank(5.0)}


def _lora_pair(gen: torch.Generator, C: int, D: int, out: int, scale: float) -> tuple[Tensor, Tensor]:
    """x @ w1 of order one (through tanh/sigmoid) and w1 -> w2 of order `scale`."""
    return torch.randn(C, D, generator=gen) / math.sqrt(C), scale * torch.randn(D, out, generator=gen) / math.sqrt(D)


def _random_block_v6(gen, sd, p, C, H, N, F, ranks, outliers) -> None:
    _ln(gen, C, p + "ln1", sd)
    _ln(gen, C, p + "ln2", sd)
    a = p + "att."
    for m in ("x", "w", "k", "v", "r", "g"):
        sd[a + "time_maa_" + m] = _mix(gen, C)
    D = ranks["mix"]
    sd[a + "time_maa_w1"] = torch.randn(C, 5 * D, generator=gen) / math.sqrt(C)
    sd[a + "time_maa_w2"] = 0.2 * torch.randn(5, D, C, generator=gen) / math.sqrt(D)
    # log w = -exp(time_decay + lora): base decays from 0.9975 to 0.01, the LoRA moves them by ~e^0.5.
    sd[a + "time_decay"] = torch.empty(1, 1, C).uniform_(-6.0, 1.5, generator=gen)
    sd[a + "time_decay_w1"], sd[a + "time_decay_w2"] = _lora_pair(gen, C, ranks["decay"], C, 0.5)
    sd[a + "time_faaaa"] = 0.5 * torch.randn(H, N, generator=gen)
    for name in ("receptance", "key", "value", "gate", "output"):
        sd[a + name + ".weight"] = _linear(gen, C, C, outliers)
    _ln(gen, C, a + "ln_x", sd)
    f = p + "ffn."
    sd[f + "time_maa_k"] = _mix(gen, C)
    sd[f + "time_maa_r"] = _mix(gen, C)
    sd[f + "key.weight"] = _linear(gen, F, C, outliers)
    sd[f + "receptance.weight"] = _linear(gen, C, C, outliers)
    sd[f + "value.weight"] = _linear(gen, C, F, outliers)


def _random_block_v7(gen, sd, p, C, H, N, F, ranks, outliers) -> None:
    _ln(gen, C, p + "ln1", sd)
    _ln(gen, C, p + "ln2", sd)
    a = p + "att."
    for m in ("r", "w", "k", "v", "a", "g"):
        sd[a + "x_" + m] = _mix(gen, C)
    # w = exp(-e^-0.5 sigmoid(w0 + lora)): from 0.998 (w0 = -6) to 0.59 (w0 = 3), RWKV-7's whole range.
    sd[a + "w0"] = torch.empty(1, 1, C).uniform_(-6.0, 3.0, generator=gen)
    sd[a + "w1"], sd[a + "w2"] = _lora_pair(gen, C, ranks["decay"], C, 1.0)
    sd[a + "a0"] = torch.randn(1, 1, C, generator=gen)  # in-context learning rate sigmoid(a0 + ...)
    sd[a + "a1"], sd[a + "a2"] = _lora_pair(gen, C, ranks["iclr"], C, 1.0)
    sd[a + "v0"] = 0.73 + 0.5 * torch.randn(1, 1, C, generator=gen)  # value residual sigmoid(v0 + ...)
    sd[a + "v1"], sd[a + "v2"] = _lora_pair(gen, C, ranks["value"], C, 1.0)
    sd[a + "g1"], sd[a + "g2"] = _lora_pair(gen, C, ranks["gate"], C, 1.0)
    sd[a + "k_k"] = 0.85 + 0.1 * torch.randn(1, 1, C, generator=gen)
    sd[a + "k_a"] = 1.0 + 0.1 * torch.randn(1, 1, C, generator=gen)
    sd[a + "r_k"] = 0.3 * torch.randn(H, N, generator=gen)
    for name in ("receptance", "key", "value", "output"):
        sd[a + name + ".weight"] = _linear(gen, C, C, outliers)
    _ln(gen, C, a + "ln_x", sd)
    f = p + "ffn."
    sd[f + "x_k"] = _mix(gen, C)
    sd[f + "key.weight"] = _linear(gen, F, C, outliers)
    sd[f + "value.weight"] = _linear(gen, C, F, outliers)


def random_embedder_state_dict(
    n_layer: int = 2,
    n_embd: int = 128,
    head_size: int = 64,
    vocab_size: int = 65536,
    seed: int = 0,
    tasks: tuple[str, ...] = ("cls", "retr", "sts"),
) -> dict[str, Tensor]:
    """An EmbeddingRWKV checkpoint in the layout of `rwkv_emb` (docs/models.md): an RWKV-7 backbone
    under `rwkv.` (BlinkDL names, no head.weight) and task heads head.{task}_head.{fc1,fc2,norm}.
    The end token 65535 is an id of the vocabulary, so vocab_size defaults to the World vocab's."""
    base = random_state_dict("7", n_layer, n_embd, vocab_size, head_size, seed=seed)
    del base["head.weight"]
    sd = {"rwkv." + k: v for k, v in base.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    C = n_embd
    for task in tasks:
        p = f"head.{task}_head."
        sd[p + "fc1.weight"] = torch.randn(C, C, generator=gen) / math.sqrt(C)
        sd[p + "fc2.weight"] = 0.5 * torch.randn(C, C, generator=gen) / math.sqrt(C)
        _ln(gen, C, p + "norm", sd)
    return sd


def reranker_lora_ranks(n_embd: int) -> dict[str, int]:
    """The LoRA ranks of an EmbeddingRWKV reranker of width n_embd: its module derives them from
    the width (1.8 sqrt(C) for decay and learning rate, 1.3 sqrt(C) for the value, 0.6 C^0.8 for
    the gate, or 128 at C = 1024; multiples of 32, at least 32) rather than reading the file."""
    C = n_embd

    def rank(x: float) -> int:
        return max(32, int(round(x / 32)) * 32)

    gate = 128 if C == 1024 else rank(0.6 * C**0.8)
    return {
        "decay": rank(1.8 * math.sqrt(C)),
        "iclr": rank(1.8 * math.sqrt(C)),
        "value": rank(1.3 * math.sqrt(C)),
        "gate": gate,
    }


def random_reranker_state_dict(
    n_layer: int = 2, n_embd: int = 128, head_size: int = 64, seed: int = 0, layers: list[int] | None = None
) -> dict[str, Tensor]:
    """An EmbeddingRWKV reranker checkpoint in the layout of `rwkv_emb`: RWKV-7 blocks under
    `reranker.` (block 0 without the value-residual LoRA, which its module lacks), a one-row
    embedding, ln_out and the score head reranker.head.{0,2}; `layers`: its reranker_layer_idx."""
    base = random_state_dict("7", n_layer, n_embd, 1, head_size, seed=seed, lora=reranker_lora_ranks(n_embd))
    for k in ("head.weight", "blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"):
        del base[k]
    sd: dict = {"reranker." + k: v for k, v in base.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    C = n_embd
    sd["reranker.head.0.weight"] = torch.randn(C, C, generator=gen) / math.sqrt(C)
    sd["reranker.head.0.bias"] = 0.1 * torch.randn(C, generator=gen)
    sd["reranker.head.2.weight"] = torch.randn(1, C, generator=gen) / math.sqrt(C)
    if layers is not None:
        sd["reranker_layer_idx"] = list(layers)
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


# --- Hugging Face layouts (docs/formats.md B.1 - B.4) -------------------------------------------


def to_hf(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a BlinkDL RWKV-4/5/6 state dict to the transformers naming (values unchanged; RWKV-6
    keeps its time_maa_* names)."""
    from ..loading.names import hf_name

    return {hf_name(k): v for k, v in sd.items()}


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
        cfg.update(
            architectures=["RwkvForCausalLM"],
            model_type="rwkv",
            intermediate_size=sd["blocks.0.ffn.key.weight"].shape[0],
        )
    elif version == "6.0":
        H = sd["blocks.0.att.time_faaaa"].shape[0]
        cfg.update(
            architectures=["Rwkv6ForCausalLM"],
            model_type="rwkv6",
            intermediate_size=None,
            head_size=cfg["attention_hidden_size"] // H,
            head_size_divisor=8,
        )
    else:
        td = sd["blocks.0.att.time_decay"]
        cfg.update(
            architectures=["Rwkv5ForCausalLM"],
            model_type="rwkv5",
            intermediate_size=None,
            head_size=cfg["attention_hidden_size"] // td.shape[0],
            head_size_divisor=8,
        )
    return cfg


def to_fla(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """A BlinkDL RWKV-7 state dict in flash-linear-attention's RWKV7ForCausalLM naming (docs/formats.md B.4).

    LoRA matrices become nn.Linear weights (transposed), w0/a0/v0 their biases; layer 0 has no
    v_lora; k_k, k_a and ffn.x_k are (C,).
    """
    from ..loading.names import FLA_LORA, fla_name

    out = {}
    for k, v in sd.items():
        if k.startswith("blocks."):
            _, i, part, rest = k.split(".", 3)
            if part == "att" and rest[0] in "wavg" and rest[1:] in FLA_LORA:
                if i == "0" and rest[0] == "v":
                    continue  # unused in layer 0; fla has no v_lora there
                v = v.reshape(-1) if rest[1] == "0" else v.t()
            elif (part == "att" and rest in ("k_k", "k_a")) or (part != "att" and rest == "x_k"):
                v = v.reshape(-1)
        out[fla_name(k)] = v
    return out


def fla_config(sd: dict[str, Tensor]) -> dict:
    """config.json of an fla-hub RWKV-7 model for `sd` (docs/formats.md B.4)."""
    V, C = sd["emb.weight"].shape
    L = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    H, N = sd["blocks.0.att.r_k"].shape
    F = sd["blocks.0.ffn.key.weight"].shape[0]
    return {
        "architectures": ["RWKV7ForCausalLM"],
        "model_type": "rwkv7",
        "hidden_size": C,
        "num_hidden_layers": L,
        "head_dim": N,
        "num_heads": H,
        "hidden_ratio": F / C,
        "intermediate_size": F,
        "decay_low_rank_dim": sd["blocks.0.att.w1"].shape[1],
        "a_low_rank_dim": sd["blocks.0.att.a1"].shape[1],
        "v_low_rank_dim": sd[f"blocks.{min(1, L - 1)}.att.v1"].shape[1],
        "gate_low_rank_dim": sd["blocks.0.att.g1"].shape[1],
        "hidden_act": "sqrelu",
        "norm_first": True,
        "norm_bias": True,
        "norm_eps": 1e-5,
        "value_dim": [C] * L,
        "attn_mode": "chunk",
        "fuse_norm": False,
        "fuse_cross_entropy": True,
        "use_l2warp": True,
        "vocab_size": V,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
    }


def save_hf_dir(
    sd: dict[str, Tensor],
    directory: str | os.PathLike,
    version: str,
    weights: str = "safetensors",
    shards: int = 1,
) -> Path:
    """Write `sd` as a Hugging Face model directory: transformers / remote-code naming for RWKV-4/5/6,
    flash-linear-attention naming for RWKV-7.

    weights: "safetensors" (model.safetensors) or "bin" (pytorch_model.bin); shards > 1 splits
    the tensors over several files with the matching `*.index.json`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config, renamed = (fla_config(sd), to_fla(sd)) if version == "7" else (hf_config(sd, version), to_hf(sd))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    hf = {k: v.contiguous() for k, v in renamed.items()}
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
    index = {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in hf.values())},
        "weight_map": weight_map,
    }
    (directory / f"{base}.{ext}.index.json").write_text(json.dumps(index, indent=2))
    return directory
