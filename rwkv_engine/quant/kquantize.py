"""ggml's K-quant blocks (Q4_K, Q5_K, Q6_K) written from a 16-bit or fp32 weight, with the scales
chosen by an error search: the bytes a GGUF file holds, so the K-quant kernels serve both.

    blocks = quantize_k(weight, "Q4_K")        # weight (N, K), K % 256 == 0 -> uint8 (N, K/256*144)
    w = ggml_quants.dequantize(blocks.reshape(-1), ggml_quants.BY_NAME["Q4_K"], (N, K))

A row of K columns is K/256 super-blocks of 256 consecutive values (byte layouts: quant/ggml_quants.py,
whose dequantizers read them and which `gguf.quants` matches bit for bit):

    Q4_K / Q5_K  8 sub-blocks of 32: w = d * sc_j * q - dmin * m_j, q in 0..15 (Q5_K: 0..31),
                 sc_j and m_j in 0..63, d and dmin fp16 per super-block        4.5 / 5.5 bits
    Q6_K         16 sub-blocks of 16: w = d * sc_j * (q - 32), q in 0..63, sc_j int8, d fp16   6.5625 bits

Below, a sub-block's step is d * sc_j and its offset dmin * m_j (0 for Q6_K): w = step * c - offset
for its codes c (Q6_K: c = q - 32, in -32..31). The search, for all super-blocks of a row chunk at once:

1. Each sub-block's own real step and offset: codes taken from its range at SCAN step sizes
   around range / (codes - 1) (Q6_K: the largest magnitude on code -32, the side with 32 steps),
   each followed by the least-squares step and offset for those codes (offset >= 0); the best,
   then LLOYD rounds of new codes and a new least-squares fit.
2. The super-block scales from the largest step (and offset): 63 units (Q6_K: -128) each, in fp16.
   Then each sub-block's integers (sc_j, m_j) from the two neighbours of its real step / d and
   offset / dmin (four pairs; Q6_K: two scales), the one with the least error for its current codes.
3. New codes for those scales, the sub-blocks' least-squares steps and offsets for them, d and
   dmin refitted by least squares to the integers and codes (in fp16), step 2's choice again:
   ROUNDS times, each super-block keeping its best round.
4. Each super-block keeps the better of that and the plain rounding (`search=False`: each
   sub-block's full range, every integer rounded to the nearest), so the search is never worse
   than no search, block by block.

llama.cpp's quantizer searches each sub-block's real step and offset in the same way (a scan of
step sizes with least-squares refits, and a weighted error) but then rounds sc_j, m_j and d, dmin
to the nearest and recomputes only the codes; steps 2-3 choose the stored integers and fp16
scales by the error they give. The error is the plain squared error of the weights (with
activations of similar size in every column it is what a matrix product's output error grows
with; the measure of quantize_int4's search as well). Errors of a candidate are computed from
per-sub-block sums of its codes (closed form), so a candidate costs one pass over its codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rwkv_engine.errors import InputError
from rwkv_engine.quant.ggml_quants import BY_NAME, QK_K, TYPES
from rwkv_engine.quant.primitives import _check_weight
from rwkv_engine.quant.primitives import column_scales as column_scales_rms

Tensor = torch.Tensor

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# Step sizes scanned per sub-block: range / (codes - 1 + delta) (Q6_K: largest magnitude / (32 + delta)).
SCAN = (-1.0, -0.6, -0.2, 0.2, 0.6, 1.0)
LLOYD = 2  # code / least-squares rounds on a sub-block's best scan candidate
ROUNDS = 2  # rounds of step 3
_CHUNK_BLOCKS = 1 << 10  # super-blocks per step: the candidate codes stay a few MB
_F16_MAX = 65504.0


@dataclass(frozen=True)
class _Format:
    """A K-quant's numbers: `sub` values per sub-block, codes in [cmin, cmax], integer sub-block
    scales in [smin, smax]; `offset`: whether sub-blocks have a 6-bit min (Q4_K, Q5_K)."""

    sub: int
    cmin: int
    cmax: int
    smin: int
    smax: int
    offset: bool


_FORMATS = {
    "Q4_K": _Format(32, 0, 15, 0, 63, True),
    "Q5_K": _Format(32, 0, 31, 0, 63, True),
    "Q6_K": _Format(16, -32, 31, -128, 127, False),
}


def block_bytes(type_name: str) -> int:
    """Bytes of one super-block of 256 values."""
    return TYPES[BY_NAME[type_name]][2]


def bits_per_weight(type_name: str) -> float:
    return 8.0 * block_bytes(type_name) / QK_K


def check_k_weight(weight: Tensor, type_name: str, what: str) -> None:
    """A weight the K-quant `type_name` can store: 2-D, finite, rows a multiple of 256 wide, and
    within the range of its fp16 super-block scales."""
    if type_name not in K_TYPES:
        raise InputError(f"{what}: unknown K-quant type {type_name!r}; known: {', '.join(K_TYPES)}")
    peak = _check_weight(weight, what)
    if weight.shape[1] % QK_K:
        raise InputError(f"{what}: {type_name} needs rows a multiple of {QK_K} wide, got shape {tuple(weight.shape)}")
    if peak > 1e6:
        raise InputError(f"{what}: weight values reach {peak:.4g}, beyond the fp16 scales of {type_name}")


def column_scales(weight: Tensor) -> Tensor:
    """fp16 (K,) column scales for K-quant blocks: the square root of primitives.column_scales
    (each column's RMS over the rows, normalized to mean 1).

    A K-quant of weight / c with x multiplied by c (KQuantLinear's col_scales) evens out columns of
    very different sizes; the square root beat the full RMS (q4's) for these blocks: relative
    weight error of Q4_K on heavy-tailed random matrices 0.091 without, 0.070 with the RMS, 0.060
    with its square root (exponents 0.4-0.75 within 5% of each other; no change on Gaussian ones).
    """
    return column_scales_rms(weight).float().sqrt().to(torch.float16)


def quantize_k(weight: Tensor, type_name: str, search: bool = True, col_scales: Tensor | None = None) -> Tensor:
    """uint8 (N, K / 256 * block_bytes) raw ggml blocks of `weight` (N, K) in `type_name`
    ("Q4_K", "Q5_K", "Q6_K"): row n's blocks are row n of the result, as a GGUF stores them.
    search=False: the plain rounding (step 4 of the module docstring). With col_scales (K,),
    the blocks hold weight / col_scales (see `column_scales`)."""
    check_k_weight(weight, type_name, f"quantize_k({type_name})")
    N, K = weight.shape
    fmt = _FORMATS[type_name]
    out = torch.empty(N * (K // QK_K), block_bytes(type_name), dtype=torch.uint8, device=weight.device)
    rows = max(1, _CHUNK_BLOCKS * QK_K // K)
    for r0 in range(0, N, rows):
        x = weight.detach()[r0 : r0 + rows].float()
        if col_scales is not None:
            x = x / col_scales.float()
        x = x.reshape(-1, QK_K // fmt.sub, fmt.sub)
        b0 = r0 * (K // QK_K)
        out[b0 : b0 + x.shape[0]] = _PACK[type_name](*_quantize(x, fmt, search))
    return out.reshape(N, -1)


def quantize_q4_k(weight: Tensor, search: bool = True) -> Tensor:
    """uint8 (N, K / 256 * 144): `quantize_k(weight, "Q4_K")`."""
    return quantize_k(weight, "Q4_K", search)


def quantize_q5_k(weight: Tensor, search: bool = True) -> Tensor:
    """uint8 (N, K / 256 * 176): `quantize_k(weight, "Q5_K")`."""
    return quantize_k(weight, "Q5_K", search)


def quantize_q6_k(weight: Tensor, search: bool = True) -> Tensor:
    """uint8 (N, K / 256 * 210): `quantize_k(weight, "Q6_K")`."""
    return quantize_k(weight, "Q6_K", search)


# --- the search -----------------------------------------------------------------------------
# Shapes: x [B, S, n] (B super-blocks of S sub-blocks of n values); per sub-block [B, S];
# per super-block [B]; scan candidates add a dimension C before n.


def _f16(x: Tensor) -> Tensor:
    """x rounded to fp16 (kept finite), back in fp32."""
    return x.clamp(-_F16_MAX, _F16_MAX).to(torch.float16).float()


def _div(a: Tensor, b: Tensor) -> Tensor:
    """a / b, 0 where b == 0."""
    nz = b != 0
    return torch.where(nz, a / torch.where(nz, b, torch.ones_like(b)), torch.zeros_like(a))


def _codes(x: Tensor, step: Tensor, off: Tensor, fmt: _Format) -> Tensor:
    """Nearest codes of x [..., n] for w = step * c - off (step, off [...]), clamped to the
    format's range (0 where the step is 0)."""
    inv = _div(torch.ones_like(step), step).unsqueeze(-1)
    t = (x + off.unsqueeze(-1)) * inv if fmt.offset else x * inv
    return t.round_().clamp_(fmt.cmin, fmt.cmax)


@dataclass
class _Sums:
    """Per sub-block sums over its n values x and codes c: enough for the error of any step
    and offset with those codes, and for their least-squares fit."""

    n: int
    sx: Tensor
    sxx: Tensor
    sc: Tensor = None  # sum c
    scc: Tensor = None  # sum c^2
    scx: Tensor = None  # sum c x

    @classmethod
    def of(cls, x: Tensor, c: Tensor | None = None) -> _Sums:
        s = cls(x.shape[-1], x.sum(-1), x.square().sum(-1))
        return s.with_codes(x, c) if c is not None else s

    def with_codes(self, x: Tensor, c: Tensor) -> _Sums:
        """These x sums with the code sums of c ([..., n], or candidates [..., C, n])."""
        if c.dim() == x.dim():
            scx = (c * x).sum(-1)
        else:
            scx = torch.einsum("...cn,...n->...c", c, x)
            return _Sums(self.n, self.sx.unsqueeze(-1), self.sxx.unsqueeze(-1), c.sum(-1), c.square().sum(-1), scx)
        return _Sums(self.n, self.sx, self.sxx, c.sum(-1), c.square().sum(-1), scx)

    def error(self, step: Tensor, off: Tensor) -> Tensor:
        """sum (step * c - off - x)^2 for these codes."""
        return (
            step * step * self.scc
            - 2 * step * off * self.sc
            + self.n * off * off
            - 2 * step * self.scx
            + 2 * off * self.sx
            + self.sxx
        )

    def fit(self, offset: bool) -> tuple[Tensor, Tensor]:
        """Least-squares (step, off) for these codes; off >= 0 (else 0 and step alone), and 0
        without an offset."""
        step0 = _div(self.scx, self.scc)
        if not offset:
            return step0, torch.zeros_like(step0)
        det = self.n * self.scc - self.sc * self.sc
        step = _div(self.n * self.scx - self.sc * self.sx, det)
        off = -_div(self.sx * self.scc - self.sc * self.scx, det)
        neg = (off < 0) | (det <= 0)
        return torch.where(neg, step0, step), torch.where(neg, torch.zeros_like(off), off)


def _best(err: Tensor, *values: Tensor) -> tuple[Tensor, ...]:
    """(err, *values) at each row's least error along the last dimension."""
    i = err.argmin(-1, keepdim=True)
    return tuple(torch.gather(v, -1, i).squeeze(-1) for v in (err, *values))


def _keep(better: Tensor, new: tuple[Tensor, ...], old: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Per super-block (better [B]), the new tensors where better, else the old ones."""
    return tuple(torch.where(better.view(-1, *([1] * (a.dim() - 1))), a, b) for a, b in zip(new, old))


def _plain_sub(x: Tensor, fmt: _Format) -> tuple[Tensor, Tensor]:
    """Each sub-block's full range as (step, off): [min(lo, 0), hi] on codes 0..cmax, or (Q6_K)
    the value of largest magnitude on code -32."""
    if fmt.offset:
        lo = x.amin(-1).clamp(max=0.0)
        return (x.amax(-1) - lo) / fmt.cmax, -lo
    ext = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)
    return ext / fmt.cmin, torch.zeros_like(ext)


def _fit_sub(x: Tensor, sums: _Sums, plain: tuple[Tensor, Tensor], fmt: _Format) -> tuple[Tensor, Tensor, Tensor]:
    """Step 1: each sub-block's real (step, off) and its codes, from its plain (step, off)."""
    step0, off0 = plain
    span = fmt.cmax if fmt.offset else -fmt.cmin
    scale = span / (span + torch.tensor(SCAN, dtype=x.dtype, device=x.device))  # [C]
    steps = step0.unsqueeze(-1) * scale  # [B, S, C]
    c = _codes(x.unsqueeze(-2), steps, off0.unsqueeze(-1).expand_as(steps), fmt)  # [B, S, C, n]
    cs = sums.with_codes(x, c)
    step, off = cs.fit(fmt.offset)
    _, step, off = _best(cs.error(step, off), step, off)
    c = _codes(x, step, off, fmt)
    for _ in range(LLOYD):
        cs = sums.with_codes(x, c)
        err = cs.error(step, off)
        step2, off2 = cs.fit(fmt.offset)
        better = cs.error(step2, off2) < err
        step, off = torch.where(better, step2, step), torch.where(better, off2, off)
        c = _codes(x, step, off, fmt)
    return step, off, c


def _super_scales(step: Tensor, off: Tensor, fmt: _Format) -> tuple[Tensor, Tensor]:
    """(d, dmin) [B] in fp16 that put the largest step and offset at 63 (Q6_K: the step of
    largest magnitude at -128)."""
    if fmt.offset:
        return _f16(step.amax(-1) / fmt.smax), _f16(off.amax(-1) / 63)
    big = torch.gather(step, -1, step.abs().argmax(-1, keepdim=True)).squeeze(-1)
    return _f16(big / fmt.smin), torch.zeros_like(big)


def _nearest_ints(step: Tensor, off: Tensor, d: Tensor, dmin: Tensor, fmt: _Format) -> tuple[Tensor, Tensor]:
    sc = _div(step, d.unsqueeze(-1)).round().clamp(fmt.smin, fmt.smax)
    return sc, _div(off, dmin.unsqueeze(-1)).round().clamp(0, 63)


def _pick_ints(step, off, d, dmin, cs: _Sums, fmt: _Format) -> tuple[Tensor, Tensor]:
    """Step 2: per sub-block the integers (sc, m) among the floor / ceil of step / d and off / dmin
    with the least error for the codes summed in cs."""
    sc0 = _div(step, d.unsqueeze(-1)).floor()
    m0 = _div(off, dmin.unsqueeze(-1)).floor()
    pairs = (0, 1) if fmt.offset else (0,)
    sc = torch.stack([(sc0 + i).clamp(fmt.smin, fmt.smax) for i in (0, 1) for _ in pairs], -1)
    m = torch.stack([(m0 + j).clamp(0, 63) for _ in (0, 1) for j in pairs], -1)  # [B, S, P]
    err = _Sums(cs.n, *(t.unsqueeze(-1) for t in (cs.sx, cs.sxx, cs.sc, cs.scc, cs.scx))).error(
        d.view(-1, 1, 1) * sc, dmin.view(-1, 1, 1) * m
    )
    _, sc, m = _best(err, sc, m)
    return sc, m


def _refit_super(sc: Tensor, m: Tensor, cs: _Sums, fmt: _Format) -> tuple[Tensor, Tensor]:
    """Least-squares (d, dmin) [B] of x ~ d * sc * c - dmin * m given the integers and codes, in fp16."""
    saa = (sc * sc * cs.scc).sum(-1)
    sbb = (m * m).sum(-1) * cs.n
    sab = (sc * m * cs.sc).sum(-1)
    sax = (sc * cs.scx).sum(-1)
    sbx = (m * cs.sx).sum(-1)
    det = saa * sbb - sab * sab
    d = _div(sax * sbb - sab * sbx, det)
    dmin = _div(sab * sax - saa * sbx, det)
    alone = det <= 0  # no mins (Q6_K, or all m zero): d alone
    d = torch.where(alone, _div(sax, saa), d)
    dmin = torch.where(alone, torch.zeros_like(dmin), dmin)
    if fmt.offset:
        d, dmin = d.clamp(min=0), dmin.clamp(min=0)
    return _f16(d), _f16(dmin)


def _error(x: Tensor, c: Tensor, d: Tensor, dmin: Tensor, sc: Tensor, m: Tensor) -> Tensor:
    """Squared error per super-block [B] of the stored numbers, computed directly."""
    st, of = d.view(-1, 1, 1) * sc.unsqueeze(-1), dmin.view(-1, 1, 1) * m.unsqueeze(-1)
    return (st * c - of - x).square_().sum((1, 2))


def _quantize(x: Tensor, fmt: _Format, search: bool) -> tuple[Tensor, ...]:
    """(d, dmin [B], sc, m [B, S], codes [B, S, n]) for super-blocks x [B, S, n]."""
    step, off = _plain_sub(x, fmt)
    d, dmin = _super_scales(step, off, fmt)
    sc, m = _nearest_ints(step, off, d, dmin, fmt)
    c = _codes(x, d.unsqueeze(-1) * sc, dmin.unsqueeze(-1) * m, fmt)
    plain = (d, dmin, sc, m, c)
    if not search:
        return plain
    sums = _Sums.of(x)
    step, off, c = _fit_sub(x, sums, (step, off), fmt)
    d, dmin = _super_scales(step, off, fmt)
    cs = sums.with_codes(x, c)
    best = best_err = None
    for r in range(ROUNDS + 1):
        if r:
            step, off = cs.fit(fmt.offset)
            d, dmin = _refit_super(sc, m, cs, fmt)
        sc, m = _pick_ints(step, off, d, dmin, cs, fmt)
        c = _codes(x, d.unsqueeze(-1) * sc, dmin.unsqueeze(-1) * m, fmt)
        cs = sums.with_codes(x, c)
        err = cs.error(d.unsqueeze(-1) * sc, dmin.unsqueeze(-1) * m).sum(-1)
        if best is None:
            best, best_err = (d, dmin, sc, m, c), err
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = _keep(better, (d, dmin, sc, m, c), best)
    # the errors above are from sums (closed form); the last word is the direct error
    return _keep(_error(x, plain[4], *plain[:4]) <= _error(x, best[4], *best[:4]), plain, best)


# --- packing into ggml's bytes --------------------------------------------------------------


def _f16_bytes(v: Tensor) -> Tensor:
    """fp32 [B] (values already fp16-exact) -> little-endian fp16 bytes [B, 2]."""
    return v.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _pack_k_scales(sc: Tensor, m: Tensor) -> Tensor:
    """8 six-bit scales and mins [B, 8] -> ggml's 12 bytes [B, 12]: bytes 0-3 the low 6 bits of
    scales 0-3 (top 2 bits: scales 4-7's high 2 bits), 4-7 the same for the mins, 8-11 the low
    nibbles of scales 4-7 and (high nibble) of mins 4-7."""
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    return torch.cat(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ],
        dim=1,
    )


def _nibble_pairs(q: Tensor) -> Tensor:
    """Codes [B, 256] (low 4 bits used) -> [B, 128]: per 64 values, byte l holds value l in its
    low nibble and value 32 + l in its high nibble."""
    q = q.to(torch.uint8).reshape(-1, 4, 2, 32) & 0x0F
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _pack_q4_k(d, dmin, sc, m, c) -> Tensor:
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), _nibble_pairs(c)], dim=1)


def _pack_q5_k(d, dmin, sc, m, c) -> Tensor:
    q = c.to(torch.uint8)  # [B, 8, 32]
    hi = (q >> 4).to(torch.int32) << torch.arange(8, dtype=torch.int32, device=q.device).view(1, 8, 1)
    qh = hi.sum(1).to(torch.uint8)  # [B, 32]: bit j of byte l is the fifth bit of value 32 j + l
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qh, _nibble_pairs(q)], dim=1)


def _pack_q6_k(d, dmin, sc, m, c) -> Tensor:
    q = (c + 32).to(torch.uint8).reshape(-1, 2, 4, 32)  # per 128 values: 4 runs of 32
    lo, hi = q & 0x0F, q >> 4
    ql = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(-1, 128)  # runs 0, 1 low; 2, 3 high
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=1)


_PACK = {"Q4_K": _pack_q4_k, "Q5_K": _pack_q5_k, "Q6_K": _pack_q6_k}
