"""RWKV-4 time mix (docs/formats.md A.2, A.8)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels import wkv4
from .layers import mix, token_shift

Tensor = torch.Tensor


class TimeMix4(nn.Module):
    """Token-shifted k, v, r; WKV with per-channel decay and a bonus for the current token.

    log_decay = -exp(time_decay) (per-step log decay, <= 0) and bonus = time_first, both fp32.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        C, A = cfg.n_embd, cfg.dim_att
        for name in ("mix_k", "mix_v", "mix_r"):
            setattr(self, name, nn.Parameter(torch.empty(C), requires_grad=False))
        self.log_decay = nn.Parameter(torch.empty(A), requires_grad=False)
        self.bonus = nn.Parameter(torch.empty(A), requires_grad=False)
        self.key = nn.Linear(C, A, bias=False, dtype=dtype)
        self.value = nn.Linear(C, A, bias=False, dtype=dtype)
        self.receptance = nn.Linear(C, A, bias=False, dtype=dtype)
        self.output = nn.Linear(A, C, bias=False, dtype=dtype)
        self.dtype = dtype

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], float]]:
        """Per-layer, per-row state fields: name -> (shape, initial value)."""
        A = cfg.dim_att
        return {"att_num": ((A,), 0.0), "att_den": ((A,), 0.0), "att_max": ((A,), -1e30)}

    def forward(self, xx: Tensor, x_prev: Tensor, st: dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        sx = token_shift(xx, x_prev)
        dt = self.dtype
        k = self.key(mix(xx, sx, self.mix_k).to(dt)).float()
        v = self.value(mix(xx, sx, self.mix_v).to(dt)).float()
        r = torch.sigmoid(self.receptance(mix(xx, sx, self.mix_r).to(dt)).float())
        y, num, den, mx = wkv4(k, v, self.log_decay, self.bonus, st["att_num"], st["att_den"], st["att_max"])
        out = self.output((r * y).to(dt)).float()
        return out, xx[:, -1], {"att_num": num, "att_den": den, "att_max": mx}
