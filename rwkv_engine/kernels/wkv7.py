"""RWKV-7 WKV: the generalized delta rule, a matrix state per head with a per-token decay.

For each head, with the state S laid out [key][value] (N_k x N_v) and token t:

    S_t = diag(w_t) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T
    y_t = S_t^T r_t                      (y_t[j] = sum_i r_t[i] S_t[i, j], the state *after* the update)

w_t = exp(log_w_t) is a per-key-channel decay in (0, 1]. RWKV-7 calls it with a = -kk and
b = kk * iclr (kk the L2-normalized key, iclr the in-context learning rate in (0, 1)): the state
forgets a fraction of what it stored along kk before it writes k v^T (docs/formats.md A.8). The kernels
take any a, b; only the argument order follows RWKV-7's CUDA op (a is the vector read from
the state, b the one the read is written back along).

`wkv7_naive` is the specification: the recurrence, one token at a time.
`wkv7_export` is the chunked form written for torch.export / ExecuTorch (see its docstring).
`wkv7_chunked` is the parallel form for prefill (the WY / UT-transform representation). Inside a
chunk of c tokens with entering state S_0, the rows u_t = S_{t-1}^T a_t solve a unit lower
triangular system,

    u_t = S_0^T (a_t * G[t-1]) + sum_{s<t} <a_t, b_s * G(s, t-1)> u_s + <a_t, k_s * G(s, t-1)> v_s,

where G(s, t) = prod_{s<tau<=t} w_tau, and then outputs and the final state are sums of the same
terms decayed to t or to the chunk end. Every decay it evaluates is exp of a sum of log-decays
over a forward time interval (never a ratio of two cumulative products), so it stays finite for
decays at 0 and at 1 and for any length; the triangular solve is forward substitution of the
same recurrence restricted to the chunk.

Shapes: r, k, log_w, a, b [B, T, H, K]; v [B, T, H, V]; state [B, H, K, V] fp32 laid out
[key][value] (the transpose of the `rwkv` pip package's RWKV-7 state, docs/formats.md A.9).
All return (y [B, T, H, V], new state) and never modify their inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gpu
from .wkv5 import span_sums, strictly_lower

Tensor = torch.Tensor

# Below this many tokens the recurrence costs no more than setting up the chunked form.
CHUNKED_MIN_T = 16


def wkv7_naive(
    r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, a: Tensor, b: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The recurrence, token by token (the spec, and the decode path)."""
    T = r.shape[1]
    w = torch.exp(log_w)
    S = state
    ys = []
    for t in range(T):
        read = torch.einsum("bhi,bhij->bhj", a[:, t], S)  # a^T S: [B, H, V]
        S = (
            w[:, t, :, :, None] * S
            + b[:, t, :, :, None] * read[:, :, None, :]
            + k[:, t, :, :, None] * v[:, t, :, None, :]
        )
        ys.append(torch.einsum("bhi,bhij->bhj", r[:, t], S))
    return torch.stack(ys, dim=1), S


def _intra_chunk_matrices(left: Tensor, right: Tensor, lw: Tensor) -> Tensor:
    """M[p, q, t, s] = sum_i left[p][t, i] right[q][s, i] exp(sum_{s<tau<t} lw[tau, i]) for s < t, else 0.

    left [P, ..., c, K], right [Q, ..., c, K], lw [..., c, K] -> [P, Q, ..., c, c]. Built one lag
    (t - s) at a time: the decay between s and t is a running sum over exactly those tokens.
    """
    c = lw.shape[-2]
    out = left.new_zeros(left.shape[0], right.shape[0], *lw.shape[:-2], c, c)
    between = None  # sum of lw strictly between s and t, for s = 0 .. c-1-lag
    for lag in range(1, c):
        if lag > 1:
            step = lw[..., lag - 1 : c - 1, :]
            between = step if between is None else between[..., : c - lag, :] + step
        q = left[..., lag:, :]
        if between is not None:
            q = q * torch.exp(between)
        d = torch.einsum("p...ti,q...ti->pq...t", q, right[..., : c - lag, :])
        out.diagonal(offset=-lag, dim1=-2, dim2=-1).copy_(d)
    return out


