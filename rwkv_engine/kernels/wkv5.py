"""RWKV-5/6 WKV: a matrix-valued state per head with a per-key-channel decay.

For each head, with key index i and value index j, token t:

    y_t[j]    = sum_i r_t[i] * (u[i] * k_t[i] * v_t[j] + S[i, j])
    S[i, j]  <- w_t[i] * S[i, j] + k_t[i] * v_t[j]

RWKV-5 has one constant decay w[h, i] per head and key channel; RWKV-6 has a data-dependent
w_t[h, i]. Both kernels take the decay in log space, log_w = log(w) <= 0, either as [H, N]
(constant) or as [B, T, H, N] (per token), so one mechanism serves both versions.

`wkv5_naive` is the specification: the recurrence, one token at a time.
`wkv5_export` is the same parallel form written for torch.export / ExecuTorch (see its docstring).
`wkv5_chunked` is the parallel form for prefill: inside a chunk of c tokens the contributions
are an attention-like matrix, and the state is carried between chunks. Every exponent it
evaluates is a sum of log-decays over a forward time interval, hence <= 0, so it stays finite
for decays at 0 and at 1 and for any length.

Shapes: r, k, v [B, T, H, N] fp32; u [H, N] fp32; state [B, H, N, N] fp32 laid out [key][value].
Both return (y [B, T, H, N], new state) and never modify their inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gpu

Tensor = torch.Tensor


def _decay_per_token(log_w: Tensor, B: int, T: int) -> Tensor:
    """log_w as [B, T, H, N] (a broadcast view when it is constant)."""
    if log_w.dim() == 2:
        return log_w.expand(B, T, *log_w.shape)
    return log_w


def wkv5_naive(r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, u: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The recurrence, token by token (the spec, and the decode path for T = 1)."""
    B, T, H, N = r.shape
    w = torch.exp(_decay_per_token(log_w, B, T))
    S = state
    ys = []
    for t in range(T):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]  # [B, H, N, N]
        y = torch.einsum("bhi,bhij->bhj", r[:, t], u[..., None] * kv + S)
        S = w[:, t, :, :, None] * S + kv
        ys.append(y)
    return torch.stack(ys, dim=1), S


def wkv5_chunked(
    r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, u: Tensor, state: Tensor, chunk: int = 32
) -> tuple[Tensor, Tensor]:
    """The chunked parallel form (same result as `wkv5_naive`)."""
    B, T, H, N = r.shape
    c = chunk
    constant = log_w.dim() == 2
    if constant and T % c:
        # A constant decay would also act on padding; run the ragged tail through the recurrence.
        T0 = T - T % c
        if T0 == 0:
            return wkv5_naive(r, k, v, log_w, u, state)
        y0, S = wkv5_chunked(r[:, :T0], k[:, :T0], v[:, :T0], log_w, u, state, chunk)
        y1, S = wkv5_naive(r[:, T0:], k[:, T0:], v[:, T0:], log_w, u, S)
        return torch.cat([y0, y1], dim=1), S
    n = (T + c - 1) // c
    pad = n * c - T

    def blocks(x: Tensor) -> Tensor:  # [B, T, H, N] -> [B, H, n, c, N]
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))  # zero k, v: padding adds nothing
        return x.view(B, n, c, H, N).permute(0, 3, 1, 2, 4)

    rb, kb, vb = blocks(r), blocks(k), blocks(v)
    # Log-decays inside a chunk, each summed over exactly the tokens it spans (never as a difference
    # of two long prefix sums, which would cancel catastrophically for fast decays):
    #   before[t] = sum_{tau < t} lw,  after[s] = sum_{tau > s} lw,  total = sum of the chunk.
    if constant:
        idx = torch.arange(c, dtype=r.dtype, device=r.device)[:, None]
        lw = log_w[None, :, None, None, :]  # [1, H, 1, 1, N]
        before = idx * lw  # [1, H, 1, c, N]
        after = (c - 1 - idx) * lw
        total = c * lw
    else:
        lw = blocks(log_w)  # padded tokens get log_w = 0: no decay, the state passes unchanged
        upto = lw.cumsum(dim=3)
        before = F.pad(upto[..., :-1, :], (0, 0, 1, 0))
        after = F.pad(lw.flip(3).cumsum(dim=3).flip(3)[..., 1:, :], (0, 0, 0, 1))
        # The running sum's last term, not lw.sum(): a scan adds in token order whatever the
        # layout, while sum()'s order depends on it (one chunk or more), and a chunk must give
        # the same bits in a call of its own as inside a longer one (prefill in pieces = in one go).
        total = upto[..., -1:, :]

    # Inside each chunk: A[t, s] = sum_i r[t, i] k[s, i] exp(sum_{s < tau < t} lw[tau, i]) for s < t,
    # built one lag (t - s) at a time so that every tensor stays contiguous; the bonus on s = t.
    A = torch.zeros(B, H, n, c, c, dtype=r.dtype, device=r.device)
    A.diagonal(dim1=-2, dim2=-1).copy_((rb * u[None, :, None, None, :] * kb).sum(-1))
    between = None  # sum of lw strictly between s and t, for t = lag..c-1
    for lag in range(1, c):
        if lag > 1 and constant:
            between = (lag - 1) * lw
        elif lag > 1:
            step = lw[..., 1 : c - lag + 1, :]
            between = step if between is None else between[..., 1:, :] + step
        q = rb[..., lag:, :]
        if between is not None:
            q = q * torch.exp(between)
        A.diagonal(offset=-lag, dim1=-2, dim2=-1).copy_((q * kb[..., : c - lag, :]).sum(-1))
    y = A @ vb  # [B, H, n, c, N]

    # Between chunks: the state entering chunk m, decayed to each position, read by r.
    r_decayed = rb * torch.exp(before)  # [B, H, n, c, N]
    k_to_end = kb * torch.exp(after)  # k_s decayed from s to the chunk end
    w_chunk = torch.exp(total).squeeze(-2)  # [., H, ., N]: decay over a whole chunk
    S = state
    for m in range(n):
        y[:, :, m] += r_decayed[:, :, m] @ S
        wm = w_chunk[:, :, 0] if constant else w_chunk[:, :, m]
        S = wm[..., :, None] * S + k_to_end[:, :, m].transpose(-1, -2) @ vb[:, :, m]
    y = y.permute(0, 2, 3, 1, 4).reshape(B, n * c, H, N)[:, :T]
    return y, S


