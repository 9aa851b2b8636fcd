"""Native CPU kernels (rwkv_engine.kernels.native) against their plain-PyTorch references.

The first run on a machine compiles the extension (about 30-60 s); later runs load the cached
build. Skipped where the kernels cannot be built (no compiler / ninja, non-x86, no AVX2).
"""

from __future__ import annotations

import pytest
import torch

from rwkv_engine.kernels import native
from rwkv_engine.quant import primitives as P

ops = native.load()
pytestmark = pytest.mark.skipif(ops is None, reason="native kernels unavailable here (see log)")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (N, K): odd row counts (row-block tails), K with partial 16/64-column chunks, real widths.
SHAPES = [(37, 96), (5, 160), (130, 64), (64, 2048), (3, 448)]
BATCHES = [1, 2, 3, 4, 5, 8, 11]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).square().mean() / b.square().mean().clamp_min(1e-300)).sqrt().item()


def _round_out(y: torch.Tensor, dtype: torch.dtype) -> float:
    """Tolerance for an output stored in `dtype` (its rounding) plus fp32 accumulation."""
    return {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 6e-4}[dtype]


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("wdt", DTYPES)
def test_gemv_dense_matches_reference(N, K, wdt):
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g).to(wdt)
    for B in BATCHES:
        for xdt in DTYPES:
            x = torch.randn(B, K, generator=g).to(xdt)
            y = ops.gemv_dense(x, w)
            assert y.dtype == xdt and y.shape == (B, N)
            ref = x.double() @ w.double().T
            assert rel_rms(y, ref) < _round_out(y, xdt), (B, xdt)


def _col_scales(K, g, on):
    return (torch.rand(K, generator=g) * 3 + 0.2).half() if on else None


def _scaled(x, c):
    return x.float() if c is None else x.float() * c.float()


@pytest.mark.parametrize(
    "N,K,group_size", [(N, K, gs) for N, K in SHAPES for gs in (None, 32, 64, 128) if gs is None or K % gs == 0]
)
@pytest.mark.parametrize("col", [False, True])
def test_gemv_q8_matches_reference(N, K, group_size, col):
    g = torch.Generator().manual_seed(N + K)
    q, s = P.quantize_int8(torch.randn(N, K, generator=g), group_size)
    c = _col_scales(K, g, col)
    wd = P.dequantize_int8(q, s).double()  # the kernel applies c to x
    for B in BATCHES:
        for xdt in DTYPES:
            x = torch.randn(B, K, generator=g).to(xdt)
            y = ops.gemv_q8(x, q, s, c)
            assert y.dtype == xdt and y.shape == (B, N)
            # the spec: x times the column scales, rounded to int16 per 64 columns, then an
            # exact product with the weight
            xs = _scaled(x, c)
            ref = P.round_activations_int16(xs).double() @ wd.T
            assert rel_rms(y, ref) < max(2e-5, _round_out(y, xdt))
            # and the rounding itself is small
            assert rel_rms(y, xs.double() @ wd.T) < max(1e-4, _round_out(y, xdt))


@pytest.mark.parametrize("N,K,group_size", [(N, K, gs) for N, K in SHAPES for gs in (32, 64, 128) if K % gs == 0])
@pytest.mark.parametrize("col", [False, True])
def test_gemv_q4_matches_reference(N, K, group_size, col):
    g = torch.Generator().manual_seed(N * 7 + K)
    q, s, b = P.quantize_int4(torch.randn(N, K, generator=g), group_size)
    c = _col_scales(K, g, col)
    wd = P.dequantize_int4(q, s, b).double()
    for B in BATCHES:
        for xdt in DTYPES:
            x = torch.randn(B, K, generator=g).to(xdt)
            y = ops.gemv_q4(x, q, s, b, c)
            assert y.dtype == xdt and y.shape == (B, N)
            # the spec: x times the column scales, rounded to int8 per 32 columns, then an exact
            # product with the weight
            xs = _scaled(x, c)
            ref = P.round_activations_int8(xs).double() @ wd.T
            assert rel_rms(y, ref) < max(2e-5, _round_out(y, xdt))
            # and the rounding itself is small (about 0.5% on average, against int4's own ~8%; a
            # few outputs of one row of x vary more)
            assert rel_rms(y, xs.double() @ wd.T) < 2e-2


