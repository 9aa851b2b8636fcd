"""Quantize, dequantize, pack and unpack weight matrices: the plain-PyTorch spec.

Everything here is written with ordinary tensor ops and runs on any device. It is the
definition of the stored formats, the fallback path of the quantized linear modules and the
oracle the native kernels are tested against.

A weight is an `nn.Linear` weight of shape (N, K) = (out_features, in_features). Groups run
along K: group g of row n holds columns [g*group_size, (g+1)*group_size).

int8 (symmetric, per output channel or per group; with group 32 the layout of ggml's Q8_0)

    qweight  int8    (N, K)        values in [-127, 127]
    scales   float16 (N, K // group_size)   (one column when group_size == K: per channel)
    w[n, k] ~= qweight[n, k] * scales[n, k // group_size]

int4 (group size 32, 64 or 128, 16-bit scales)

    qweight  uint8   (N, K // 2)   two codes per byte: column 2i in the low nibble of byte i,
                                   column 2i+1 in the high nibble (codes 0..15)
    scales   float16 (N, K // group_size)
    biases   float16 (N, K // group_size)  or None (symmetric)
    asymmetric: w[n, k] ~= code * scale + bias        (bias = the group's offset, often its min)
    symmetric:  w[n, k] ~= (code - 8) * scale

Scales and biases are rounded to their stored dtype *before* the codes are computed, so the codes
are the best ones for the scales that are actually stored.

Column scales (optional, both formats)

    col_scales float16 (K,)   c = column RMS of the weight, normalized to mean 1 (`column_scales`)
    the stored codes quantize W / c (column k divided by c[k]); the weight is dequant(...) * c,
    and a kernel multiplies x by c instead: W x = dequant(W / c) (c * x).

Dividing by c evens out the columns, so a few large columns no longer set every group's range
(the error it saves: docs/quantization.md).
"""

from __future__ import annotations

import math

import torch

from rwkv_engine.errors import InputError

Tensor = torch.Tensor

INT4_GROUP_SIZES = (32, 64, 128)
INT4_SCALE_DTYPE = torch.float16
INT8_SCALE_DTYPE = torch.float16
_CHUNK_ELEMS = 1 << 18  # weights quantized per step (keeps the temporaries small and in cache)


# --- checks ---------------------------------------------------------------------------------


