"""RWKV-5.x time mix (docs/formats.md A.3, A.8): 5.0 (no gate), 5.1 (gate, per-head decay), 5.2 (per-channel decay)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels import wkv5
from .layers import head_group_norm, mix, token_shift

Tensor = torch.Tensor


def add_head_projections(module: nn.Module, cfg: ModelConfig, dtype: torch.dtype, gated: bool) -> None:
    """The projections and per-head GroupNorm that RWKV-5 and RWKV-6 time mixes share."""
    C, A, H, N = cfg.n_embd, cfg.dim_att, cfg.n_head, cfg.head_size
    module.receptance = nn.Linear(C, A, bias=False, dtype=dtype)
    module.key = nn.Linear(C, A, bias=False, dtype=dtype)
    module.value = nn.Linear(C, A, bias=False, dtype=dtype)
    if gated:
        module.gate = nn.Linear(C, A, bias=False, dtype=dtype)
    module.output = nn.Linear(A, C, bias=False, dtype=dtype)
    module.ln_x = nn.GroupNorm(H, A)  # its affine weight/bias, applied by head_group_norm
    module.n_head, module.head_size = H, N
    module.dtype = dtype


class TimeMix5(nn.Module):
    """Multi-head linear attention with a matrix state per head.

    log_decay [H, N] = -exp(time_decay) and bonus [H, N] (u) are fp32; 5.0/5.1 checkpoints store one
    value per head, which the loader broadcasts over the head's channels.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        C, H, N = cfg.n_embd, cfg.n_head, cfg.head_size
        self.gated = cfg.version != "5.0"
        names = ("mix_k", "mix_v", "mix_r") + (("mix_g",) if self.gated else ())
        for name in names:
            setattr(self, name, nn.Parameter(torch.empty(C), requires_grad=False))
        self.log_decay = nn.Parameter(torch.empty(H, N), requires_grad=False)
        self.bonus = nn.Parameter(torch.empty(H, N), requires_grad=False)
        add_head_projections(self, cfg, dtype, self.gated)

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], float]]:
        N = cfg.head_size
        return {"att_kv": ((cfg.n_head, N, N), 0.0)}

    def forward(self, xx: Tensor, x_prev: Tensor, st: dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        B, T, _ = xx.shape
        H, N, dt = self.n_head, self.head_size, self.dtype
        sx = token_shift(xx, x_prev)
        r = self.receptance(mix(xx, sx, self.mix_r).to(dt)).float().view(B, T, H, N)
        k = self.key(mix(xx, sx, self.mix_k).to(dt)).float().view(B, T, H, N)
        v = self.value(mix(xx, sx, self.mix_v).to(dt)).float().view(B, T, H, N)
        y, kv = wkv5(r, k, v, self.log_decay, self.bonus, st["att_kv"])
        y = head_group_norm(y.reshape(B, T, H * N), H, self.ln_x.weight, self.ln_x.bias)
        if self.gated:
            y = y * F.silu(self.gate(mix(xx, sx, self.mix_g).to(dt)).float())
        out = self.output(y.to(dt)).float()
        return out, xx[:, -1], {"att_kv": kv}