@pytest.mark.parametrize("N,K", [(53, 2048 + 96), (30, 7168), (11, 1040)])
def test_gemv_rows_of_a_batch_equal_each_row_alone(N, K):
    # Batch invariance, bit for bit: whatever the batch size (row blocks, groups of x rows, K
    # tiles all change with it), each output gets the same floating-point operations.
    g = torch.Generator().manual_seed(K)
    w = torch.randn(N, K, generator=g)
    gemvs = {f"dense {dt}": (lambda x, wd=w.to(dt): ops.gemv_dense(x, wd)) for dt in DTYPES}
    gemvs["dense bf16, x bf16"] = lambda x, wd=w.bfloat16(): ops.gemv_dense(x.bfloat16(), wd)  # the bf16 dot path
    gemvs["int8 per channel"] = lambda x, q=P.quantize_int8(w): ops.gemv_q8(x, *q)
    if K % 128 == 0:
        gemvs["int8 g64"] = lambda x, q=P.quantize_int8(w, 64): ops.gemv_q8(x, *q)
    for gs in (32, 64, 128):  # (K = 2048 + 96: int4 g32 with a group past the last 64-column chunk)
        if K % gs == 0:
            gemvs[f"int4 g{gs}"] = lambda x, q=P.quantize_int4(w, gs, search=False): ops.gemv_q4(x, *q)
    x = torch.randn(16, K, generator=g)
    for name, f in gemvs.items():
        alone = torch.cat([f(x[i : i + 1]) for i in range(16)])
        # bf16 x bf16 on AMX tiles (native.amx_min_rows): a pass of 8 rows of x with at least that
        # many rows takes the tiles, whose bits are their own, the same for any such pass
        amx = native.amx_min_rows() if name == "dense bf16, x bf16" else None
        tiled = f(x) if amx else None
        for B in (2, 3, 4, 5, 8, 9, 16):
            y = f(x[:B])
            for b0 in range(0, B, 8):
                b1 = min(B, b0 + 8)
                ref = tiled if amx and b1 - b0 >= amx else alone
                assert torch.equal(y[b0:b1], ref[b0:b1]), (name, B, b0)


def test_bf16_activations_take_the_bf16_dot_product_where_the_level_has_it():
    # x whose values are bf16 (x in bf16, or the decode step's activations of a bf16 model) times
    # bf16 weights runs on the CPU's bf16 dot products at the avx512_bf16 level, which flush
    # denormal inputs to zero; fp32 x and the other levels keep them. So a denormal x (2^-130)
    # times a large weight (2^100) tells which path ran, and the rest must agree within rounding.
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 96, generator=g).bfloat16()
    x = torch.randn(3, 96, generator=g).bfloat16()
    assert rel_rms(ops.gemv_dense(x, w), ops.gemv_dense(x.float(), w)) < 4e-3
    w[:, 0], x[:, 1:] = 2.0**100, 0
    x[:, 0] = 2.0**-130
    assert ops.gemv_dense(x.float(), w).eq(2.0**-30).all()
    flushed = ops.gemv_dense(x, w)
    if ops.isa() == "avx512_bf16":
        assert flushed.eq(0).all()
    else:
        assert flushed.eq(2.0**-30).all()


def test_activation_rounding_with_an_outlier_activation():
    # One activation 1000x the others in its block of x: the others lose precision, still small
    # next to the outlier's share of the output (int8: the block's other 31 values round to 0).
    N, K = 64, 256
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(1, K, generator=g)
    x[0, 5] = 1000.0
    q, s = P.quantize_int8(w, 64)
    y = ops.gemv_q8(x, q, s)
    wd = P.dequantize_int8(q, s).double()
    assert rel_rms(y, P.round_activations_int16(x).double() @ wd.T) < 2e-5
    assert rel_rms(y, x.double() @ wd.T) < 1e-3
    q, s, b = P.quantize_int4(w, 32)
    y = ops.gemv_q4(x, q, s, b)
    wd = P.dequantize_int4(q, s, b).double()
    assert rel_rms(y, P.round_activations_int8(x).double() @ wd.T) < 2e-5
    assert rel_rms(y, x.double() @ wd.T) < 1e-2


