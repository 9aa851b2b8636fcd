"""RWKV-6.0 "Finch" time mix (docs/formats.md A.4, A.8): data-dependent token shift and decay."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels import wkv5
from .layers import head_group_norm, mix, token_shift
from .rwkv5 import TimeMix5, add_head_projections

Tensor = torch.Tensor

_MIXED = ("w", "k", "v", "r", "g")  # the order of the five LoRA outputs in time_maa_w1 / w2


class TimeMix6(nn.Module):
    """RWKV-5.2's multi-head WKV, with a per-token decay and per-token mix coefficients.

    Mixes are stored in the shared `mix` convention (m = 1 - time_maa); a LoRA adds a per-token
    offset to each: wx = mix(xx, sx, mix_w - lora_w(xxx)). The decay is stored raw as
    `decay_base` [A] = time_decay, and each token's log decay is
    log_w = -exp(decay_base + tanh(wx @ decay_w1) @ decay_w2), computed in fp32.
    bonus [H, N] = time_faaaa (u). The small LoRA matrices (`LORA`) keep the checkpoint's type
    (bf16 / fp16 / fp32) and are used upcast, in fp32 math; the big projections are nn.Linear in
    the model dtype.
    """

    LORA = ("maa_w1", "maa_w2", "decay_w1", "decay_w2")  # (RWKV.lora_names)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        C, A, H, N = cfg.n_embd, cfg.dim_att, cfg.n_head, cfg.head_size
        D_mix, D_decay = cfg.lora_mix, cfg.lora_decay

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        self.mix_x = param(C)
        for name in _MIXED:
            setattr(self, "mix_" + name, param(C))
        self.maa_w1 = param(C, len(_MIXED) * D_mix)
        self.maa_w2 = param(len(_MIXED), D_mix, C)
        self.decay_base = param(A)
        self.decay_w1 = param(C, D_decay)
        self.decay_w2 = param(D_decay, A)
        self.bonus = param(H, N)
        add_head_projections(self, cfg, dtype, gated=True)

    state_shapes = staticmethod(TimeMix5.state_shapes)  # the same matrix state per head

    def forward(self, xx: Tensor, x_prev: Tensor, st: dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        B, T, _ = xx.shape
        H, N, dt = self.n_head, self.head_size, self.dtype
        sx = token_shift(xx, x_prev)
        lora = torch.tanh(mix(xx, sx, self.mix_x) @ self.maa_w1.float()).view(B, T, len(_MIXED), -1)
        offsets = torch.einsum("btfd,fdc->fbtc", lora, self.maa_w2.float())  # [5, B, T, C]
        wx, kx, vx, rx, gx = (mix(xx, sx, getattr(self, "mix_" + n) - o) for n, o in zip(_MIXED, offsets))
        r = self.receptance(rx.to(dt)).float().view(B, T, H, N)
        k = self.key(kx.to(dt)).float().view(B, T, H, N)
        v = self.value(vx.to(dt)).float().view(B, T, H, N)
        g = F.silu(self.gate(gx.to(dt)).float())
        log_w = -torch.exp(self.decay_base + torch.tanh(wx @ self.decay_w1.float()) @ self.decay_w2.float()).view(
            B, T, H, N
        )
        y, kv = wkv5(r, k, v, log_w, self.bonus, st["att_kv"])
        y = head_group_norm(y.reshape(B, T, H * N), H, self.ln_x.weight, self.ln_x.bias)
        out = self.output((y * g).to(dt)).float()
        return out, xx[:, -1], {"att_kv": kv}
