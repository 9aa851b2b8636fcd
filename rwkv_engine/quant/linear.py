"""Linear modules over quantized (or 16-bit) weights, drop-in replacements for `nn.Linear(bias=False)`.

    layer = Int4Linear.from_linear(linear, group_size=32)
    y = layer(x)            # x [..., in_features] fp32 / bf16 / fp16 -> y [..., out_features], x.dtype

Every module keeps its weight as buffers (`qweight`, `scales`, `biases`, `col_scales`), so it
saves and loads with `state_dict()` / safetensors like any module; shapes alone give the sizes
and group size. `col_scales` (fp16, one per input column; see quant.primitives) are divided out
of the weight before quantizing and multiplied into x at run time (ones: no column scaling).
A module built with `Int4Linear(in_features, out_features, group_size)` holds zero buffers of the
right shapes, ready for `load_state_dict` (also on the meta device with `assign=True`).

`forward` picks one of three paths:

* decode, x on the CPU with at most `GEMV_MAX_ROWS` rows and the native kernels available
  (`rwkv_engine.kernels.native`): one pass over the packed weight (memory-bound GEMV);
* prefill, x on the CPU with more rows: the weight is dequantized `tile_rows` rows at a time
  into one reused dense buffer and multiplied with the GEMM (compute-bound), in bf16 where x is
  bf16 and the CPU has bf16 matrix instructions (AVX512-BF16 / AMX), else in fp32
  (`prefill_dtype`);
* anywhere else (another device, no native kernels): dequantize the whole weight to x.dtype and
  `F.linear`, the plain reference.

The native GEMV of int8 weights rounds x to int16 per 64 columns before an exact integer dot
product; the result differs from the reference by about 1e-5 relative (more when a few
activations are much larger than the rest of their 64 columns), well below bf16 rounding. The
int4 GEMV rounds x to int8 per 32 columns (about 0.5% relative, against int4's ~8%), and that
rounding is part of the int4 decode's math on the CPU: `Int4Linear` applies it on the plain CPU
path too (no native kernels), for up to `GEMV_MAX_ROWS` rows (primitives.round_activations_int8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rwkv_engine.errors import InputError
from rwkv_engine.kernels import native
from rwkv_engine.kernels.native import GEMV_MAX_ROWS
from rwkv_engine.quant import primitives as P

Tensor = torch.Tensor

# Weight rows dequantized per GEMM call in prefill: PREFILL_TILE, or fewer where that many rows would
# take more than PREFILL_TILE_BYTES (the FFN's value matrix, 8192 columns: 256 rows of bf16). The
# tile buffer lives through the whole GEMM of a prefill piece, beside its activations; at 1024 rows
# of 8192 bf16 it was 16 MB of the piece's peak (Q6_K 1.5B shape, Zen 4).
PREFILL_TILE = 1024
PREFILL_TILE_BYTES = 4 << 20


def tile_rows(K: int, dtype: torch.dtype) -> int:
    """Weight rows per tile of a prefill GEMM over K columns of `dtype` (a multiple of 64)."""
    return max(64, min(PREFILL_TILE, PREFILL_TILE_BYTES // (K * dtype.itemsize) // 64 * 64))


# torch's 16-bit CPU GEMM (oneDNN) builds a kernel for every new row count: 4-8 ms per weight shape
# the first time against under 1 ms after (768 x 3072, bf16, AMX). Prompt pieces come in every
# length, so a 16-bit prefill GEMM's rows are padded with zeros up to a multiple of GEMM_ROW_STEP:
# 16 row counts up to a 256-token piece, built once (the server builds them in its warm-up, see
# `warm_gemms`). The padding costs at most 15 rows of work; the real rows' results do not change.
GEMM_ROW_STEP = 16

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """dtype in which a GEMM with 16-bit activations / weights of `dtype` runs on `device`: the
    16-bit type itself where the device has matrix instructions for it (CUDA; on the CPU
    AVX512-BF16 / AMX for bf16, AMX-FP16 for fp16), else fp32 (on AVX2 machines torch's bf16 /
    fp16 GEMMs run at 7-25 GFLOP/s against 45-95 for fp32). The loader's `dtype="auto"` uses
    the same rule for the activations of quantized models."""
    if dtype not in (torch.bfloat16, torch.float16):
        return torch.float32
    kind = torch.device(device).type
    if kind != "cpu":
        return dtype
    if dtype == torch.bfloat16 and _cpu_has("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        return torch.bfloat16
    if dtype == torch.float16 and _cpu_has("_is_amx_fp16_supported"):
        return torch.float16
    return torch.float32


def prefill_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the CPU GEMM for 16-bit activations / weights of `dtype` in prefill (`compute_dtype`)."""
    return compute_dtype(dtype, "cpu")


