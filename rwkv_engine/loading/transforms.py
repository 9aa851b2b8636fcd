"""From a checkpoint's tensors (BlinkDL names) to the ones our modules hold: ln0 folded into the
embedding, decays to log space (RWKV-6 keeps its raw base decay, the per-token part is
data-dependent), mixes squeezed and put in one convention (RWKV-6/7's x + (prev - x) m is stored
as 1 - m), the fp16 rescale, the dtype cast; a state-tuned file's time_state becomes the initial state."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import CheckpointError
from .formats import Checkpoint

Tensor = torch.Tensor

# RWKV-6/7 token-shift mixes, x + (prev - x) * m: stored as 1 - m, the shared `mix` convention
_REVERSED_MIX = re.compile(r"\.(att\.time_maa_[xwkvrg]|ffn\.time_maa_[kr]|att\.x_[rwkvag]|ffn\.x_k)$")


# Tensors of an EmbeddingRWKV file that the model itself does not hold: its reranker (read by
# loading/reranker.py from the same or its own file) and the image tower of its vision variant.
_NOT_OURS = ("reranker.", "reranker_layer_idx", "vit.", "proj.")
_TASK_HEAD = re.compile(r"head\.(\w+)_head\.(fc1\.weight|fc2\.weight|norm\.weight|norm\.bias)")
# A reranker's scoring head, nn.Sequential(Linear(C, C), Tanh, Linear(C, 1, bias=False)) in its file.
_HEADS = {
    "head.0.weight": "score_head.dense_w",
    "head.0.bias": "score_head.dense_b",
    "head.2.weight": "score_head.out_w",
}


def target_name(name: str, family: int) -> str | None:
    """Our module's parameter name for a canonical tensor name (None: consumed elsewhere)."""
    if name.startswith("blocks.0.ln0."):
        return None
    if name.startswith(_NOT_OURS):
        return None  # an EmbeddingRWKV file's reranker (loading/reranker.py) or image tower (unsupported)
    if name in _HEADS:
        return _HEADS[name]
    m = _TASK_HEAD.fullmatch(name)
    if m:  # EmbeddingRWKV's task heads: head.retr_head.fc1.weight -> task_heads.retr.fc1
        task, part = m.groups()
        return f"task_heads.{task}.{part.removesuffix('.weight') if part.startswith('fc') else part}"
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
        if name.endswith(".ffn.s_emb_x.weight"):
            return None  # RWKV-7a: folded into ffn.s_emb (Plan.tensors)
        return re.sub(r"\.x_([rwkvag])$", r".mix_\1", name)
    name = re.sub(r"\.time_mix_([kvrg])$", r".mix_\1", name)
    name = re.sub(r"\.att\.time_decay$", ".att.log_decay", name)
    name = re.sub(r"\.att\.time_(first|faaaa)$", ".att.bonus", name)
    return name


def source_name(target: str) -> str:
    """The checkpoint's name of a head parameter of ours (for messages; others are returned as they are)."""
    heads = {v: k for k, v in _HEADS.items()}
    if target in heads:
        return heads[target]
    m = re.fullmatch(r"task_heads\.(\w+)\.(fc1|fc2|norm\.weight|norm\.bias)", target)
    if m:
        part = m.group(2)
        return f"head.{m.group(1)}_head.{part}{'.weight' if part.startswith('fc') else ''}"
    return target


def transform(
    name: str, t: Tensor, cfg: ModelConfig, dtype: torch.dtype, rescale_every: int, real_bonus: bool
) -> Tensor:
    """The tensor our module holds for the canonical tensor `name`."""
    layer = int(name.split(".")[1]) if name.startswith("blocks.") else 0
    if name.startswith("head.") and name != "head.weight":
        return t.float()  # the task and score heads: fp32 whatever the model dtype (models/heads.py)
    if cfg.family >= 6:
        if _REVERSED_MIX.search(name):
            return 1 - t.float().reshape(-1)
        if name.endswith(".att.time_decay"):  # RWKV-6: raw; each token adds its LoRA before -exp
            return t.float().reshape(-1)
        if name.endswith(".att.r_k"):
            return t.float().reshape(cfg.n_head, cfg.head_size)
        if re.search(r"\.att\.(w0|a0|v0|k_k|k_a)$|\.ffn\.s0$", name):
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


def embedding(src: Tensor, ln0_w: Tensor, ln0_b: Tensor, dtype: torch.dtype) -> Tensor:
    """The embedding with ln0 folded in (docs/formats.md A.7), computed in row chunks: no fp32 copy of the
    whole table (1 GB at the 7B shape)."""
    V, C = src.shape
    out = torch.empty(V, C, dtype=dtype)
    w, b = ln0_w.float(), ln0_b.float()
    rows = max(1, _CHUNK_ELEMS // C)
    for r0 in range(0, V, rows):
        out[r0 : r0 + rows] = F.layer_norm(src[r0 : r0 + rows].float(), (C,), w, b).to(dtype)
    return out


def deep_embed_table(src: Tensor, ck: Checkpoint, x_name: str, dtype: torch.dtype) -> Tensor:
    """RWKV-7a: a block's s_emb with the embedding's contribution folded in, as the `rwkv` package
    does: s_emb + LN(emb; ln0) @ s_emb_x^T, in row chunks (no fp32 copy of a whole table)."""
    if x_name not in ck:
        raise CheckpointError(f"{ck.where}: tensor {x_name} is missing")
    emb, w, b = ck.get("emb.weight"), ck.get("blocks.0.ln0.weight").float(), ck.get("blocks.0.ln0.bias").float()
    proj = ck.get(x_name).float().t()  # [C, 1024]
    V, C = emb.shape
    if tuple(src.shape) != (V, proj.shape[1]) or proj.shape[0] != C:
        raise CheckpointError(
            f"{ck.where}: RWKV-7a tables of shapes {tuple(src.shape)} and {tuple(ck.shape(x_name))} do not fit "
            f"an embedding of {(V, C)}"
        )
    out = torch.empty(src.shape, dtype=dtype)
    rows = max(1, _CHUNK_ELEMS // src.shape[1])
    for r0 in range(0, V, rows):
        e = F.layer_norm(emb[r0 : r0 + rows].float(), (C,), w, b)
        out[r0 : r0 + rows] = (src[r0 : r0 + rows].float() + e @ proj).to(dtype)
    return out


def initial_state(ck: Checkpoint, cfg: ModelConfig) -> dict[str, Tensor]:
    """A state-tuned RWKV-6/7 file's learned initial wkv state: {"att_kv": [L, H, N, N]}, or {}.

    Each block's time_state [H, N, N] is stored [value][key] in both versions, and att_kv is
    [key][value] in both (state.py), so one transpose (1, 2) serves both (docs/formats.md A.4, A.9): for
    RWKV-6 the `rwkv` pip package does this (tested against it); for RWKV-7, which it cannot run
    from a state, the trainer that writes these files (RWKV-PEFT) and the engines that read them
    (fla, web-rwkv) use the same orientation. State-only files (the time_state tensors alone)
    are states: state.load_state reads them with this same transpose.
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
