"""Pieces shared by every RWKV version: token shift, the channel mix, the head group norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor

# The types a small LoRA matrix of RWKV-6/7 may be stored in (RWKV.lora_names): the checkpoint's.
LORA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lora_dtype(stored: torch.dtype) -> torch.dtype:
    """The type a LoRA matrix is kept in, given its type in a file: its own 16-bit type, else fp32
    (which holds any other float type's values exactly, or as close as they come)."""
    return stored if stored in (torch.bfloat16, torch.float16) else torch.float32


def token_shift(xx: Tensor, x_prev: Tensor) -> Tensor:
    """The previous token's input for each position: [B, T, C] from xx [B, T, C] and x_prev [B, C]."""
    if xx.shape[1] == 1:
        return x_prev[:, None]
    return torch.cat([x_prev[:, None], xx[:, :-1]], dim=1)


def mix(xx: Tensor, sx: Tensor, m: Tensor) -> Tensor:
    """xx * m + sx * (1 - m): RWKV-4/5's interpolation between this token and the previous one.

    RWKV-6/7 write it x + (prev - x) * m'; the loader stores m = 1 - m' so one form serves all.
    """
    return sx + (xx - sx) * m


def head_group_norm(y: Tensor, n_head: int, weight: Tensor, bias: Tensor) -> Tensor:
    """GroupNorm over each head's channels (eps 64e-5, see docs/formats.md A.8): y [B, T, A] fp32."""
    B, T, A = y.shape
    if torch.compiler.is_exporting():
        return mean_norm(y, n_head, weight, bias, 64e-5)
    return F.group_norm(y.reshape(B * T, A), n_head, weight, bias, eps=64e-5).view(B, T, A)


def mean_norm(x: Tensor, groups: int, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """LayerNorm (groups=1) or GroupNorm of the last axis of x [..., D], as means over the last two
    axes of a 4-D view [rows, groups, 1, D / groups]: the form ExecuTorch's XNNPACK backend
    delegates (it takes neither layer_norm, group_norm nor a mean over one axis, which would split
    a step into many delegate calls). The same values as F.layer_norm / F.group_norm."""
    shape = x.shape
    x4 = x.reshape(-1, groups, 1, shape[-1] // groups)
    d = x4 - x4.mean(dim=(-2, -1), keepdim=True)
    var = (d * d).mean(dim=(-2, -1), keepdim=True)
    return (d * torch.rsqrt(var + eps)).reshape(shape) * weight + bias


class Embedding(nn.Embedding):
    """nn.Embedding whose rows may be read from the model file (`memory.FileRows`) instead of
    through its memory-mapped weight, while that weight is unchanged."""

    file_rows = None

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.file_rows
        if rows is not None and rows.serves(self.weight):
            return rows.read(ids)
        return super().forward(ids)


class ChannelMix(nn.Module):
    """out = sigmoid(rx @ Wr) * (relu(kx @ Wk)^2 @ Wv), with token-shift mixes for k and r.

    receptance=False drops the gate (RWKV-7): out = relu(kx @ Wk)^2 @ Wv.
    """

    def __init__(self, n_embd: int, ffn_dim: int, dtype: torch.dtype, receptance: bool = True):
        super().__init__()
        self.mix_k = nn.Parameter(torch.empty(n_embd), requires_grad=False)
        self.key = nn.Linear(n_embd, ffn_dim, bias=False, dtype=dtype)
        self.value = nn.Linear(ffn_dim, n_embd, bias=False, dtype=dtype)
        self.gated = receptance
        if receptance:
            self.mix_r = nn.Parameter(torch.empty(n_embd), requires_grad=False)
            self.receptance = nn.Linear(n_embd, n_embd, bias=False, dtype=dtype)
        self.dtype = dtype

    def forward(self, xx: Tensor, x_prev: Tensor) -> tuple[Tensor, Tensor]:
        """xx [B, T, C] fp32 (post-LN), x_prev [B, C] fp32 -> (out [B, T, C] fp32, new x_prev)."""
        sx = token_shift(xx, x_prev)
        xk = mix(xx, sx, self.mix_k).to(self.dtype)
        if not self.gated:
            del sx  # the key's [B, T, ffn] output below is a piece's peak: hold nothing needless
        # relu and square in place on the key's fresh output: one [B, T, ffn] temporary, not three
        k = torch.relu_(self.key(xk)).square_()
        del xk
        out = self.value(k).float()
        del k
        if self.gated:
            rx = mix(xx, sx, self.mix_r).to(self.dtype)
            out = torch.sigmoid(self.receptance(rx).float()) * out
        return out, xx[:, -1]
