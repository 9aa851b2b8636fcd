"""Model configuration: one dataclass for every RWKV version, sizes read from tensor shapes."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CheckpointError

VERSIONS = ("4", "5.0", "5.1", "5.2", "6.0", "7")

# EmbeddingRWKV's task heads (models/heads.py TaskHead): retrieval (its default), classification,
# semantic similarity.
TASKS = ("retr", "cls", "sts")


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of an RWKV model, all inferred from the checkpoint's tensors.

    version:    "4", "5.0", "5.1", "5.2", "6.0" or "7"
    n_layer:    number of blocks
    n_embd:     width of the residual stream (C)
    vocab_size: rows of the embedding and the head (V)
    ffn_dim:    width of the channel-mix hidden layer (F)
    dim_att:    width of the time-mix (A; equal to n_embd in every released model)
    n_head:     heads of the time-mix (H); 0 for RWKV-4, which has none
    head_size:  channels per head (N = dim_att / n_head); 0 for RWKV-4

    Ranks of the small low-rank (LoRA) projections, read from their shapes (0 where unused):
    lora_mix:   RWKV-6 data-dependent token-shift mix (time_maa_w1 / w2)
    lora_decay: RWKV-6 decay (time_decay_w1 / w2), RWKV-7 decay (w1 / w2)
    lora_iclr:  RWKV-7 in-context learning rate (a1 / a2)
    lora_value: RWKV-7 value residual (v1 / v2; none in layer 0, so 0 for a one-layer model)
    lora_gate:  RWKV-7 output gate (g1 / g2)
    deep_embed: RWKV-7a (DeepEmbed): each block's channel mix scales its key activations by a
                per-token factor read from a vocab x 1024 table (models/rwkv7.py ChannelMix7a)

    The heads on the final hidden state (at least one; models/heads.py):
    lm_head:    the language-model head (head.weight, C -> V); absent in EmbeddingRWKV files
    task_heads: EmbeddingRWKV's task heads present, a subset of TASKS ("retr", "cls", "sts")
    task_dim:   their hidden width (the rows of fc1; C in the released models)
    score_head: a reranker's scoring head (C -> C -> 1); its "model" is the few blocks it
                runs on an embedder's states (embedding.Reranker)
    """

    version: str
    n_layer: int
    n_embd: int
    vocab_size: int
    ffn_dim: int
    dim_att: int
    n_head: int = 0
    head_size: int = 0
    lora_mix: int = 0
    lora_decay: int = 0
    lora_iclr: int = 0
    lora_value: int = 0
    lora_gate: int = 0
    deep_embed: bool = False
    lm_head: bool = True
    task_heads: tuple[str, ...] = ()
    task_dim: int = 0
    score_head: bool = False

    def __post_init__(self):
        # (a converted directory's config.json gives a list)
        object.__setattr__(self, "task_heads", tuple(sorted(self.task_heads)))
        unknown = [t for t in self.task_heads if t not in TASKS]
        if unknown:
            raise CheckpointError(f"model config: unknown task head {unknown[0]!r} (known: {', '.join(TASKS)})")
        if self.task_heads and self.task_dim <= 0:
            raise CheckpointError(f"model config: task heads need task_dim > 0, got {self.task_dim}")
        if not (self.lm_head or self.task_heads or self.score_head):
            raise CheckpointError("model config: a model needs a head (an LM head, a task head or a score head)")
        if self.version not in VERSIONS:
            raise CheckpointError(f"unsupported RWKV version {self.version!r} (supported: {', '.join(VERSIONS)})")
        for name in ("n_layer", "n_embd", "vocab_size", "ffn_dim", "dim_att"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.family >= 5:
            if self.n_head <= 0 or self.n_head * self.head_size != self.dim_att:
                raise CheckpointError(
                    f"model config: {self.n_head} heads of size {self.head_size} do not make dim_att {self.dim_att}"
                )
        ranks = {6: ("lora_mix", "lora_decay"), 7: ("lora_decay", "lora_iclr", "lora_gate")}.get(self.family, ())
        if self.family == 7 and self.n_layer > 1:
            ranks += ("lora_value",)
        for name in ranks:
            if getattr(self, name) <= 0:
                raise CheckpointError(f"model config: RWKV-{self.version} needs {name} > 0, got {getattr(self, name)}")
        if self.deep_embed and self.family != 7:
            raise CheckpointError(f"model config: DeepEmbed is an RWKV-7 feature, not RWKV-{self.version}")
        if self.family == 7 and self.dim_att != self.n_embd:
            raise CheckpointError(f"model config: RWKV-7 needs dim_att == n_embd, got {self.dim_att} and {self.n_embd}")

    @property
    def family(self) -> int:
        """The major version: 4, 5, 6 or 7."""
        return int(float(self.version))

    def state_signature(self) -> str:
        """A string that two models share exactly when their recurrent states are interchangeable."""
        version = self.version + ("a" if self.deep_embed else "")  # 7a's states differ in meaning
        return f"rwkv-{version}:L{self.n_layer}:C{self.n_embd}:A{self.dim_att}:H{self.n_head}:N{self.head_size}"
