"""Weight-only int8 / int4 linears for CUDA: our packed layouts, multiplied by Triton kernels.

The CPU's Int8Linear / Int4Linear (quant/linear.py) keep their bytes: int8 codes [N, K] with fp16
scales per group of columns; int4 codes two to a byte [N, K // 2] (column 2i in the low nibble)
with fp16 scales and biases per group (w = code * scale + bias); both times fp16 column scales
[K]. torch's `_weight_int8pack_mm` takes one scale per row only and `_weight_int4pack_mm` a
tiled layout with bf16 (scale, zero) pairs, so neither holds these weights exactly; the kernels
here read the layout as it is, so the weights they multiply by are ours bit for bit
(`dequantize` equals the CPU module's) and a converted directory needs no second format.

    convert_for_cuda(model)      # once, after the model moved to CUDA: every Int8/Int4Linear swapped

Each program of a kernel computes a [BLOCK_M, BLOCK_N] tile of y = (x * col_scales) @ W^T,
dequantizing [BLOCK_N, BLOCK_K] weights in fp32 (code * scale (+ bias)), rounding them to x's
dtype as the reference path (`F.linear(x, dequantize(x.dtype))`) does, and accumulating in fp32
with `tl.dot`. No split over K (no atomics): a row's bits do not depend on the other rows.
Triton is imported on first use; under TRITON_INTERPRET=1 the kernels run on CPU tensors (the
tests), fp32 and fp16 only (the interpreter computes bf16 wrongly).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import primitives as P
from .linear import Int4Linear, Int8Linear, QuantLinear

Tensor = torch.Tensor

BLOCK_M = 16  # tl.dot's smallest tile; decode's few rows are masked
BLOCK_N = 32
BLOCK_K = 64


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def int8_mm(
        x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, G, GS,
        stride_xm, stride_ym,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
            )
            wmask = (rn[:, None] < N) & (rk[None, :] < K)
            q = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=wmask, other=0)
            s = tl.load(s_ptr + rn[:, None] * G + rk[None, :] // GS, mask=wmask, other=0.0)
            w = (q.to(tl.float32) * s.to(tl.float32)).to(DOT_DTYPE)
            acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w), input_precision="ieee")
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def int4_mm(
        x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, G, GS,
        stride_xm, stride_ym,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        # BK packed bytes = 2 * BK columns a step: the low nibbles are the even columns, the high
        # ones the odd columns, each multiplied by the matching strided half of x.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        KB = K // 2
        for j0 in range(0, KB, BK):
            rj = j0 + tl.arange(0, BK)  # byte index; columns 2 * rj and 2 * rj + 1
            xmask = (rm[:, None] < M) & (rj[None, :] < KB)
            x_even = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * rj[None, :], mask=xmask, other=0.0)
            x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * rj[None, :] + 1, mask=xmask, other=0.0)
            wmask = (rn[:, None] < N) & (rj[None, :] < KB)
            byte = tl.load(q_ptr + rn[:, None] * KB + rj[None, :], mask=wmask, other=0).to(tl.int32)
            g = rn[:, None] * G + (2 * rj[None, :]) // GS  # both nibbles of a byte share a group (GS even)
            s = tl.load(s_ptr + g, mask=wmask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + g, mask=wmask, other=0.0).to(tl.float32)
            w_even = ((byte & 15).to(tl.float32) * s + b).to(DOT_DTYPE)
            w_odd = ((byte >> 4).to(tl.float32) * s + b).to(DOT_DTYPE)
            acc += tl.dot(x_even.to(DOT_DTYPE), tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(x_odd.to(DOT_DTYPE), tl.trans(w_odd), input_precision="ieee")
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    return triton, tl, int8_mm, int4_mm


@functools.cache
def available() -> bool:
    """Triton imports (whether the tensors are on CUDA is the caller's question)."""
    try:
        _kernels()
    except Exception:
        return False
    return True


def _launch(kernel, x2: Tensor, N: int, args: tuple) -> Tensor:
    triton, tl, _, _ = _kernels()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x2.device)
    dot = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[x2.dtype]
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    kernel[grid](x2, *args, y, M, N, *args_dims(args, x2), x2.stride(0), y.stride(0),
                 BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, DOT_DTYPE=dot)  # fmt: skip
    return y


def args_dims(args: tuple, x2: Tensor) -> tuple[int, int, int]:
    """(K, G, group size) from the scales (the second tensor of args) and x2 [M, K]."""
    K = x2.shape[1]
    G = args[1].shape[1]
    return K, G, K // G


class _CudaQuantLinear(QuantLinear):
    """The source module's buffers, adopted as they are; `_matmul` hands `KERNEL_ARGS` to the
    `KERNEL`-th kernel of `_kernels()` (the input check, reshaping and repr: the CPU modules')."""

    BUFFERS: tuple[str, ...]
    KERNEL: int
    KERNEL_ARGS: tuple[str, ...]

    def __init__(self, src: nn.Module):
        super().__init__()
        self.in_features, self.out_features = src.in_features, src.out_features
        for name in self.BUFFERS:
            self.register_buffer(name, getattr(src, name).contiguous())

    def _matmul(self, x2: Tensor) -> Tensor:
        """x2 [M, K] times the column scales (the weight is stored divided by them), through the kernel."""
        xs = (x2.float() * self.col_scales.float()).to(x2.dtype).contiguous()
        kernel = _kernels()[self.KERNEL]
        args = tuple(getattr(self, name) for name in self.KERNEL_ARGS)
        return _launch(kernel, xs, self.out_features, args).to(x2.dtype)


class CudaInt8Linear(_CudaQuantLinear):
    """Int8Linear's buffers (qweight int8 [N, K], scales fp16 [N, G], col_scales fp16 [K]) through `int8_mm`."""

    BUFFERS = ("qweight", "scales", "col_scales")
    KERNEL, KERNEL_ARGS = 2, ("qweight", "scales")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return P.dequantize_int8(self.qweight, self.scales, dtype, self.col_scales)


class CudaInt4Linear(_CudaQuantLinear):
    """Int4Linear's buffers (qweight uint8 [N, K // 2], scales / biases fp16 [N, G], col_scales) through `int4_mm`."""

    BUFFERS = ("qweight", "scales", "biases", "col_scales")
    KERNEL, KERNEL_ARGS = 3, ("qweight", "scales", "biases")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return P.dequantize_int4(self.qweight, self.scales, self.biases, dtype, self.col_scales)


def convertible(m: nn.Module) -> bool:
    """An Int8Linear / Int4Linear whose layout the kernels read (int4: groups of an even size)."""
    if type(m) is Int8Linear:
        return m.scales.dtype == P.INT8_SCALE_DTYPE
    if type(m) is Int4Linear:
        return m.biases is not None and m.group_size % 2 == 0
    return False


def convert_for_cuda(model: nn.Module) -> int:
    """Swap every convertible quantized linear of `model` for its CUDA module (same buffers, no copy);
    the number swapped. Call once the weights are on the GPU; without Triton nothing changes (the
    modules' reference path, a dequantized matrix per call, still runs)."""
    if not available():
        return 0
    swaps = [(name, m) for name, m in model.named_modules() if convertible(m)]
    for name, m in swaps:
        parent, _, leaf = name.rpartition(".")
        new = CudaInt8Linear(m) if isinstance(m, Int8Linear) else CudaInt4Linear(m)
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return len(swaps)