def wkv7_chunked(
    r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, a: Tensor, b: Tensor, state: Tensor, chunk: int = 32
) -> tuple[Tensor, Tensor]:
    """The chunked parallel form (same result as `wkv7_naive`)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    # Always whole chunks (a short input is padded): a chunk's bits must not depend on whether the
    # call holds more tokens (prefill in pieces = in one go), and the chunk size changes the
    # summation order of every product below.
    c = chunk
    n = (T + c - 1) // c
    pad = n * c - T

    def blocks(x: Tensor) -> Tensor:  # [B, T, H, D] -> [B, H, n, c, D]
        if pad:  # zero r, k, v, a, b and log_w = 0: padding neither decays nor writes the state
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.view(B, n, c, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    rb, kb, vb, ab, bb, lw = (blocks(x) for x in (r, k, v, a, b, log_w))
    # Log-decays over exact spans inside a chunk: before[t] = sum_{tau<t}, upto[t] = sum_{tau<=t},
    # after[s] = sum_{tau>s}, total = the whole chunk (all prefix sums of terms of one sign).
    upto = lw.cumsum(dim=-2)
    before = F.pad(upto[..., :-1, :], (0, 0, 1, 0))
    after = F.pad(lw.flip(-2).cumsum(dim=-2).flip(-2)[..., 1:, :], (0, 0, 0, 1))
    total = upto[..., -1, :]  # [B, H, n, K]

    # Strictly-lower parts: rows indexed by t use a_t (read of S_{t-1}) or r_t * w_t (read of S_t,
    # one more decay step); columns by s use b_s or k_s.
    M = _intra_chunk_matrices(torch.stack([ab, rb * torch.exp(lw)]), torch.stack([bb, kb]), lw)
    A_ab, A_ak, A_rb, A_rk = M[0, 0], M[0, 1], M[1, 0], M[1, 1]  # [B, H, n, c, c]
    eye = torch.eye(c, dtype=r.dtype, device=r.device)
    A_rb = A_rb + torch.diag_embed((rb * bb).sum(-1))  # s = t: no decay between
    A_rk = A_rk + torch.diag_embed((rb * kb).sum(-1))

    # u = W S_0 + U_v: forward substitution through the unit lower triangular (I - A_ab).
    rhs = torch.cat([ab * torch.exp(before), A_ak @ vb], dim=-1)
    W, U_v = torch.linalg.solve_triangular(eye - A_ab, rhs, upper=False, unitriangular=True).split([K, V], dim=-1)

    # Per chunk, as affine maps of the entering state:  y = R S_0 + Z,  S_end = P S_0 + Q.
    R = rb * torch.exp(upto) + A_rb @ W  # [B, H, n, c, K]
    Z = A_rb @ U_v + A_rk @ vb  # [B, H, n, c, V]
    b_end = (bb * torch.exp(after)).transpose(-1, -2)  # b_s decayed to the chunk end: [B, H, n, K, c]
    k_end = (kb * torch.exp(after)).transpose(-1, -2)
    P = torch.diag_embed(torch.exp(total)) + b_end @ W  # [B, H, n, K, K]
    Q = b_end @ U_v + k_end @ vb  # [B, H, n, K, V]

    S = state
    y = torch.empty(B, H, n, c, V, dtype=r.dtype, device=r.device)
    for m in range(n):
        y[:, :, m] = R[:, :, m] @ S + Z[:, :, m]
        S = P[:, :, m] @ S + Q[:, :, m]
    y = y.permute(0, 2, 3, 1, 4).reshape(B, n * c, H, V)[:, :T]
    return y, S


def _pairs(left: Tensor, right: Tensor, decay: Tensor) -> Tensor:
    """M[t, s] = sum_i left[t, i] right[s, i] decay[t, s, i]: [..., c, K] x [..., c, K] x [..., c, c, K] -> [..., c, c]."""
    return (left[..., :, None, :] * right[..., None, :, :] * decay).sum(-1)


def wkv7_export(
    r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, a: Tensor, b: Tensor, state: Tensor, chunk: int = 32
) -> tuple[Tensor, Tensor]:
    """The chunked form of `wkv7_chunked` in operations every ExecuTorch runtime has.

    The same per-chunk affine maps, with three changes: the intra-chunk matrices come from
    `span_sums` and masks (no `diagonal().copy_()`, which lowers to `diagonal_scatter`, for which
    ExecuTorch has no kernel); the unit lower triangular system is solved without
    `solve_triangular` (no kernel either) as (I - A)^-1 = (I + A)(I + A^2)(I + A^4)..., exact
    because A is strictly lower triangular (A^c = 0), a few matmuls; the state update is applied
    as exp(total) * S + b_end @ (W @ S) + Q, with no diagonal matrix built. Chunks are a Python
    loop (unrolled by torch.export, so T must be fixed). Same results as `wkv7_naive` up to rounding.
    """
    B, T, H, K = r.shape
    S, ys = state, []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        rb, kb, vb, ab, bb, lw = (x[:, start:end].transpose(1, 2) for x in (r, k, v, a, b, log_w))  # [B, H, c, D]
        c = end - start
        sums = span_sums(lw)
        lower, eye = strictly_lower(c, r)
        decay = torch.exp(sums["between"]) * lower[..., None]  # [B, H, c, c, K]
        rw = rb * torch.exp(lw)  # r_t reads S_t: one more decay step than a_t's read of S_{t-1}
        A_ab, A_ak = _pairs(ab, bb, decay), _pairs(ab, kb, decay)
        A_rb = _pairs(rw, bb, decay) + eye * (rb * bb).sum(-1)[..., None]
        A_rk = _pairs(rw, kb, decay) + eye * (rb * kb).sum(-1)[..., None]
        X = torch.cat([ab * torch.exp(sums["before"]), A_ak @ vb], dim=-1)
        power = A_ab
        for _ in range(max(c - 1, 1).bit_length()):  # X = (I - A_ab)^-1 rhs
            X = X + power @ X
            power = power @ power
        W, U_v = X.split([K, v.shape[-1]], dim=-1)
        b_end = (bb * torch.exp(sums["after"])).transpose(-1, -2)  # [B, H, K, c]
        k_end = (kb * torch.exp(sums["after"])).transpose(-1, -2)
        y = (rb * torch.exp(sums["upto"]) + A_rb @ W) @ S + A_rb @ U_v + A_rk @ vb
        S = torch.exp(sums["total"])[..., None] * S + b_end @ (W @ S) + b_end @ U_v + k_end @ vb
        ys.append(y.transpose(1, 2))
    return torch.cat(ys, dim=1), S


def _native_for(r: Tensor, v: Tensor, state: Tensor):
    """The native kernels when they run this call (fp32 on the CPU, square heads), else None."""
    if (
        r.device.type != "cpu"
        or r.dtype != torch.float32
        or state.dtype != torch.float32
        or v.shape[-1] != r.shape[-1]
        or r.shape[1] == 0
        or torch.compiler.is_compiling()  # load() stats files: dynamo cannot trace it (the naive form runs)
    ):
        return None
    from . import native

    return native.load()


def wkv7(r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, a: Tensor, b: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The one call site that picks the form: the export form under torch.export; on CUDA the
    Triton kernels (kernels/gpu: our fused step for one token, fla's for more) where installed; on
    the CPU with the native kernels, their recurrence (token by token as `wkv7_naive`, in cache: at
    512 tokens of the 1.5B shape over 10x faster than the chunked form; any split of a prompt gives
    the bits of one call); else by sequence length."""
    if torch.compiler.is_exporting() and r.shape[1] > 1:  # one graph for any T, not T unrolled steps
        return wkv7_export(r, k, v, log_w, a, b, state)
    if r.device.type == "cuda" and not torch.compiler.is_exporting():
        out = gpu.wkv7_cuda(r, k, v, log_w, a, b, state)
        if out is not None:
            return out
    ops = None if torch.compiler.is_exporting() else _native_for(r, v, state)
    if ops is not None:
        return ops.wkv7(*(t.contiguous() for t in (r, k, v, torch.exp(log_w), a, b, state)))
    if r.shape[1] < CHUNKED_MIN_T:
        return wkv7_naive(r, k, v, log_w, a, b, state)
    return wkv7_chunked(r, k, v, log_w, a, b, state)
