"""A linear layer over ggml's K-quant blocks (Q4_K, Q5_K, Q6_K), executed from the bytes as stored.

    layer = KQuantLinear.from_blocks("Q4_K", blocks, (out_features, in_features))
    y = layer(x)            # x [..., in_features] fp32 / bf16 / fp16 -> y [..., out_features], x.dtype

The constructor takes what any producer of K-quant bytes has, a GGUF file or a quantizer of our
own alike:

    qtype       the ggml type: "Q4_K", "Q5_K" or "Q6_K" (or its ggml id 12, 13, 14)
    blocks      uint8 [out_features, in_features // 256 * block_bytes]: row n is weight row n as
                ggml's blocks of 256 columns, byte for byte the block_q4_K (144 bytes), block_q5_K
                (176) or block_q6_K (210) that `gguf.quants.dequantize` reads
                (quant/ggml_quants.py describes the layouts); a view of a memory-mapped file is
                used as it is, not copied
    shape       (out_features, in_features); in_features a multiple of 256
    col_scales  optional fp16 [in_features]: the blocks then hold weight / col_scales and x is
                multiplied by them instead (as Int4Linear's; a GGUF's weights have none: ones)

`KQuantLinear(in_features, out_features, qtype)` holds zero blocks of the right shape, ready for
`load_state_dict` (a converted directory: the buffers `qweight` = the blocks and `col_scales`).

Decode (at most GEMV_MAX_ROWS rows of x on the CPU) runs the native K-quant GEMV
(kernels/native/kernels.cpp, KQuantKernel): x rounded to int8 per 32 columns
(primitives.round_activations_int8, as for Int4Linear), exact integer sums per 16 columns, one
float scaling per group. Prefill (more rows) runs an integer kernel too where the CPU's GEMM would
be fp32 (`prefill_dtype`: no bf16 matrix instructions): on the AVX2 level with x rounded per 256
columns instead (ggml's Q8_K, `x_group`), each block's sums kept in the integers, a tile of weight
rows unpacked once for 64 rows of x (kernels.cpp gemv_kq_prefill); on the other levels the decode
kernel, 8 rows of x per pass. With AVX512-BF16 / AMX it dequantizes tiles of rows with the native
decoder (ggml's values bit for bit) into the bf16 GEMM, as Int4Linear does. On a Zen 3 (AVX2, one
thread, thread CPU time, best of 40 alternating calls; benchmarks/bench_kernels.py --only
kprefill) the integer kernel took 0.43-0.58x the time of tiles + fp32 GEMM at 64 rows and
0.74-1.02x at 512. Without the native kernels, the plain path below is the specification: the
blocks dequantized by quant/ggml_quants.py (gguf.quants' values), with x rounded as the kernels in
use round it (per 32 columns without them) where they would run the integer kernel.
"""

from __future__ import annotations

import torch

from rwkv_engine.errors import InputError
from rwkv_engine.kernels import native
from rwkv_engine.kernels.native import GEMV_MAX_ROWS
from rwkv_engine.quant.ggml_quants import BY_NAME, KQUANT, QK_K, TYPES, dequantize
from rwkv_engine.quant.linear import _int8_x_reference, _QuantLinearBase, prefill_dtype

Tensor = torch.Tensor

KQUANT_TYPES = KQUANT


def ktype_id(qtype: str | int) -> int:
    """The ggml id of a K-quant type given by name or id; InputError for anything else."""
    tid = BY_NAME.get(qtype) if isinstance(qtype, str) else qtype
    if isinstance(tid, bool) or not isinstance(tid, int) or TYPES.get(tid, ("",))[0] not in KQUANT_TYPES:
        raise InputError(f"K-quant type must be one of {', '.join(KQUANT_TYPES)}, got {qtype!r}")
    return tid


def block_bytes(qtype: str | int) -> int:
    """Bytes of one block of 256 values of a K-quant type."""
    return TYPES[ktype_id(qtype)][2]


def _integer_prefill() -> bool:
    """Whether prefill runs the integer kernel (x rounded as in decode): where the CPU has no
    bf16 matrix instructions, so that the dense GEMM would be fp32."""
    return prefill_dtype(torch.bfloat16) == torch.float32


