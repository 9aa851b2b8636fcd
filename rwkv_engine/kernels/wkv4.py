"""RWKV-4 WKV, in the log-space form that stays finite for any decay and any length.

Per channel c, with w = -exp(time_decay) <= 0 (log of the per-step decay) and u = time_first:

    wkv_t = (sum_{s<t} e^{(t-1-s) w + k_s} v_s + e^{u + k_t} v_t)
          / (sum_{s<t} e^{(t-1-s) w + k_s}     + e^{u + k_t})

The state carries numerator and denominator scaled by e^{-max}: (num, den, max), so that no
exponent is ever positive. A fresh state is (0, 0, -1e30).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def wkv4(
    k: Tensor, v: Tensor, w: Tensor, u: Tensor, num: Tensor, den: Tensor, mx: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One pass of RWKV-4 WKV over a sequence.

    k, v: [B, T, C] fp32; w, u: [C] fp32 (w = log decay, <= 0); num, den, mx: [B, C] fp32.
    Returns (y [B, T, C], num, den, mx); the inputs are not modified.
    """
    T = k.shape[1]
    y = torch.empty_like(k)
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        ww = u + kt
        p = torch.maximum(mx, ww)
        e1 = torch.exp(mx - p)
        e2 = torch.exp(ww - p)
        y[:, t] = (e1 * num + e2 * vt) / (e1 * den + e2)
        ww = w + mx
        p = torch.maximum(ww, kt)
        e1 = torch.exp(ww - p)
        e2 = torch.exp(kt - p)
        num = e1 * num + e2 * vt
        den = e1 * den + e2
        mx = p
    return y, num, den, mx


def wkv4_reference(k: Tensor, v: Tensor, w: Tensor, u: Tensor, num0: Tensor, den0: Tensor, mx0: Tensor) -> Tensor:
    """The defining formula, evaluated directly in float64 (the test oracle; short T only).

    The initial state enters as e^{mx0 + t w} (num0, den0) at step t.
    """
    k, v, w, u = (a.double() for a in (k, v, w, u))
    num0, den0, mx0 = num0.double(), den0.double(), mx0.double()
    B, T, C = k.shape
    y = torch.empty(B, T, C, dtype=torch.float64)
    for t in range(T):
        lags = torch.arange(t - 1, -1, -1, dtype=torch.float64)  # t-1-s for s = 0..t-1
        e = torch.exp(lags[None, :, None] * w + k[:, :t])  # [B, t, C]
        e0 = torch.exp(mx0 + t * w)
        now = torch.exp(u + k[:, t])
        y[:, t] = (e0 * num0 + (e * v[:, :t]).sum(1) + now * v[:, t]) / (e0 * den0 + e.sum(1) + now)
    return y.float()