_CPU_FLAGS: dict[str, bool] = {}


def _cpu_has(*checks: str) -> bool:
    """Whether any of torch.cpu's `_is_..._supported()` checks is true (cached); none is where
    RWKV_ENGINE_ISA=avx2 runs the process as on an AVX2-only CPU (kernels/native: A/B runs of
    the AVX2 paths on an AVX-512 machine, bench_peers.py --isa avx2)."""
    import os

    if os.environ.get("RWKV_ENGINE_ISA") == "avx2":
        return False
    for name in checks:
        if name not in _CPU_FLAGS:
            _CPU_FLAGS[name] = bool(getattr(torch.cpu, name, lambda: False)())
        if _CPU_FLAGS[name]:
            return True
    return False


def _native_quantizer(weight: Tensor):
    """The native module when it can quantize `weight` (a 2-D float tensor on the CPU), else None."""
    if (
        not isinstance(weight, torch.Tensor)
        or weight.device.type != "cpu"
        or weight.dim() != 2
        or weight.dtype not in _FLOAT_DTYPES
        or weight.numel() == 0
    ):
        return None
    return native.load()


def _padded_rows(M: int) -> int:
    """M rounded up to a multiple of GEMM_ROW_STEP."""
    return -(-M // GEMM_ROW_STEP) * GEMM_ROW_STEP


def cpu_gemm(x2: Tensor, w: Tensor) -> Tensor:
    """F.linear(x2, w) for x2 [M, K] and w [N, K] of one dtype on the CPU, with a 16-bit GEMM's
    rows padded up to a multiple of GEMM_ROW_STEP (see there)."""
    M, K = x2.shape
    if x2.dtype == torch.float32 or M % GEMM_ROW_STEP == 0:
        return F.linear(x2, w)
    xp = x2.new_zeros(_padded_rows(M), K)
    xp[:M] = x2
    return F.linear(xp, w)[:M]


def warm_gemms(model: nn.Module, max_rows: int) -> int:
    """Build the 16-bit GEMM kernels of every weight shape of `model`'s CPU DenseLinears (the output
    head aside: it runs with many rows only for every-position logits) for every padded row count
    from GEMV_MAX_ROWS + 1 to max_rows, so the first prompts of each length do not pay for them.
    Returns the number of (shape, rows) pairs run."""
    shapes = {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(m, DenseLinear) and w is not None and w.device.type == "cpu" and "head" not in name:
            if w.dtype in (torch.bfloat16, torch.float16) and prefill_dtype(w.dtype) == w.dtype:
                shapes.setdefault((tuple(w.shape), w.dtype), w)
    first = _padded_rows(GEMV_MAX_ROWS + 1)
    n = 0
    with torch.no_grad():
        for w in shapes.values():
            for rows in range(first, max_rows + 1, GEMM_ROW_STEP):
                cpu_gemm(torch.zeros(rows, w.shape[1], dtype=w.dtype), w)
                n += 1
    return n


def _tiled_linear(x2: Tensor, n_rows: int, ct: torch.dtype, tile_fn) -> Tensor:
    """x2 [M, K] @ W^T for a weight produced `tile_rows` rows at a time by
    tile_fn(r0, r1, out) into a reused [rows, K] buffer of dtype ct; result in x2.dtype."""
    xc = x2.to(ct)
    step = tile_rows(x2.shape[1], ct)
    buf = torch.empty(min(n_rows, step), x2.shape[1], dtype=ct)
    parts = []
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        parts.append(cpu_gemm(xc, tile_fn(r0, r1, buf[: r1 - r0])))
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y.to(x2.dtype)


def _check_input(x: Tensor, in_features: int, who: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{who}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise InputError(f"{who}: input must have shape [..., {in_features}], got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise InputError(f"{who}: input dtype must be float32, bfloat16 or float16, got {x.dtype}")


class QuantLinear(nn.Module):
    """What every quantized linear shares, on the CPU (`_QuantLinearBase`) and on CUDA
    (quant/cuda.py): the input check, the [..., K] -> [..., N] reshaping, the empty batch, and
    how it describes itself. A subclass holds `scales` [N, G] and computes `_matmul`."""

    in_features: int
    out_features: int

    def forward(self, x: Tensor) -> Tensor:
        _check_input(x, self.in_features, type(self).__name__)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        return self._matmul(x2).reshape(*lead, self.out_features)

    def _matmul(self, x2: Tensor) -> Tensor:
        """x2 [M, K] (M >= 1) -> [M, N] in x2's dtype."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]


class _QuantLinearBase(QuantLinear):
    """The CPU's quantized linears: the native kernels, else the dequantized matrix; subclasses
    define the weight format."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (out_features, in_features) weight this module multiplies by, in `dtype`."""
        raise NotImplementedError

    def _gemv(self, ops, x2: Tensor) -> Tensor:  # native one-pass kernel, x2 [M, K] contiguous
        raise NotImplementedError

    def _dequant_rows(self, ops, r0: int, r1: int, dtype: torch.dtype, out: Tensor) -> Tensor:
        raise NotImplementedError

    def _native_ok(self) -> bool:
        return True

    def _matmul(self, x2: Tensor) -> Tensor:
        ops = native.load() if x2.device.type == "cpu" and self.qweight.device.type == "cpu" else None
        if ops is not None and self._native_ok():
            x2 = x2.contiguous()
            return self._gemv(ops, x2) if x2.shape[0] <= GEMV_MAX_ROWS else self._prefill(ops, x2)
        return self._reference(x2)

    def _reference(self, x2: Tensor) -> Tensor:
        """The plain path: the dequantized weight in x's dtype and `F.linear`."""
        return F.linear(x2, self.dequantize(x2.dtype))

    def _prefill(self, ops, x2: Tensor) -> Tensor:
        """x2 [M, K] -> [M, N]: dequantize `tile_rows` weight rows at a time into one reused
        buffer and multiply each tile with the GEMM (fp32 x stays fp32)."""
        ct = torch.float32 if x2.dtype == torch.float32 else prefill_dtype(x2.dtype)
        c = self.col_scales
        if bool((c == 1).all()):  # (a GGUF's K-quants: no column scales) x as it is, no fp32 copies
            xs = x2
        else:  # the tiles hold weight / col_scales; one fp32 copy of x, scaled in place
            xs = x2.float() * c.float() if x2.dtype == torch.float32 else x2.float().mul_(c.float())
        y = _tiled_linear(
            xs.to(ct), self.out_features, ct, lambda r0, r1, out: self._dequant_rows(ops, r0, r1, ct, out)
        )
        return y.to(x2.dtype)


class Int8Linear(_QuantLinearBase):
    """int8 weight with fp16 scales per output channel (group_size None) or per group of columns.

    Buffers: qweight int8 (N, K), scales float16 (N, K // group_size), col_scales float16 (K,).
    """

    def __init__(self, in_features: int, out_features: int, group_size: int | None = None, device=None):
        super().__init__()
        gs = P.check_group_size(in_features, group_size, None, "Int8Linear")
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer(
            "scales", torch.zeros(out_features, in_features // gs, dtype=P.INT8_SCALE_DTYPE, device=device)
        )
        self.register_buffer("col_scales", torch.ones(in_features, dtype=torch.float16, device=device))

    @classmethod
    def from_weight(cls, weight: Tensor, group_size: int | None = None, col_scale: bool = True) -> Int8Linear:
        """Quantize `weight` (N, K): natively on the CPU on all threads (the same bytes as
        primitives.quantize_int8, much faster), else with the primitives."""
        ops = _native_quantizer(weight)
        if ops is not None:
            P.check_int8_weight(weight, "Int8Linear")
            gs = P.check_group_size(weight.shape[1], group_size, None, "Int8Linear")
            w = weight.detach().contiguous()
            c = ops.column_scales(w) if col_scale else None
            q, s = ops.quantize_q8(w, gs, c)
        else:
            c = P.column_scales(weight) if col_scale else None
            q, s = P.quantize_int8(weight, group_size, c)
        m = cls(weight.shape[1], weight.shape[0], group_size, device="meta")
        m.qweight, m.scales = q, s
        m.col_scales = c if c is not None else torch.ones(weight.shape[1], dtype=torch.float16, device=q.device)
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int | None = None, col_scale: bool = True) -> Int8Linear:
        _check_no_bias(linear)
        return cls.from_weight(linear.weight, group_size, col_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return P.dequantize_int8(self.qweight, self.scales, dtype, self.col_scales)

    def _native_ok(self) -> bool:
        G = self.scales.shape[1]
        return self.scales.dtype == P.INT8_SCALE_DTYPE and (G == 1 or (self.in_features // G) % 32 == 0)

    def _gemv(self, ops, x2: Tensor) -> Tensor:
        return ops.gemv_q8(x2, self.qweight, self.scales, self.col_scales)

    def _dequant_rows(self, ops, r0: int, r1: int, dtype: torch.dtype, out: Tensor) -> Tensor:
        return ops.dequant_q8(self.qweight, self.scales, r0, r1, dtype, out)


class Int4Linear(_QuantLinearBase):
    """int4 weight, groups of 32 / 64 / 128 columns, fp16 scales and biases: w = code * scale + bias.

    Buffers: qweight uint8 (N, K // 2) (column 2i in the low nibble of byte i), scales and biases
    float16 (N, K // group_size), col_scales float16 (K,). See rwkv_engine.quant.primitives.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int = 32, device=None):
        super().__init__()
        gs = P.check_group_size(in_features, group_size, P.INT4_GROUP_SIZES, "Int4Linear")
        self.in_features = in_features
        self.out_features = out_features
        G = in_features // gs
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(out_features, G, dtype=P.INT4_SCALE_DTYPE, device=device))
        self.register_buffer("biases", torch.zeros(out_features, G, dtype=P.INT4_SCALE_DTYPE, device=device))
        self.register_buffer("col_scales", torch.ones(in_features, dtype=torch.float16, device=device))

    @classmethod
    def from_weight(
        cls, weight: Tensor, group_size: int = 32, search: bool = True, col_scale: bool = True
    ) -> Int4Linear:
        """Quantize `weight` (N, K): natively on the CPU (same bytes, ~4x faster), else with
        primitives.quantize_int4."""
        ops = _native_quantizer(weight)
        if ops is not None and group_size in P.INT4_GROUP_SIZES and weight.shape[1] % group_size == 0:
            P.check_int4_weight(weight, "Int4Linear")
            shrinks = list(P.SEARCH_SHRINKS) if search else [1.0]
            w = weight.detach().contiguous()
            c = ops.column_scales(w) if col_scale else None
            q, s, b = ops.quantize_q4(w, group_size, shrinks, c)
        else:
            c = P.column_scales(weight) if col_scale else None
            q, s, b = P.quantize_int4(weight, group_size, symmetric=False, search=search, col_scales=c)
        m = cls(weight.shape[1], weight.shape[0], group_size, device="meta")
        m.qweight, m.scales, m.biases = q, s, b
        m.col_scales = c if c is not None else torch.ones(weight.shape[1], dtype=torch.float16, device=q.device)
        return m

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group_size: int = 32, search: bool = True, col_scale: bool = True
    ) -> Int4Linear:
        _check_no_bias(linear)
        return cls.from_weight(linear.weight, group_size, search, col_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32, col_scales: bool = True) -> Tensor:
        """The weight in `dtype` (col_scales=False: the stored weight / col_scales, in fp32 math)."""
        return P.dequantize_int4(self.qweight, self.scales, self.biases, dtype, self.col_scales if col_scales else None)

    def _gemv(self, ops, x2: Tensor) -> Tensor:
        return ops.gemv_q4(x2, self.qweight, self.scales, self.biases, self.col_scales)

    def _reference(self, x2: Tensor) -> Tensor:
        return _int8_x_reference(self, x2)

    def _dequant_rows(self, ops, r0: int, r1: int, dtype: torch.dtype, out: Tensor) -> Tensor:
        return ops.dequant_q4(self.qweight, self.scales, self.biases, r0, r1, dtype, out)


class DenseLinear(nn.Linear):
    """`nn.Linear(bias=False)` with faster CPU paths: the native GEMV for decode (few rows of x),
    and for prefill of 16-bit weights on CPUs without 16-bit matrix units, fp32 GEMMs on
    weight tiles converted `tile_rows` rows at a time (see `prefill_dtype`).

    Same parameter and state-dict key (`weight`) as nn.Linear; other devices and autograd use
    `F.linear` unchanged. The weight dtype is the module's (fp32 / bf16 / fp16); the output has x's
    dtype and is computed at x's precision (a 16-bit weight in an fp32 model is read as fp32, as
    the native GEMV does), so only the weight is rounded.
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype | None = None) -> DenseLinear:
        _check_no_bias(linear)
        w = linear.weight.detach()
        m = cls(linear.in_features, linear.out_features, device="meta")
        m.weight = nn.Parameter(w.to(dtype) if dtype is not None else w, requires_grad=False)
        return m

    def forward(self, x: Tensor) -> Tensor:
        _check_input(x, self.in_features, "DenseLinear")
        w = self.weight
        if x.device.type != "cpu" or w.device.type != "cpu" or w.requires_grad:
            return F.linear(x, w.to(x.dtype))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        M = x2.shape[0]
        if 0 < M <= GEMV_MAX_ROWS:
            ops = native.load()
            if (
                ops is not None
                and w.dtype in _NATIVE_DENSE_DTYPES
                and w.is_contiguous()
                and x.dtype in _NATIVE_DENSE_DTYPES
            ):
                return ops.gemv_dense(x2.contiguous(), w).reshape(*lead, self.out_features)
            return F.linear(x, w.to(x.dtype))
        ct = prefill_dtype(w.dtype) if x.dtype == w.dtype else x.dtype
        if M == 0:
            return F.linear(x, w.to(x.dtype))
        if ct == w.dtype:  # (then x.dtype == w.dtype too)
            return cpu_gemm(x2.contiguous(), w).reshape(*lead, self.out_features)
        # 16-bit weights on a CPU without 16-bit matrix units: fp32 GEMM on converted tiles.
        y = _tiled_linear(x2, self.out_features, ct, lambda r0, r1, out: out.copy_(w[r0:r1]))
        return y.reshape(*lead, self.out_features)


# Weight dtypes for which the native dense GEMV beats torch's (benchmarks/bench_kernels.py).
_NATIVE_DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _int8_x_reference(m: _QuantLinearBase, x2: Tensor, rounded: bool | None = None, block: int = 32) -> Tensor:
    """The plain path of a format whose native kernel rounds x to int8 (int4, K-quants): where
    `rounded` (default: on the CPU, for at most GEMV_MAX_ROWS rows) as that kernel computes it: x
    times the column scales, rounded to int8 per `block` columns (primitives.round_activations_int8),
    times the weight in fp32; else the plain reference (`F.linear` with the weight in x's dtype)."""
    if rounded is None:
        rounded = x2.shape[0] <= GEMV_MAX_ROWS
    if not rounded or x2.device.type != "cpu":
        return F.linear(x2, m.dequantize(x2.dtype))
    xs = P.round_activations_int8(x2.float() * m.col_scales.float(), block)
    return F.linear(xs, m.dequantize(torch.float32, col_scales=False)).to(x2.dtype)


def _check_no_bias(linear: nn.Module) -> None:
    if not isinstance(linear, nn.Linear):
        raise InputError(f"expected an nn.Linear, got {type(linear).__name__}")
    if linear.bias is not None:
        raise InputError("quantized linears have no bias; the module has one")


def weight_bytes(module: nn.Module) -> int:
    """Bytes a forward pass reads for the weight of a (quantized) linear module."""
    total = 0
    for name in ("qweight", "scales", "biases", "col_scales", "weight"):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


__all__ = ["Int8Linear", "Int4Linear", "DenseLinear", "PREFILL_TILE", "tile_rows", "weight_bytes"]
