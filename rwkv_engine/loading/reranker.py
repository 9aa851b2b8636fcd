"""An EmbeddingRWKV reranker checkpoint: its `reranker.*` tensors loaded as a model of their own,
checked against the embedding model whose states it reads.

The file (docs/models.md, Reranking) holds a few RWKV-7 blocks under `reranker.blocks.N.*` with
BlinkDL's names, a one-row input embedding (`reranker.emb.weight`, or `reranker.token.weight`)
with block 0's ln0, `reranker.ln_out.*`, a scoring head `reranker.head.{0,2}.*`, and optionally
`reranker_layer_idx`: the embedder layers whose WKV states its blocks start from (block i from
layer idx[i]; without it, block i from layer i). Everything else in the file is not the
reranker's (a file may also hold its embedder).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from .formats import RERANKER_LAYERS, Checkpoint, open_checkpoint
from .plan import assemble, plan_checkpoint
from .resolve import resolve

_PREFIX = "reranker."


def _reranker_part(ck: Checkpoint) -> Checkpoint:
    names = {}
    for k in ck.keys():
        if k.startswith(_PREFIX):
            name = k[len(_PREFIX) :]
            names[k] = "emb.weight" if name == "token.weight" else name
    if not names:
        raise CheckpointError(f"{ck.where}: not a reranker checkpoint (no reranker.* tensors)")
    return ck.select(names)


def _layers(ck: Checkpoint, n_layer: int, embedder_layers: int, where: Path) -> list[int]:
    """Which embedder layer's state each reranker block starts from."""
    if RERANKER_LAYERS not in ck:
        if n_layer > embedder_layers:
            raise CheckpointError(
                f"{where}: the reranker has {n_layer} blocks, each reading the state of the embedder layer of the "
                f"same index, but the embedding model has {embedder_layers} layers: not its embedder"
            )
        return list(range(n_layer))
    idx = ck.get(RERANKER_LAYERS)
    if idx.dtype.is_floating_point or idx.dim() != 1 or idx.numel() != n_layer:
        raise CheckpointError(
            f"{where}: {RERANKER_LAYERS} must list one embedder layer per reranker block ({n_layer}), "
            f"got {list(idx.shape)} {idx.dtype}"
        )
    layers = [int(i) for i in idx]
    bad = [i for i in layers if not 0 <= i < embedder_layers]
    if bad:
        raise CheckpointError(
            f"{where}: {RERANKER_LAYERS} names embedder layer {bad[0]}, but the embedding model has "
            f"{embedder_layers} layers: not its embedder"
        )
    return layers


def load_scorer(embedder, path_or_id, progress: bool = True):
    """(the reranker's blocks and score head as a model, the embedder layer each block starts from),
    on the embedder's device and in its dtype. CheckpointError when the file is not a reranker or
    does not fit `embedder` (another width, head layout or depth: a mismatched pair)."""
    path = resolve(path_or_id)
    ck = open_checkpoint(path)
    part = _reranker_part(ck)
    plan = plan_checkpoint(part, path, embedder.device, embedder.dtype)
    cfg, mine = plan.cfg, embedder.config
    if not cfg.score_head or cfg.lm_head or cfg.task_heads:
        raise CheckpointError(f"{path}: the reranker.* tensors have no scoring head (reranker.head.0/2.*)")
    if not mine.task_heads:
        raise CheckpointError(
            f"{path} reranks with the states of its EmbeddingRWKV model, but {embedder.path} is not one "
            "(it has no task heads)"
        )
    if cfg.family != 7 or (cfg.n_embd, cfg.n_head, cfg.head_size) != (mine.n_embd, mine.n_head, mine.head_size):
        raise CheckpointError(
            f"{path} does not fit {embedder.path}: the reranker reads {cfg.n_head} heads of {cfg.head_size}x"
            f"{cfg.head_size} (width {cfg.n_embd}), the embedding model has {mine.n_head} of {mine.head_size}x"
            f"{mine.head_size} (width {mine.n_embd}): not its embedder"
        )
    layers = _layers(ck, cfg.n_layer, mine.n_layer, path)
    scorer = assemble(plan, progress)
    scorer.requires_grad_(False)
    return scorer, layers
