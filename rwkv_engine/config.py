"""Model configuration: one dataclass for every RWKV version, sizes read from tensor shapes."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CheckpointError

VERSIONS = ("4", "5.0", "5.1", "5.2")


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of an RWKV model, all inferred from the checkpoint's tensors.

    version:    "4", "5.0", "5.1" or "5.2"
    n_layer:    number of blocks
    n_embd:     width of the residual stream (C)
    vocab_size: rows of the embedding and the head (V)
    ffn_dim:    width of the channel-mix hidden layer (F)
    dim_att:    width of the time-mix (A; equal to n_embd in every released model)
    n_head:     heads of the time-mix (H); 0 for RWKV-4, which has none
    head_size:  channels per head (N = dim_att / n_head); 0 for RWKV-4
    """

    version: str
    n_layer: int
    n_embd: int
    vocab_size: int
    ffn_dim: int
    dim_att: int
    n_head: int = 0
    head_size: int = 0

    def __post_init__(self):
        if self.version not in VERSIONS:
            raise CheckpointError(f"unsupported RWKV version {self.version!r} (supported: {', '.join(VERSIONS)})")
        for name in ("n_layer", "n_embd", "vocab_size", "ffn_dim", "dim_att"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.family == 5:
            if self.n_head <= 0 or self.n_head * self.head_size != self.dim_att:
                raise CheckpointError(
                    f"model config: {self.n_head} heads of size {self.head_size} do not make dim_att {self.dim_att}"
                )

    @property
    def family(self) -> int:
        """The major version: 4 or 5."""
        return int(float(self.version))

    def state_signature(self) -> str:
        """A string that two models share exactly when their recurrent states are interchangeable."""
        return (
            f"rwkv-{self.version}:L{self.n_layer}:C{self.n_embd}:A{self.dim_att}:H{self.n_head}:N{self.head_size}"
        )