def _check_weight(weight: Tensor, what: str) -> float:
    """Check a weight to be quantized; its largest magnitude. Read in row chunks, so that checking
    a memory-mapped 7B head (0.5 GB of bf16) costs no temporaries of its size."""
    if not isinstance(weight, torch.Tensor):
        raise InputError(f"{what}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise InputError(f"{what}: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise InputError(f"{what}: weight must be a floating-point tensor, got {weight.dtype}")
    if weight.numel() == 0:
        raise InputError(f"{what}: weight is empty, shape {tuple(weight.shape)}")
    N, K = weight.shape
    rows = max(1, (_CHUNK_ELEMS * 16) // K)
    peak = 0.0
    for r0 in range(0, N, rows):
        m = weight.detach()[r0 : r0 + rows].abs().amax().item()  # nan where the chunk holds one
        if not math.isfinite(m):  # (checked per chunk: Python's max() can drop a nan)
            raise InputError(f"{what}: weight contains inf or nan")
        peak = max(peak, m)
    return peak


def check_int4_weight(weight: Tensor, what: str) -> None:
    """A weight int4 can store: 2-D, finite, and within the range of its fp16 scales / biases."""
    peak = _check_weight(weight, what)
    if peak > 60000:
        raise InputError(f"{what}: weight values reach {peak:.4g}, beyond the fp16 scales of int4")


def check_int8_weight(weight: Tensor, what: str) -> None:
    """A weight int8 can store: 2-D, finite, and within the range of its fp16 scales (127 * 60000)."""
    peak = _check_weight(weight, what)
    if peak > 127 * 60000:
        raise InputError(f"{what}: weight values reach {peak:.4g}, beyond the fp16 scales of int8")


def check_group_size(in_features: int, group_size: int | None, allowed: tuple[int, ...] | None, what: str) -> int:
    """The group size to use for rows of `in_features` columns (None: the whole row)."""
    if group_size is None:
        return in_features
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise InputError(f"{what}: group_size must be a positive int, got {group_size!r}")
    if allowed is not None and group_size not in allowed:
        raise InputError(f"{what}: group_size {group_size} is not supported; use one of {allowed}")
    if in_features % group_size:
        raise InputError(
            f"{what}: group_size {group_size} does not divide in_features {in_features}; "
            f"pick a group size that divides the matrix width"
        )
    return group_size


# --- int8 -----------------------------------------------------------------------------------


def column_scales(weight: Tensor) -> Tensor:
    """fp16 (K,) per-input-column scales: each column's RMS over the rows, divided by their mean
    (all-zero columns get 1), rounded to fp16 and kept within its normal range."""
    _check_weight(weight, "column_scales")
    N, K = weight.shape
    sq = torch.zeros(K, dtype=torch.float64, device=weight.device)
    rows = max(1, _CHUNK_ELEMS // K)
    for r0 in range(0, N, rows):
        sq += weight.detach()[r0 : r0 + rows].double().square().sum(dim=0)
    rms = (sq / N).sqrt()
    rms = torch.where(rms > 0, rms, torch.ones_like(rms))
    return (rms / rms.mean()).clamp(2.0**-14, 2.0**14).to(torch.float16)


def _scaled_rows(weight: Tensor, r0: int, r1: int, col_scales: Tensor | None) -> Tensor:
    """Rows r0..r1 of the weight in fp32, divided by the column scales when given."""
    w = weight.detach()[r0:r1].float()
    return w if col_scales is None else w / col_scales.float()


def quantize_int8(
    weight: Tensor, group_size: int | None = None, col_scales: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Symmetric int8: (qweight int8 (N, K), scales float16 (N, K // group_size)).

    group_size None means one scale per output channel (row). Scale = absmax / 127, rounded to
    fp16 before the codes are computed (a code may then round to +-127 from just beyond it). With
    col_scales (K,), quantizes weight / col_scales (see the module docstring).
    """
    check_int8_weight(weight, "quantize_int8")
    N, K = weight.shape
    gs = check_group_size(K, group_size, None, "quantize_int8")
    G = K // gs
    q = torch.empty(N, G, gs, dtype=torch.int8, device=weight.device)
    scales = torch.empty(N, G, dtype=INT8_SCALE_DTYPE, device=weight.device)
    rows = max(1, _CHUNK_ELEMS // K)
    for r0 in range(0, N, rows):  # in row chunks: bounded temporaries for a 65536-row head
        w = _scaled_rows(weight, r0, r0 + rows, col_scales).reshape(-1, G, gs)
        s = (w.abs().amax(dim=-1) / 127.0).to(INT8_SCALE_DTYPE)  # (n, G)
        sf = s.float()
        inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
        q[r0 : r0 + rows] = torch.round(w * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        scales[r0 : r0 + rows] = s
    return q.reshape(N, K), scales


def dequantize_int8(
    qweight: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32, col_scales: Tensor | None = None
) -> Tensor:
    """(N, K) weight in `dtype` from int8 codes and (N, G) scales (G divides K), times the
    column scales when given."""
    N, K = qweight.shape
    G = scales.shape[-1]
    w = (qweight.float().reshape(N, G, K // G) * scales.float().reshape(N, G, 1)).reshape(N, K)
    if col_scales is not None:
        w = w * col_scales.float()
    return w.to(dtype)


# --- int4 -----------------------------------------------------------------------------------


def pack_int4(codes: Tensor) -> Tensor:
    """(N, K) codes in 0..15 (any integer dtype) -> (N, K // 2) uint8, column 2i in the low nibble."""
    if codes.dim() != 2 or codes.shape[-1] % 2:
        raise InputError(f"pack_int4: codes must be 2-D with an even number of columns, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """(N, K // 2) uint8 -> (N, K) uint8 codes in 0..15 (inverse of `pack_int4`)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise InputError(f"unpack_int4: packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def _int4_params(symmetric: bool, shrink: float, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor | None]:
    """fp16 scales (and biases) of groups whose range is shrunk by `shrink`.

    lo / hi: the groups' min and max (asymmetric) or signed absmax twice (symmetric)."""
    if symmetric:
        # The signed absmax maps to code 0 (-8); the other side gets the 7 positive steps, as in
        # ggml's Q4_0. This uses all 16 codes, unlike absmax / 7.
        return (-lo / 8.0 * shrink).to(INT4_SCALE_DTYPE), None
    mid = 0.5 * (lo + hi)
    lo_s = mid + (lo - mid) * shrink
    hi_s = mid + (hi - mid) * shrink
    return ((hi_s - lo_s) / 15.0).to(INT4_SCALE_DTYPE), lo_s.to(INT4_SCALE_DTYPE)


def _int4_position(w: Tensor, scales: Tensor, biases: Tensor | None) -> Tensor:
    """Each weight's position t on its group's code axis (code = clamp(round(t), 0, 15)), in fp32
    with one rounding per step, so that the native quantizer can reproduce it exactly:
    t = (w - bias) * (1 / scale), or w * (1 / scale) + 8 when symmetric (1 / 0 taken as 0)."""
    s = scales.float().unsqueeze(-1)
    inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))  # symmetric scales may be negative
    if biases is None:
        return w * inv + 8.0
    return (w - biases.float().unsqueeze(-1)) * inv


# Range shrink factors tried per group by `quantize_int4(search=True)`.
SEARCH_SHRINKS = (1.0, 0.95, 0.90, 0.85)
# More factors, refits and codebooks were compared and none halves the error (docs/quantization.md).


def quantize_int4(
    weight: Tensor,
    group_size: int = 32,
    symmetric: bool = False,
    search: bool = True,
    col_scales: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Grouped int4: (qweight uint8 (N, K//2), scales fp16 (N, G), biases fp16 (N, G) or None).

    Asymmetric (default): each group maps [min, max] onto codes 0..15. Symmetric: codes are
    centred on 8 and there are no biases. With `search`, each group also tries its range shrunk
    by the factors in SEARCH_SHRINKS (clipping the extreme values) and keeps the one with the
    smallest squared error (first one on ties); this changes only the stored numbers, not the
    format. Codes are clamp(round((w - bias) / scale), 0, 15) (symmetric: w / scale + 8), with
    the fp32 steps of `_int4_params` and `_int4_position`: the native quantizer
    (`rwkv_engine.kernels.native`, used by `Int4Linear.from_weight` on the CPU) gives the same
    bytes. With col_scales (K,), quantizes weight / col_scales (see the module docstring).
    """
    check_int4_weight(weight, "quantize_int4")
    N, K = weight.shape
    gs = check_group_size(K, group_size, INT4_GROUP_SIZES, "quantize_int4")
    G = K // gs
    codes = torch.empty(N, G, gs, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(N, G, dtype=INT4_SCALE_DTYPE, device=weight.device)
    biases = None if symmetric else torch.empty(N, G, dtype=INT4_SCALE_DTYPE, device=weight.device)
    shrinks = SEARCH_SHRINKS if search else (1.0,)
    rows = max(1, _CHUNK_ELEMS // K)
    for r0 in range(0, N, rows):
        w = _scaled_rows(weight, r0, r0 + rows, col_scales).reshape(-1, G, gs)
        if symmetric:
            idx = w.abs().argmax(dim=-1, keepdim=True)
            lo = hi = torch.gather(w, -1, idx).squeeze(-1)
        else:
            lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        best_err = best_s = best_b = None
        for shrink in shrinks:
            s, b = _int4_params(symmetric, shrink, lo, hi)
            if len(shrinks) > 1:
                # squared error in code units (exact in fp64), times scale^2
                t = _int4_position(w, s, b)
                err = t.round().clamp_(0, 15).sub_(t).double().square_().sum(dim=-1) * s.double().square()
                if best_err is None:
                    best_err, best_s, best_b = err, s, b
                    continue
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s = torch.where(better, s, best_s)
                if b is not None:
                    best_b = torch.where(better, b, best_b)
            else:
                best_s, best_b = s, b
        codes[r0 : r0 + rows] = _int4_position(w, best_s, best_b).round_().clamp_(0, 15).to(torch.uint8)
        scales[r0 : r0 + rows] = best_s
        if biases is not None:
            biases[r0 : r0 + rows] = best_b
    return pack_int4(codes.reshape(N, K)), scales, biases


def _int4_deq(q: Tensor, scales: Tensor, biases: Tensor | None) -> Tensor:
    s = scales.float().unsqueeze(-1)
    if biases is None:
        return (q - 8) * s
    return q * s + biases.float().unsqueeze(-1)


def dequantize_int4(
    qweight: Tensor,
    scales: Tensor,
    biases: Tensor | None,
    dtype: torch.dtype = torch.float32,
    col_scales: Tensor | None = None,
) -> Tensor:
    """(N, K) weight in `dtype` from packed int4 codes, (N, G) scales and optional biases, times
    the column scales when given."""
    q = unpack_int4(qweight)
    N, K = q.shape
    G = scales.shape[-1]
    w = _int4_deq(q.float().reshape(N, G, K // G), scales, biases).reshape(N, K)
    if col_scales is not None:
        w = w * col_scales.float()
    return w.to(dtype)


# --- activations, as the native integer kernels see them ------------------------------------

X_BLOCK = 64  # columns of x sharing one int16 step in the native int8 GEMV
X_BLOCK_INT8 = 32  # columns of x sharing one int8 step in the native int4 GEMV


def _round_blocks(x: Tensor, block: int, qmax: float) -> Tensor:
    """x [..., K], each full block of `block` columns rounded (nearest even) to integers of
    magnitude <= qmax in steps of the block's absmax / qmax, in the native kernels' fp32
    operations; a last partial block is left exact. fp32 result."""
    xf = x.float()
    K = xf.shape[-1]
    full = K // block * block
    if full == 0:
        return xf.clone()
    head = xf[..., :full].reshape(*xf.shape[:-1], full // block, block)
    amax = head.abs().amax(dim=-1, keepdim=True)
    # qmax / amax as one division (torch's `scalar / tensor` is a reciprocal times the scalar,
    # which differs in the last bit, and the rounding of x would flip at exact halves). Where it
    # overflows (amax 0 or below ~1e-37) the block rounds to zero; a NaN / inf gives NaN rows.
    inv = torch.full_like(amax, qmax) / amax
    inv = torch.where(torch.isinf(inv), torch.zeros_like(inv), inv)
    dx = amax / qmax
    q = torch.round(head * inv).clamp_(-qmax, qmax)
    out = xf.clone()
    out[..., :full] = (q * dx).reshape(*xf.shape[:-1], full)
    return out


def round_activations_int16(x: Tensor) -> Tensor:
    """x [..., K] as the native int8 GEMV uses it: each full block of 64 columns rounded to int16
    steps of absmax / 32767 (a last partial block is left exact); fp32 result.

    `F.linear(round_activations_int16(x), dequantize_int8(...))` is the reference that kernel
    matches to float rounding; the rounding itself changes outputs by about 1e-5 relative.
    """
    return _round_blocks(x, X_BLOCK, 32767.0)


def round_activations_int8(x: Tensor, block: int = X_BLOCK_INT8) -> Tensor:
    """x [..., K] as the native int4 GEMV uses it (part of the int4 format's decode math): each
    full block of 32 columns rounded to int8 steps of absmax / 127 (symmetric, nearest even; a
    last partial block is left exact); fp32 result. `block`: other widths (the K-quant prefill on
    the AVX2 level rounds per 256 columns, as ggml's Q8_K).

    `F.linear(round_activations_int8(x), dequantize_int4(...))` is the reference that kernel
    matches to float rounding; the rounding changes outputs by about 0.5% relative (random x),
    well below int4's own error (~8%).
    """
    return _round_blocks(x, block, 127.0)