def span_sums(lw: Tensor) -> dict[str, Tensor]:
    """Sums of the log-decays lw [..., c, K] of one chunk over the spans the chunked forms need.

    before [..., c, K] (tau < t), upto [..., c, K] (tau <= t), after [..., c, K] (tau > s),
    total [..., K] (the chunk), between [..., c, c, K] (s < tau < t, indexed [t, s]; 0 unless s < t).
    Each is a product with a 0/1 mask, so every sum adds terms of one sign over exactly its span:
    no cumsum, flip or difference of prefix sums (none of which an export-friendly graph needs).
    """
    c = lw.shape[-2]
    i = torch.arange(c, device=lw.device)
    t, s = i[:, None], i[None, :]
    mask = {
        "before": (s < t),
        "upto": (s <= t),
        "after": (s > t),
    }
    out = {name: m.to(lw.dtype) @ lw for name, m in mask.items()}  # [c, c] @ [..., c, K]
    out["total"] = out["upto"][..., -1, :]
    tau = i[None, None, :]
    spans = ((s[..., None] < tau) & (tau < t[..., None])).to(lw.dtype).view(c * c, c)  # [t*s, tau]
    out["between"] = (spans @ lw).unflatten(-2, (c, c))
    return out


def strictly_lower(c: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """(the 0/1 mask of s < t, the identity), both [c, c] in like's dtype and device."""
    i = torch.arange(c, device=like.device)
    return (i[None, :] < i[:, None]).to(like.dtype), (i[None, :] == i[:, None]).to(like.dtype)


def wkv5_export(
    r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, u: Tensor, state: Tensor, chunk: int = 32
) -> tuple[Tensor, Tensor]:
    """The chunked form of `wkv5_chunked` in operations every ExecuTorch runtime has.

    No in-place writes (the chunked form's `diagonal().copy_()` becomes `diagonal_scatter`, which
    ExecuTorch has no kernel for), no cumsum or flip: the intra-chunk matrix is built from
    `span_sums` and masks, the chunks are a Python loop (unrolled by torch.export, so T must be
    fixed) and the outputs one concatenation. Same results as `wkv5_naive` up to rounding.
    """
    B, T, H, N = r.shape
    lw_all = _decay_per_token(log_w, B, T)
    S, ys = state, []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        rb, kb, vb, lw = (x[:, start:end].transpose(1, 2) for x in (r, k, v, lw_all))  # [B, H, c, N]
        c = end - start
        sums = span_sums(lw)
        lower, eye = strictly_lower(c, r)
        decay = torch.exp(sums["between"]) * lower[..., None]  # [B, H, c, c, N]
        A = (rb[..., :, None, :] * kb[..., None, :, :] * decay).sum(-1)  # [B, H, c, c]
        A = A + eye * (rb * u[:, None, :] * kb).sum(-1)[..., None]  # the bonus on s = t
        y = A @ vb + (rb * torch.exp(sums["before"])) @ S
        S = torch.exp(sums["total"])[..., None] * S + (kb * torch.exp(sums["after"])).transpose(-1, -2) @ vb
        ys.append(y.transpose(1, 2))
    return torch.cat(ys, dim=1), S


def wkv5(r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, u: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The one call site that picks the form: the export form under torch.export; on CUDA the
    Triton kernels (kernels/gpu: our fused step for one token, fla's RWKV-6 kernels for more) where
    installed; else by sequence length."""
    if torch.compiler.is_exporting() and r.shape[1] > 1:  # one graph for any T, not T unrolled steps
        return wkv5_export(r, k, v, log_w, u, state)
    if r.device.type == "cuda" and not torch.compiler.is_exporting():
        out = gpu.wkv5_cuda(r, k, v, log_w, u, state)
        if out is not None:
            return out
    if r.shape[1] < 4:
        return wkv5_naive(r, k, v, log_w, u, state)
    return wkv5_chunked(r, k, v, log_w, u, state)
