"""RWKV-7 "Goose" (x070) time mix (docs/formats.md A.5, A.8): the generalized delta rule with a value residual."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels import wkv7
from .layers import ChannelMix, Embedding, head_group_norm, mix, token_shift

Tensor = torch.Tensor

_MIXED = ("r", "w", "k", "v", "a", "g")

# The per-step decay is w = exp(-e^-0.5 * sigmoid(w0 + lora)), in (0.545, 1).
_DECAY_SCALE = math.exp(-0.5)


class TimeMix7(nn.Module):
    """Multi-head WKV7 with data-dependent decay, in-context learning rate, gate and value residual.

    Mixes are stored in the shared `mix` convention (m = 1 - x_*). The small LoRA matrices
    (w1/w2 decay, a1/a2 learning rate, v1/v2 value residual, g1/g2 gate; `LORA`) keep the
    checkpoint's type (bf16 / fp16 / fp32) and are used upcast, in fp32 math; their biases are
    fp32. receptance/key/value/output are nn.Linear in the model dtype.

    Layer 0 has no value-residual LoRA: its values (per token) are `v_first`, which it puts in the
    per-forward context `ctx` for the later layers to mix towards. v_first is not recurrent
    state: it is recomputed on every forward pass.
    """

    shares_context = True  # built with its layer index; forward reads/writes the per-forward ctx
    LORA = ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2")  # (RWKV.lora_names)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_id: int):
        super().__init__()
        C, H, N = cfg.n_embd, cfg.n_head, cfg.head_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        for name in _MIXED:
            setattr(self, "mix_" + name, param(C))
        self.w0, self.w1, self.w2 = param(C), param(C, cfg.lora_decay), param(cfg.lora_decay, C)
        self.a0, self.a1, self.a2 = param(C), param(C, cfg.lora_iclr), param(cfg.lora_iclr, C)
        self.first = layer_id == 0
        if not self.first:
            self.v0, self.v1, self.v2 = param(C), param(C, cfg.lora_value), param(cfg.lora_value, C)
        self.g1, self.g2 = param(C, cfg.lora_gate), param(cfg.lora_gate, C)
        self.k_k = param(C)
        self.k_a = param(C)
        self.r_k = param(H, N)
        self.receptance = nn.Linear(C, C, bias=False, dtype=dtype)
        self.key = nn.Linear(C, C, bias=False, dtype=dtype)
        self.value = nn.Linear(C, C, bias=False, dtype=dtype)
        self.output = nn.Linear(C, C, bias=False, dtype=dtype)
        self.ln_x = nn.GroupNorm(H, C)  # its affine weight/bias, applied by head_group_norm
        self.n_head, self.head_size = H, N
        self.dtype = dtype

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], float]]:
        N = cfg.head_size
        return {"att_kv": ((cfg.n_head, N, N), 0.0)}  # [key][value], see kernels/wkv7.py

    def forward(
        self, xx: Tensor, x_prev: Tensor, st: dict[str, Tensor], ctx: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        B, T, C = xx.shape
        H, N, dt = self.n_head, self.head_size, self.dtype
        sx = token_shift(xx, x_prev)
        d = xx - sx  # each mix below is mix(xx, sx, m) = sx + (xx - sx) * m, the difference made once
        # Each mix is made where it is used and dropped after: a prefill piece's [B, T, C]
        # temporaries are what its peak memory is made of (the six mixes of a 512-token piece of
        # the 1.5B shape are 24 MB of fp32).
        r = self.receptance((sx + d * self.mix_r).to(dt)).float()
        k = self.key((sx + d * self.mix_k).to(dt)).float()
        xv = sx + d * self.mix_v
        v = self.value(xv.to(dt)).float()
        if self.first:
            ctx["v_first"] = v
        else:
            v = v + (ctx["v_first"] - v) * torch.sigmoid(self.v0 + (xv @ self.v1.float()) @ self.v2.float())
        del xv
        log_w = -_DECAY_SCALE * torch.sigmoid(
            self.w0 + torch.tanh((sx + d * self.mix_w) @ self.w1.float()) @ self.w2.float()
        )
        iclr = torch.sigmoid(self.a0 + ((sx + d * self.mix_a) @ self.a1.float()) @ self.a2.float())
        # The gate's low-rank half now, its [B, T, C] product after the WKV, when r, k and v are gone.
        g_low = torch.sigmoid((sx + d * self.mix_g) @ self.g1.float())
        del sx, d
        kk = F.normalize((k * self.k_k).view(B, T, H, N), dim=-1)
        k = k * (1 + (iclr - 1) * self.k_a)
        b = kk * iclr.view(B, T, H, N)
        del iclr
        heads = (B, T, H, N)
        r, k, v = r.view(heads), k.view(heads), v.view(heads)
        y, kv = wkv7(r, k, v, log_w.view(heads), kk.neg_(), b, st["att_kv"])
        del log_w, kk, b
        y = head_group_norm(y.reshape(B, T, C), H, self.ln_x.weight, self.ln_x.bias)
        bonus = (r * k * self.r_k).sum(-1, keepdim=True) * v  # the current token's own r.k, per head
        del r, k, v
        g = g_low @ self.g2.float()
        del g_low
        out = self.output(((y + bonus.reshape(B, T, C)) * g).to(dt)).float()
        return out, xx[:, -1], {"att_kv": kv}


# RWKV-7a's per-token table: 1024 = a 32 x 32 matrix per token and block.
DEEP_EMBED_DIM, DEEP_EMBED_RANK = 1024, 32


class ChannelMix7a(ChannelMix):
    """RWKV-7a (DeepEmbed) channel mix: RWKV-7's, with the key activations scaled per token:

        k = relu(kx @ Wk)^2 * ((xx @ s1) @ s_emb[token].view(32, 32) @ s2 + s0)

    xx is the block's post-LN input (not the token-shifted kx). s_emb [V, 1024] holds the
    checkpoint's table plus emb @ s_emb_x^T (folded at load, as the `rwkv` package does); it is an
    `Embedding` whose rows can be read from a file (memory.FileRows), never whole in memory, and
    stays in the model dtype under quantization. s0 [F], s1 [C, 32], s2 [32, F] are fp32.
    """

    shares_context = True  # forward reads the token ids from the per-forward ctx

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__(cfg.n_embd, cfg.ffn_dim, dtype, receptance=False)
        C, F_, R = cfg.n_embd, cfg.ffn_dim, DEEP_EMBED_RANK
        V = cfg.vocab_size
        self.s_emb = Embedding(V, DEEP_EMBED_DIM, _weight=torch.empty(V, DEEP_EMBED_DIM, dtype=dtype))
        self.s0 = nn.Parameter(torch.empty(F_), requires_grad=False)
        self.s1 = nn.Parameter(torch.empty(C, R), requires_grad=False)
        self.s2 = nn.Parameter(torch.empty(R, F_), requires_grad=False)

    def forward(self, xx: Tensor, x_prev: Tensor, ctx: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        B, T, _ = xx.shape
        R = DEEP_EMBED_RANK
        xk = mix(xx, token_shift(xx, x_prev), self.mix_k).to(self.dtype)
        k = torch.relu_(self.key(xk)).square_()
        del xk
        table = self.s_emb(ctx["ids"]).float().view(B, T, R, R)
        ss = ((xx @ self.s1).unsqueeze(-2) @ table).squeeze(-2)  # [B, T, 32]
        k = (k.float() * (ss @ self.s2 + self.s0)).to(self.dtype)
        return self.value(k).float(), xx[:, -1]
