"""Model definitions: one RWKV class, a time-mix module per version, shared layers."""

from .model import RWKV, Block

__all__ = ["RWKV", "Block"]