def x_group(qtype: str | int, rows: int) -> int:
    """Columns of x per int8 step in the integer K-quant kernel for `rows` rows of x: 32 (as for
    int4), except where the kernels in use report otherwise (prefill on the AVX2 level: 256, as
    ggml's Q8_K, see kernels.cpp gemv_kq_prefill); 32 without native kernels."""
    ops = native.load()
    return 32 if ops is None else ops.kq_x_group(ktype_id(qtype), rows)


class KQuantLinear(_QuantLinearBase):
    """y = x W^T with W [out_features, in_features] in ggml K-quant blocks (see the module docstring).

    Buffers: qweight uint8 [out_features, in_features // 256 * block_bytes] (the blocks),
    col_scales float16 [in_features]. `qtype`: the ggml type name.
    """

    def __init__(self, in_features: int, out_features: int, qtype: str | int, device=None):
        super().__init__()
        tid = ktype_id(qtype)
        if in_features <= 0 or in_features % QK_K or out_features <= 0:
            raise InputError(f"KQuantLinear: in_features must be a positive multiple of {QK_K}, got {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.type_id = tid
        self.qtype = TYPES[tid][0]
        row = in_features // QK_K * TYPES[tid][2]
        self.register_buffer("qweight", torch.zeros(out_features, row, dtype=torch.uint8, device=device))
        self.register_buffer("col_scales", torch.ones(in_features, dtype=torch.float16, device=device))

    @classmethod
    def from_blocks(
        cls, qtype: str | int, blocks: Tensor, shape: tuple[int, int], col_scales: Tensor | None = None
    ) -> KQuantLinear:
        """The module of weight `shape` (out_features, in_features) stored as `blocks` (not copied)."""
        N, K = (int(n) for n in shape)
        m = cls(K, N, qtype, device="meta")
        want = (N, K // QK_K * TYPES[m.type_id][2])
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
            got = f"{blocks.dtype} {tuple(blocks.shape)}" if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise InputError(f"KQuantLinear: {m.qtype} blocks of a {N} x {K} weight must be uint8 {want}, got {got}")
        m.qweight = blocks if blocks.is_contiguous() else blocks.contiguous()
        if col_scales is None:
            col_scales = torch.ones(K, dtype=torch.float16, device=blocks.device)
        elif col_scales.dtype != torch.float16 or tuple(col_scales.shape) != (K,):
            raise InputError(
                f"KQuantLinear: col_scales must be float16 [{K}], got {col_scales.dtype} {tuple(col_scales.shape)}"
            )
        m.col_scales = col_scales
        return m

    def dequantize(self, dtype: torch.dtype = torch.float32, col_scales: bool = True) -> Tensor:
        """The weight [out_features, in_features] in `dtype`: ggml's values (times the column scales
        unless col_scales=False)."""
        w = dequantize(self.qweight.reshape(-1), self.type_id, (self.out_features, self.in_features))
        if col_scales:
            w = w * self.col_scales.float()
        return w.to(dtype)

    def _gemv(self, ops, x2: Tensor) -> Tensor:
        return ops.gemv_kq(x2, self.qweight, self.type_id, self.in_features, self.col_scales)

    def _prefill(self, ops, x2: Tensor) -> Tensor:
        """Many rows of x: the integer kernel where the GEMM would run in fp32, else dequantized
        tiles and the 16-bit GEMM (see the module docstring)."""
        return self._gemv(ops, x2) if _integer_prefill() else super()._prefill(ops, x2)

    def _dequant_rows(self, ops, r0: int, r1: int, dtype: torch.dtype, out: Tensor) -> Tensor:
        return ops.dequant_kq(self.qweight, self.type_id, self.in_features, r0, r1, dtype, out)

    def _reference(self, x2: Tensor) -> Tensor:
        rows = x2.shape[0]
        return _int8_x_reference(self, x2, rows <= GEMV_MAX_ROWS or _integer_prefill(), x_group(self.type_id, rows))

    def _native_ok(self) -> bool:
        return self.qweight.dtype == torch.uint8 and self.qweight.is_contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"

    @property
    def group_size(self) -> int:
        return QK_K


__all__ = ["KQUANT_TYPES", "KQuantLinear", "block_bytes", "ktype_id", "x_group"]