def test_q4_rounds_x_as_the_reference_bit_for_bit():
    # An identity weight (code 1 on the diagonal, scale 1, bias 0): the output is x as the kernel
    # rounded it, which must be round_activations_int8's value exactly (a rounding that differed
    # at exact halves, which 16-bit x hits, would move an output by a whole int8 step).
    K = 2048 + 32
    g = torch.Generator().manual_seed(11)
    codes = torch.eye(K, dtype=torch.uint8)
    s = torch.ones(K, K // 32, dtype=torch.float16)
    b = torch.zeros(K, K // 32, dtype=torch.float16)
    block_sizes = torch.rand(16, K // 32, 1, generator=g).expand(16, K // 32, 32).reshape(16, K)
    for dt in DTYPES:
        x = (torch.randn(16, K, generator=g) * block_sizes).to(dt)
        assert torch.equal(ops.gemv_q4(x, P.pack_int4(codes), s, b), P.round_activations_int8(x).to(dt)), dt


def _identity_q8(K):
    return torch.eye(K, dtype=torch.int8), torch.ones(K, 1, dtype=torch.float16)


def _identity_q4(K):
    codes = torch.eye(K, dtype=torch.uint8)
    return P.pack_int4(codes), torch.ones(K, K // 32, dtype=torch.float16), torch.zeros(K, K // 32, dtype=torch.float16)


def test_tiny_and_denormal_blocks_round_to_zero_bit_for_bit():
    """R8: 127 / absmax overflowed for 0 < absmax < ~3.7e-37 and 0 * inf gave NaN. With an
    identity weight the output is x as the kernel rounded it: the reference's value exactly."""
    K = 256
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, K, generator=g)
    x[:, :64] *= 1e-38  # tiny: below 127 / FLT_MAX
    x[:, 1] = 0.0
    x[:, 64:128] = torch.randn(4, 64, generator=g) * 1e-42  # denormal
    x[:, 128:192] = 0.0
    y4 = ops.gemv_q4(x, *_identity_q4(K))
    assert torch.equal(y4, P.round_activations_int8(x)) and torch.equal(y4[:, :192], torch.zeros(4, 192))
    y8 = ops.gemv_q8(x, *_identity_q8(K))
    assert torch.isfinite(y8).all() and torch.equal(y8[:, :192], torch.zeros(4, 192))
    assert rel_rms(y8, P.round_activations_int16(x)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_or_inf_in_x_gives_non_finite_rows(dtype):
    """R9: a NaN in x rounded to an integer gave a finite output. Rows that see a NaN or an
    infinity come out non-finite, in every kernel; the other rows as alone."""
    K, N = 256, 48
    g = torch.Generator().manual_seed(6)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(3, K, generator=g).to(dtype)
    x[0, 70] = float("nan")
    x[1, 200] = float("inf")
    q8, s8 = P.quantize_int8(w, 64)
    q4, s4, b4 = P.quantize_int4(w, 32)
    kernels = (
        lambda x: ops.gemv_q8(x, q8, s8),
        lambda x: ops.gemv_q4(x, q4, s4, b4),
        lambda x: ops.gemv_dense(x, w.to(dtype)),
    )
    for f in kernels:
        y = f(x)
        assert not torch.isfinite(y[:2]).any()
        assert torch.equal(y[2:], f(x[2:]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_tiles_equal_reference(dtype):
    N, K = 50, 256
    w = torch.randn(N, K)
    q, s = P.quantize_int8(w, 64)
    assert torch.equal(ops.dequant_q8(q, s, 3, 41, dtype), P.dequantize_int8(q, s)[3:41].to(dtype))
    q, s = P.quantize_int8(w, None)
    assert torch.equal(ops.dequant_q8(q, s, 0, N, dtype), P.dequantize_int8(q, s).to(dtype))
    q, s = P.quantize_int8(w[:, :100], None)  # per channel: any K, here 3 x 32 + 4
    assert torch.equal(ops.dequant_q8(q, s, 0, N, dtype), P.dequantize_int8(q, s).to(dtype))
    for gs in (32, 64, 128):
        q, s, b = P.quantize_int4(w, gs)
        assert torch.equal(ops.dequant_q4(q, s, b, 7, 50, dtype), P.dequantize_int4(q, s, b)[7:50].to(dtype))
    assert ops.dequant_q4(q, s, b, 5, 5, dtype).shape == (0, K)
    buf = torch.empty(43, K, dtype=dtype)
    tile = ops.dequant_q4(q, s, b, 7, 50, dtype, buf)
    assert tile.data_ptr() == buf.data_ptr() and torch.equal(buf, P.dequantize_int4(q, s, b)[7:50].to(dtype))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.dequant_q4(q, s, b, 0, 50, dtype, buf)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("col", [False, True])
def test_quantize_q4_gives_the_reference_bytes(group_size, search, col):
    from rwkv_engine.testing import random_state_dict

    sd = random_state_dict("5.2", n_layer=1, n_embd=256, vocab_size=64, head_size=64, outliers=True, seed=2)
    zeros = torch.zeros(3, 128)
    zeros[1, 5] = 2.5
    shrinks = list(P.SEARCH_SHRINKS) if search else [1.0]
    for w in (torch.randn(37, 256), sd["blocks.0.ffn.value.weight"], zeros, torch.randn(4, 128) * 1e-6):
        c = P.column_scales(w) if col else None
        for dtype in DTYPES:
            wd = w.to(dtype)
            got = ops.quantize_q4(wd, group_size, shrinks, c)
            ref = P.quantize_int4(wd, group_size, search=search, col_scales=c)
            for a, b in zip(got, ref):
                assert a.dtype == b.dtype and torch.equal(a, b)


def test_threads_give_identical_results():
    # Rows are split between threads, each row is computed the same way: bitwise equal.
    N, K = 1030, 2048
    w = torch.randn(N, K)
    q4 = P.quantize_int4(w, 32, search=False)
    q8 = P.quantize_int8(w, 128)
    wb = w.bfloat16()
    x = torch.randn(3, K)
    old = torch.get_num_threads()
    try:
        out = {}
        for nt in (1, 2):
            torch.set_num_threads(nt)
            out[nt] = (ops.gemv_q4(x, *q4), ops.gemv_q8(x, *q8), ops.gemv_dense(x, wb))
    finally:
        torch.set_num_threads(old)
    for a, b in zip(out[1], out[2]):
        assert torch.equal(a, b)


def test_kernels_reject_bad_tensors():
    w = torch.randn(8, 64)
    q, s, b = P.quantize_int4(w, 32)
    with pytest.raises(RuntimeError, match="K = 64"):
        ops.gemv_q4(torch.randn(1, 32), q, s, b)
    with pytest.raises(RuntimeError, match="float16"):
        ops.gemv_q4(torch.randn(1, 64), q, s.float(), b)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.gemv_dense(torch.randn(2, 128)[:, ::2], w)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.gemv_dense(torch.ones(1, 64, dtype=torch.int32), w)
    q8, s8 = P.quantize_int8(torch.randn(8, 96), 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.gemv_q8(torch.randn(1, 96), q8, s8)
    with pytest.raises(RuntimeError, match="row range"):
        ops.dequant_q4(q, s, b, 4, 9, torch.float32)
    with pytest.raises(RuntimeError, match="col_scales"):
        ops.gemv_q4(torch.randn(1, 64), q, s, b, torch.ones(32, dtype=torch.float16))


def test_load_is_cached():
    assert native.load() is ops
