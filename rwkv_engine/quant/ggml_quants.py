"""ggml's tensor types: block layouts and dequantization, shared by the GGUF and rwkv.cpp readers
(loading/) and by KQuantLinear (kquant_linear.py: the K-quant blocks run as they are stored).

A quantized ggml row is a run of blocks; each block codes `block_size` consecutive values of the
row in `type_size` bytes (little-endian). The layouts (ggml-common.h; the `gguf` package's
`gguf.quants` is their Python twin, and tests check we match it bit for bit):

    Q4_0  32 values, 18 bytes: fp16 d, 16 bytes of nibbles    w = d * (q - 8)
    Q4_1  32 values, 20 bytes: fp16 d, fp16 m, 16 bytes        w = d * q + m
    Q5_0  32 values, 22 bytes: fp16 d, u32 high bits, 16 bytes w = d * (q - 16)
    Q5_1  32 values, 24 bytes: fp16 d, fp16 m, u32 qh, 16 B    w = d * q + m
    Q8_0  32 values, 34 bytes: fp16 d, 32 int8                 w = d * q  (our int8 layout at group 32)
    Q4_K / Q5_K  256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales / mins (8 of 32
          values each), [Q5_K: 32 bytes of fifth bits], 128 bytes of nibbles: w = d*sc*q - dmin*m
    Q6_K  256 values, 210 bytes: 128 B low nibbles, 64 B high 2 bits, 16 int8 scales, fp16 d:
          w = d * scale * (q - 32), one scale per 16 values

In a nibble block the low nibbles of bytes 0..15 are values 0..15 and the high nibbles values
16..31 (K-quants: per 64 values, low nibbles of 32 bytes then their high nibbles).

Every function here takes the raw blocks (uint8 [n_blocks, type_size]) and returns fp32
[n_blocks, block_size], computed in the same order as gguf.quants (so the results are equal).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

QK_K = 256

# ggml type id -> (name, values per block, bytes per block); the ids are ggml's (and GGUF's).
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", QK_K, 144),
    13: ("Q5_K", QK_K, 176),
    14: ("Q6_K", QK_K, 210),
    30: ("BF16", 1, 2),
}
BY_NAME = {name: tid for tid, (name, _, _) in TYPES.items()}
QUANTIZED = frozenset(n for n in BY_NAME if n not in ("F32", "F16", "BF16"))
KQUANT = ("Q4_K", "Q5_K", "Q6_K")  # run from their blocks (quant/kquant_linear.py)
# Byte offsets of a quantized block's fp16 fields (its scale d, and the offset m / dmin where the
# type has one): every value of the block is a finite multiple or sum of them.
_FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def type_name(type_id: int) -> str:
    return TYPES[type_id][0] if type_id in TYPES else f"ggml type {type_id}"


def nbytes(type_id: int, numel: int) -> int:
    """Bytes of `numel` values of a type (numel a multiple of its block size)."""
    _, bs, ts = TYPES[type_id]
    return numel // bs * ts


def _f16(b: Tensor) -> Tensor:
    """fp16 fields [n, 2] (uint8) -> fp32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor, group: int) -> Tensor:
    """Bytes [n, k * group] -> codes [n, k, 2 * group]: per group, the low nibbles then the high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(n, -1, 2 * group)


def _bits(b: Tensor, count: int) -> Tensor:
    """Bytes [n, m] -> bits [n, count, m]: bit j of every byte, j = 0..count-1."""
    shifts = torch.arange(count, dtype=torch.uint8).view(1, count, 1)
    return (b.unsqueeze(1) >> shifts) & 1


def _q4_0(b: Tensor) -> Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: Tensor) -> Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).float()
    return d * q + m


def _high_bits_32(qh: Tensor) -> Tensor:
    """A u32 little-endian [n, 4] -> its 32 bits [n, 32], bit i = value i."""
    return _bits(qh, 8).permute(0, 2, 1).reshape(qh.shape[0], 32)


def _q5_0(b: Tensor) -> Tensor:
    d = _f16(b[:, :2])
    hi = _high_bits_32(b[:, 2:6])
    lo = _nibbles(b[:, 6:], 16).reshape(b.shape[0], 32)
    q = (lo | (hi << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: Tensor) -> Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    hi = _high_bits_32(b[:, 4:8])
    lo = _nibbles(b[:, 8:], 16).reshape(b.shape[0], 32)
    return d * (lo | (hi << 4)).float() + m


def _q8_0(b: Tensor) -> Tensor:
    d = _f16(b[:, :2])
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def _k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K: 12 bytes [n, 12] -> 8 six-bit scales and 8 six-bit mins, each [n, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    ds = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, -1, 32).float()
    return (ds * q - dm).reshape(n, QK_K)


def _q5_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    ds = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    hi = _bits(b[:, 16:48], 8).reshape(n, 8, 32)  # bit j of the 32 bytes: the fifth bits of sub-block j
    lo = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    q = (lo | (hi << 4)).float()
    return (ds * q - dm).reshape(n, QK_K)


def _q6_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    ds = (d * sc.contiguous().view(torch.int8).float()).reshape(n, QK_K // 16, 1)
    lo = _nibbles(ql, 64).reshape(n, -1, 32)  # per 128 values: 64 bytes' low nibbles then high
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    hi = ((qh.reshape(n, -1, 1, 32) >> shifts) & 3).reshape(n, -1, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, -1).float()
    return (ds * q).reshape(n, QK_K)


_DEQUANT = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}

_CHUNK_BLOCKS = 1 << 14  # blocks per step: keeps the temporaries small


def dequantize(data: Tensor, type_id: int, shape: tuple[int, ...]) -> Tensor:
    """fp32 tensor of `shape` (PyTorch order, rows last-axis-contiguous) from the raw bytes of a
    ggml tensor (uint8, 1-D)."""
    name, bs, ts = TYPES[type_id]
    numel = 1
    for s in shape:
        numel *= s
    if name == "F32":
        return data.view(torch.float32).reshape(shape)
    if name == "F16":
        return data.view(torch.float16).float().reshape(shape)
    if name == "BF16":
        return data.view(torch.bfloat16).float().reshape(shape)
    blocks = data.reshape(-1, ts)
    out = torch.empty(blocks.shape[0], bs, dtype=torch.float32)
    fn = _DEQUANT[name]
    for i in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[i : i + _CHUNK_BLOCKS] = fn(blocks[i : i + _CHUNK_BLOCKS])
    return out.reshape(shape)


def scale_blocks(blocks: Tensor, type_id: int, factor: float, what: str) -> Tensor:
    """A copy of K-quant blocks [N, bytes] whose values are `factor` (a power of two) times theirs:
    the fp16 block scales multiplied. InputError where an fp16 field would not be exact (a
    division into fp16's subnormals, an overflow)."""
    from ..errors import InputError

    name, _, ts = TYPES[type_id]
    out = blocks.reshape(-1, ts).clone()
    for o in _FP16_FIELDS[name]:
        field = out[:, o : o + 2].contiguous().view(torch.float16)
        scaled = (field.float() * factor).half()
        if not torch.equal(scaled.float(), field.float() * factor):
            raise InputError(
                f"{what}: the {name} block scales times {factor:g} are not exact in fp16; "
                "load this file with another --dtype (fp16 halves the weights of deep blocks)"
            )
        out[:, o : o + 2] = scaled.view(torch.uint8)
    return out.reshape(blocks.shape)


def block_scales(blocks: Tensor, type_id: int) -> Tensor:
    """The fp16 fields (d, and m / dmin where the type has one) of quantized blocks [N, bytes], as
    fp16 [blocks, fields]: every value of a block is a finite multiple (or sum) of them (the codes
    are integers), so they are what a NaN / infinity check of the matrix reads."""
    name, _, ts = TYPES[type_id]
    rows = blocks.reshape(-1, ts)
    return torch.stack([rows[:, o : o + 2].contiguous().view(torch.float16)[:, 0] for o in _FP16_FIELDS[name]], 1)


def q8_0_split(data: Tensor, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """A Q8_0 matrix [N, K] as our int8 layout at group 32: (qweight int8 [N, K], scales fp16 [N, K/32]),
    the same numbers, no re-quantization."""
    N, K = shape
    blocks = data.reshape(N, K // 32, 34)
    scales = blocks[..., :2].contiguous().view(torch.float16).reshape(N, K // 32)
    qweight = blocks[..., 2:].contiguous().view(torch.int8).reshape(N, K)
    return qweight, scales
