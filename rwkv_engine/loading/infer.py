"""The model's config (version and sizes) from a checkpoint's tensor names and shapes, checked
against its config.json when there is one."""

from __future__ import annotations

import re

from ..config import TASKS, ModelConfig
from ..errors import CheckpointError, UnsupportedModelError
from .formats import Checkpoint


def _version(ck: Checkpoint) -> str:
    keys = ck.keys()
    if keys and all(k.endswith(".att.time_state") for k in keys):
        raise CheckpointError(
            f"{ck.where}: a state-only file (time_state tensors, no weights): load the model it was tuned "
            "on and give this file as its state (--state FILE, rwkv_engine.load_state(model, path))"
        )
    if "emb.weight" not in ck and any(k.startswith("reranker.") for k in keys):
        raise CheckpointError(
            f"{ck.where}: an EmbeddingRWKV reranker (reranker.* tensors): it scores the states of its "
            "embedding model, so it cannot run alone; load the embedding model and give this file as its "
            "reranker (rwkv_engine.load_reranker(model, path))"
        )
    if "emb.weight" not in ck or not any(k.startswith("blocks.") for k in keys):
        raise CheckpointError(f"{ck.where}: not an RWKV checkpoint (no emb.weight / blocks.* tensors)")
    if any(".att.time_misc_" in k for k in keys):
        raise UnsupportedModelError(
            f"{ck.where}: an RWKV-7 preview checkpoint (time_misc_* names); rwkv-engine runs the released x070 format"
        )
    if any(k.endswith((".att.r_k", ".att.x_r", ".att.w0")) for k in keys):
        if any(re.search(r"\.qkv\.(k_emb|v_emb|qq)\b", k) for k in keys):
            raise UnsupportedModelError(
                f"{ck.where}: an RWKV-7b checkpoint (DeepEmbedAttention, DEA: blocks.N.qkv.*, with a per-token "
                "KV cache); rwkv-engine runs RWKV-7 and RWKV-7a (DeepEmbed), not 7b"
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


_TASK_HEAD = re.compile(r"head\.(\w+)_head\.fc1\.weight")


def _heads(ck: Checkpoint) -> dict:
    """The ModelConfig fields of the heads the checkpoint has (docs/models.md, Embeddings)."""
    tasks = sorted(m.group(1) for k in ck.keys() if (m := _TASK_HEAD.fullmatch(k)))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise CheckpointError(
            f"{ck.where}: unknown task head head.{unknown[0]}_head (EmbeddingRWKV's are {', '.join(TASKS)})"
        )
    heads = dict(lm_head="head.weight" in ck, score_head="head.0.weight" in ck)
    if tasks:
        heads.update(task_heads=tuple(tasks), task_dim=_size(ck, f"head.{tasks[0]}_head.fc1.weight", 0))
    if not (heads["lm_head"] or tasks or heads["score_head"]):
        partial = sorted(k for k in ck.keys() if k.startswith("head."))
        raise CheckpointError(
            f"{ck.where}: no head: neither a language-model head (head.weight) nor an EmbeddingRWKV task head "
            f"(head.retr_head.fc1.weight, ...{'; found only ' + ', '.join(partial[:3]) if partial else ''}); "
            "an EmbeddingRWKV file needs its task heads"
        )
    return heads


def infer_config(ck: Checkpoint) -> ModelConfig:
    hf = ck.hf_config
    if hf is not None:
        mt = hf.get("model_type")
        if not isinstance(mt, str) or mt not in _HF_MODEL_TYPES:
            raise CheckpointError(f"{ck.where}: config.json says model_type {mt!r}, not an RWKV model")
    version = _version(ck)
    family = int(float(version))
    if hf is not None and _HF_MODEL_TYPES[mt] != family:
        raise CheckpointError(f"{ck.where}: config.json says model_type {mt!r} but the weights are RWKV-{version}")
    blocks = {int(m.group(1)) for k in ck.keys() if (m := re.match(r"blocks\.(\d+)\.", k))}
    n_layer = max(blocks) + 1
    if len(blocks) < n_layer:  # (the first few gaps only: "blocks.4000000" must not list 4 million)
        missing = [b for b in range(min(n_layer, len(blocks) + 5)) if b not in blocks][:5]
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
            deep_embed="blocks.0.ffn.s_emb.weight" in ck,  # RWKV-7a
            lora_decay=_size(ck, "blocks.0.att.w1", 1),
            lora_iclr=_size(ck, "blocks.0.att.a1", 1),
            lora_gate=_size(ck, "blocks.0.att.g1", 1),
            lora_value=_size(ck, "blocks.1.att.v1", 1) if n_layer > 1 else 0,
        )
    head_size = A // n_head if n_head else 0
    heads = _heads(ck)
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
        **heads,
    )
    if hf is not None:
        checks = [("num_hidden_layers", n_layer), ("hidden_size", C), ("vocab_size", V)]
        if family == 6:
            checks += [("head_size", head_size), ("attention_hidden_size", A)]
        if family == 7:  # flash-linear-attention's config (docs/formats.md B.4)
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
