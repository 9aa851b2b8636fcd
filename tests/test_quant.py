"""Quantization: primitives vs plain loops, quantized linears vs dequantized matmuls, the scheme
registry and quantize_model, error bounds on heavy-tailed weights, and bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rwkv_engine.errors import InputError
from rwkv_engine.kernels import native
from rwkv_engine.quant import DenseLinear, Int4Linear, Int8Linear, get_scheme, quantize_model, scheme_names, schemes
from rwkv_engine.quant import linear as QL
from rwkv_engine.quant import primitives as P
from rwkv_engine.testing import random_state_dict

from .conftest import rel_rms


@pytest.fixture(params=["native", "plain"])
def path(request, monkeypatch):
    """Run a test with the native kernels (when available) and with them switched off."""
    if request.param == "plain":
        monkeypatch.setattr(native, "load", lambda verbose=False: None)
    elif native.load() is None:
        pytest.skip("native kernels unavailable here")
    return request.param


# --- primitives -----------------------------------------------------------------------------


def test_pack_int4_layout_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 12), generator=g, dtype=torch.uint8)
    packed = P.pack_int4(codes)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    for n in range(5):
        for i in range(6):
            assert packed[n, i].item() == codes[n, 2 * i].item() | (codes[n, 2 * i + 1].item() << 4)
    assert torch.equal(P.unpack_int4(packed), codes)


def test_unpack_pack_round_trip_all_bytes():
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(P.pack_int4(P.unpack_int4(packed)), packed)


@pytest.mark.parametrize("group_size", [None, 32, 128])
def test_int8_round_trip_error_within_half_a_step(group_size):
    w = torch.randn(40, 256)
    q, s = P.quantize_int8(w, group_size)
    G = 1 if group_size is None else 256 // group_size
    assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == (40, G) and s.dtype == torch.float16
    assert q.abs().max() <= 127
    step = s.repeat_interleave(256 // G, dim=1)
    assert ((P.dequantize_int8(q, s) - w).abs() <= step / 2 + 1e-7).all()
    # values on the grid come back exactly
    assert torch.equal(P.quantize_int8(P.dequantize_int8(q, s), group_size)[0], q)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_round_trip(group_size, symmetric):
    w = torch.randn(24, 256)
    q, s, b = P.quantize_int4(w, group_size, symmetric=symmetric, search=False)
    G = 256 // group_size
    assert q.shape == (24, 128) and q.dtype == torch.uint8
    assert s.shape == (24, G) and s.dtype == torch.float16
    assert (b is None) == symmetric
    step = s.float().abs().repeat_interleave(group_size, dim=1)
    err = (P.dequantize_int4(q, s, b) - w).abs()
    # within half a step (symmetric: a full step on the side opposite the absmax, which only has
    # 7 steps), plus the rounding of the fp16 scale / bias over 15 steps
    assert (err <= step * ((1.0 if symmetric else 0.5) + 15 * 2**-10) + 1e-6).all()


def test_int4_search_never_worse_per_group():
    w = torch.randn(16, 512) + 0.3 * torch.randn(16, 512).pow(3)
    plain = P.dequantize_int4(*P.quantize_int4(w, 32, search=False))
    searched = P.dequantize_int4(*P.quantize_int4(w, 32, search=True))
    e0 = (plain - w).square().reshape(16, 16, 32).sum(-1)
    e1 = (searched - w).square().reshape(16, 16, 32).sum(-1)
    assert (e1 <= e0 + 1e-6).all() and e1.sum() < e0.sum()


def test_zero_rows_quantize_to_zero():
    w = torch.zeros(3, 64)
    assert torch.equal(P.dequantize_int8(*P.quantize_int8(w)), w)
    assert torch.equal(P.dequantize_int4(*P.quantize_int4(w, 32)), w)


def test_round_activations_int16():
    x = torch.randn(3, 200)
    xr = P.round_activations_int16(x)
    assert torch.equal(xr[:, 192:], x[:, 192:])  # partial last block left exact
    step = x[:, :192].reshape(3, 3, 64).abs().amax(-1, keepdim=True) / 32767
    assert ((xr[:, :192] - x[:, :192]).reshape(3, 3, 64).abs() <= step * 0.51).all()


@pytest.mark.parametrize(
    "call",
    [
        lambda: P.quantize_int8(torch.randn(4, 96), 64),
        lambda: P.quantize_int4(torch.randn(4, 96), 64),
        lambda: P.quantize_int4(torch.randn(4, 96), 48),
        lambda: P.quantize_int4(torch.randn(4, 64), 0),
        lambda: P.quantize_int8(torch.randn(64)),
        lambda: P.quantize_int8(torch.ones(2, 64, dtype=torch.int32)),
        lambda: P.quantize_int4(torch.full((2, 64), float("nan"))),
        lambda: P.pack_int4(torch.zeros(2, 3, dtype=torch.uint8)),
    ],
)
def test_primitives_reject_bad_input(call):
    with pytest.raises(InputError):
        call()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("make", [Int8Linear.from_weight, Int4Linear.from_weight, P.column_scales])
def test_a_bad_value_in_any_row_chunk_is_found(bad, make):
    """The checks read big weights in row chunks (no temporaries of the weight's size); a nan or
    inf in the last chunk is found as in the first (Python's max() alone would drop a nan)."""
    w = torch.randn(2048, 4096, dtype=torch.bfloat16)  # several chunks of rows
    w[-1, -1] = bad
    with pytest.raises(InputError, match="inf or nan"):
        make(w)


# --- quantized linear modules ---------------------------------------------------------------

MODULES = [
    ("int8", lambda w: Int8Linear.from_weight(w)),
    ("int8g64", lambda w: Int8Linear.from_weight(w, 64)),
    ("int8g32", lambda w: Int8Linear.from_weight(w, 32)),  # not a native layout: plain path
    ("int4g32", lambda w: Int4Linear.from_weight(w, 32)),
    ("int4g128", lambda w: Int4Linear.from_weight(w, 128)),
]


@pytest.mark.parametrize("name,make", MODULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quant_linear_equals_dequantized_matmul(name, make, dtype, path):
    torch.manual_seed(0)
    w = torch.randn(70, 256) / 16
    m = make(w)
    wd = m.dequantize(torch.float64)
    # fp32: the native int8 GEMV rounds x to int16 per 64 columns (~3e-5); 16-bit: output rounding
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-3, torch.float16: 1e-3}[dtype]
    for shape in [(256,), (1, 256), (3, 256), (2, 4, 256), (1, 9, 256), (2, 40, 256)]:  # decode and prefill
        x = torch.randn(shape).to(dtype)
        y = m(x)
        assert y.dtype == dtype and y.shape == (*shape[:-1], 70)
        xs = x.double()
        if isinstance(m, Int4Linear) and x.reshape(-1, 256).shape[0] <= QL.GEMV_MAX_ROWS:
            # int4 decode, native or not: x times the column scales rounded to int8 per 32 columns
            c = m.col_scales.double()
            xs = P.round_activations_int8(x.float() * m.col_scales.float()).double() / c
            assert rel_rms(xs, x.double()) > 1e-3  # (the rounding is there)
        assert rel_rms(y, xs @ wd.T) < tol, shape


def _tiny_blocks(B: int) -> torch.Tensor:
    """x [B, 256] whose first 32-column blocks are tiny (0 < absmax < 3.7e-37, where 127 / absmax
    overflows), denormal, or all zero; the rest ordinary."""
    torch.manual_seed(0)
    x = torch.randn(B, 256)
    x[:, :32] *= 1e-38
    x[:, 1] = 0.0
    x[:, 32:64] = torch.randn(B, 32) * 1e-42  # denormals
    x[:, 64:96] = 0.0
    return x


def test_tiny_activation_blocks_round_to_zero():
    x = _tiny_blocks(2)
    for r in (P.round_activations_int8(x), P.round_activations_int16(x)):
        assert torch.isfinite(r).all()
        assert torch.equal(r[:, :96], torch.zeros(2, 96))


@pytest.mark.parametrize("name,make", MODULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_activation_blocks_give_finite_outputs(name, make, dtype, path):
    """R8: 127 / absmax overflowed to inf and 0 * inf gave NaN, native and PyTorch paths alike."""
    torch.manual_seed(0)
    m = make(torch.randn(64, 256) * 0.05)
    for B in (1, 3, 20):  # decode and prefill
        x = _tiny_blocks(B).to(dtype)
        y = m(x)
        assert torch.isfinite(y).all(), (B, y)
        xs = x.double()
        xs[:, :96] = 0.0  # what the tiny blocks contribute (they are far below any rounding)
        assert rel_rms(y, xs @ m.dequantize(torch.float64).T) < 2e-2


@pytest.mark.parametrize(
    "name,make", MODULES + [("dense_bf16", lambda w: DenseLinear.from_linear(_linear(w), torch.bfloat16))]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [3, 20])  # decode (the native GEMVs) and prefill
def test_nan_or_inf_input_gives_non_finite_rows(name, make, dtype, B, path):
    """R9: a NaN in x came out finite from the int8 GEMV (rounded to an integer): the rows that
    see a NaN or an infinity come out all non-finite, the other rows as computed alone."""
    torch.manual_seed(0)
    m = make(torch.randn(64, 256) * 0.05)
    x = torch.randn(B, 256).to(dtype)
    x[0, 100] = float("nan")
    x[1, 5] = float("inf")
    y = m(x)
    assert torch.isnan(y[0]).all(), y[0]
    assert not torch.isfinite(y[1]).any(), y[1]
    assert torch.isfinite(y[2:]).all()
    if path == "native" and B <= QL.GEMV_MAX_ROWS:  # the per-row GEMVs: each row's bits its own
        assert torch.equal(y[2:], m(x[2:]))


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    return lin


@pytest.mark.parametrize("name,make", MODULES)
def test_quant_linear_state_dict_round_trip(name, make, tmp_path):
    from safetensors.torch import load_file, save_file

    w = torch.randn(48, 256)
    m = make(w)
    save_file(m.state_dict(), str(tmp_path / "m.safetensors"))
    sd = load_file(str(tmp_path / "m.safetensors"))
    cls = type(m)
    m2 = cls(256, 48, m.group_size if m.scales.shape[1] > 1 else None)
    m2.load_state_dict(sd)
    m3 = cls(256, 48, m.group_size if m.scales.shape[1] > 1 else None, device="meta")
    m3.load_state_dict(sd, assign=True)
    x = torch.randn(2, 256)
    assert torch.equal(m(x), m2(x)) and torch.equal(m(x), m3(x))


def test_dense_linear_is_an_nn_linear(path):
    lin = nn.Linear(128, 40, bias=False)
    m = DenseLinear.from_linear(lin, torch.bfloat16)
    assert isinstance(m, nn.Linear) and set(m.state_dict()) == {"weight"}
    x = torch.randn(3, 128)
    y = m(x)  # fp32 x: computed in fp32 with the bf16 weight's values (only the weight is rounded)
    assert y.dtype == torch.float32
    assert rel_rms(y, F.linear(x, m.weight.float())) < 1e-5
    yb = m(x.bfloat16().reshape(1, 3, 128)).reshape(3, 40)
    assert yb.dtype == torch.bfloat16 and rel_rms(yb, y) < 5e-3
    xs = torch.randn(40, 128)  # and the same in prefill (tiled GEMM)
    assert rel_rms(m(xs), F.linear(xs, m.weight.float())) < 1e-5


def _gemm_rows(monkeypatch) -> list[int]:
    """The row counts of the GEMMs quant.linear runs, recorded; 16-bit GEMMs allowed on any CPU."""
    rows: list[int] = []
    real = F.linear

    def linear(x, w, *args):
        rows.append(x.shape[0])
        return real(x, w, *args)

    monkeypatch.setattr(QL.F, "linear", linear)
    monkeypatch.setattr(QL, "prefill_dtype", lambda dtype: dtype)
    return rows


@pytest.mark.parametrize("M", [17, 31, 32, 33, 191, 250])
def test_a_16_bit_prefill_gemm_runs_on_rows_padded_to_the_step(monkeypatch, M):
    """oneDNN builds a kernel per new row count (4-8 ms each): a bf16 prefill GEMM's rows are
    padded to a multiple of GEMM_ROW_STEP, and the real rows come out as without the padding."""
    rows = _gemm_rows(monkeypatch)
    m = DenseLinear.from_linear(nn.Linear(96, 40, bias=False), torch.bfloat16)
    x = torch.randn(1, M, 96).bfloat16()
    y = m(x)
    step = QL.GEMM_ROW_STEP
    assert rows == [-(-M // step) * step]
    assert y.shape == (1, M, 40) and y.dtype == torch.bfloat16
    want = F.linear(x.float(), m.weight.float())
    assert rel_rms(y.float(), want) < 5e-3
    assert torch.equal(y[0, :17], m(x[:, :17])[0])  # a row does not depend on the rows beside it
    rows.clear()
    m(x.float())  # fp32 x: the fp32 GEMM (tiled), rows as they are
    assert rows and set(rows) == {M}


@pytest.mark.skipif(native.load() is None, reason="the tiled prefill runs with the native kernels")
def test_prefill_tiles_are_bounded_in_bytes_and_do_not_change_the_result(monkeypatch):
    """A prefill GEMM's weight tile holds at most PREFILL_TILE_BYTES (it lives beside the piece's
    activations); where the weight is cut into tiles does not change a bit of the output, with
    column scales or without them (a GGUF's K-quants: x goes to the GEMM as it is)."""
    assert QL.tile_rows(2048, torch.bfloat16) == QL.PREFILL_TILE
    assert QL.tile_rows(8192, torch.bfloat16) * 8192 * 2 <= QL.PREFILL_TILE_BYTES
    assert QL.tile_rows(1 << 20, torch.float32) == 64  # never fewer rows than that
    cuts: list[int] = []
    real = QL._tiled_linear

    def tiled(x2, n_rows, ct, fn):
        cuts.append(QL.tile_rows(x2.shape[1], ct))
        return real(x2, n_rows, ct, fn)

    monkeypatch.setattr(QL, "_tiled_linear", tiled)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 256, generator=g)
    x = torch.randn(40, 256, generator=g).bfloat16()
    for col_scale in (True, False):
        m = Int8Linear.from_weight(w, 64, col_scale=col_scale)
        assert bool((m.col_scales == 1).all()) != col_scale
        whole = m(x)
        monkeypatch.setattr(QL, "PREFILL_TILE_BYTES", 64 * 256 * 4)  # tiles of 64 (fp32) or 128 rows
        cuts.clear()
        assert torch.equal(m(x), whole) and len(cuts) == 1 and cuts[0] in (64, 128)
        monkeypatch.setattr(QL, "PREFILL_TILE_BYTES", 4 << 20)
        assert rel_rms(whole.float(), F.linear(x.float(), m.dequantize(torch.float32))) < 1e-2


def test_warm_gemms_builds_every_padded_row_count_of_every_weight_shape(monkeypatch):
    """The server's warm-up: each 16-bit weight shape once per padded row count up to max_rows,
    the output head aside (it runs with many rows only for every-position logits)."""
    from rwkv_engine.kernels.native import GEMV_MAX_ROWS

    rows = _gemm_rows(monkeypatch)
    model = nn.Module()
    model.a = DenseLinear.from_linear(nn.Linear(64, 32, bias=False), torch.bfloat16)
    model.b = DenseLinear.from_linear(nn.Linear(64, 32, bias=False), torch.bfloat16)  # same shape as a
    model.c = DenseLinear.from_linear(nn.Linear(32, 64, bias=False), torch.bfloat16)
    model.head = DenseLinear.from_linear(nn.Linear(64, 1000, bias=False), torch.bfloat16)
    model.f = DenseLinear.from_linear(nn.Linear(64, 48, bias=False), torch.float32)  # fp32: no kernel per row count
    step = QL.GEMM_ROW_STEP
    counts = list(range(-(-(GEMV_MAX_ROWS + 1) // step) * step, 80 + 1, step))
    assert QL.warm_gemms(model, 80) == 2 * len(counts)
    assert rows == counts + counts


def test_quant_linear_rejects_bad_input():
    m = Int4Linear.from_weight(torch.randn(8, 64), 32)
    with pytest.raises(InputError, match=r"\[\.\.\., 64\]"):
        m(torch.randn(2, 32))
    with pytest.raises(InputError, match="dtype"):
        m(torch.ones(2, 64, dtype=torch.int64))
    with pytest.raises(InputError):
        Int4Linear(64, 8, group_size=48)
    with pytest.raises(InputError):
        Int8Linear.from_linear(nn.Linear(64, 8, bias=True))


# --- quality on heavy-tailed weights --------------------------------------------------------


@pytest.fixture(scope="module")
def heavy_tailed():
    """A 512x512 and a 1792x512 weight with outlier rows / columns and a heavy tail."""
    sd = random_state_dict("5.2", n_layer=1, n_embd=512, vocab_size=256, head_size=64, outliers=True, seed=1)
    return [sd["blocks.0.att.key.weight"], sd["blocks.0.ffn.key.weight"]]


# Relative RMS output error bounds, module defaults (column scales on). Measured on these
# matrices: int8 per channel 0.0077, g128 0.0064, int4 g32 0.077, g64 0.085, g128 0.094;
# without column scales 0.024, 0.016, 0.093, 0.136, 0.17 (benchmarks/bench_kernels.py --only errors).
ERROR_BOUNDS = [
    ("int8 per channel", lambda w: Int8Linear.from_weight(w), 0.012),
    ("int8 g128", lambda w: Int8Linear.from_weight(w, 128), 0.01),
    ("int4 g32", lambda w: Int4Linear.from_weight(w, 32), 0.095),
    ("int4 g64", lambda w: Int4Linear.from_weight(w, 64), 0.105),
    ("int4 g128", lambda w: Int4Linear.from_weight(w, 128), 0.115),
]


@pytest.mark.parametrize("name,make,bound", ERROR_BOUNDS)
def test_quantization_error_on_heavy_tailed_weights(heavy_tailed, name, make, bound):
    g = torch.Generator().manual_seed(5)
    for w in heavy_tailed:
        x = torch.randn(16, w.shape[1], generator=g)
        err = rel_rms(make(w)(x), x @ w.T)
        assert err < bound, (name, err)


@pytest.mark.parametrize(
    "make",
    [lambda w, c: Int8Linear.from_weight(w, 128, col_scale=c), lambda w, c: Int4Linear.from_weight(w, 32, col_scale=c)],
)
def test_column_scales_lower_the_error(heavy_tailed, make):
    w = heavy_tailed[0]
    x = torch.randn(16, w.shape[1])
    with_c, without = make(w, True), make(w, False)
    assert torch.equal(without.col_scales, torch.ones_like(without.col_scales))
    assert not torch.equal(with_c.col_scales, without.col_scales)
    assert rel_rms(with_c(x), x @ w.T) < 0.9 * rel_rms(without(x), x @ w.T)


def test_column_scales():
    w = torch.randn(64, 96)
    w[:, 3] *= 10
    w[:, 5] = 0
    c = P.column_scales(w)
    assert c.dtype == torch.float16 and c.shape == (96,)
    assert c[3] > 5 * c[4] and c[5] > 0
    assert abs(c.float().mean().item() - 1) < 0.05
    q, s = P.quantize_int8(w, 32, c)
    assert rel_rms(P.dequantize_int8(q, s, col_scales=c), w) < 0.01


def test_asymmetric_int4_beats_symmetric(heavy_tailed):
    w = heavy_tailed[0]
    x = torch.randn(16, w.shape[1])
    ref = x @ w.T
    asym = rel_rms(x @ P.dequantize_int4(*P.quantize_int4(w, 32)).T, ref)
    sym = rel_rms(x @ P.dequantize_int4(*P.quantize_int4(w, 32, symmetric=True)).T, ref)
    assert asym < 0.85 * sym


# --- schemes and quantize_model -------------------------------------------------------------


class _Att(nn.Module):
    def __init__(self, C):
        super().__init__()
        for n in ("key", "value", "receptance", "gate", "output"):
            setattr(self, n, nn.Linear(C, C, bias=False))


class _Ffn(nn.Module):
    def __init__(self, C, F_):
        super().__init__()
        self.key = nn.Linear(C, F_, bias=False)
        self.value = nn.Linear(F_, C, bias=False)
        self.receptance = nn.Linear(C, C, bias=False)


class _Block(nn.Module):
    def __init__(self, C, F_):
        super().__init__()
        self.att = _Att(C)
        self.ffn = _Ffn(C, F_)
        self.lora = nn.Linear(C, 16, bias=False)  # small: kept
        self.ln = nn.LayerNorm(C)


class _Model(nn.Module):
    """The module names of the real model: blocks.{i}.att.*, blocks.{i}.ffn.*, head."""

    def __init__(self, C=128, F_=512, V=512, L=2):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([_Block(C, F_) for _ in range(L)])
        self.head = nn.Linear(C, V, bias=False)
        self.biased = nn.Linear(C, C)  # has a bias: kept

    def forward(self, x):
        for b in self.blocks:
            x = b.ffn.value(torch.relu(b.ffn.key(b.att.output(b.att.key(x)))))
        return self.head(x)


@pytest.fixture(autouse=True)
def _small_matrices_count(monkeypatch):
    """The test model is 128 wide: lower the default policy's size threshold to match."""
    from rwkv_engine.quant import schemes

    monkeypatch.setattr(schemes, "MIN_QUANT_WEIGHTS", 128 * 128)


_PARTS = ("att.key", "att.value", "att.receptance", "att.gate", "att.output", "ffn.key", "ffn.value", "ffn.receptance")
BODY = [f"blocks.{i}.{p}" for i in range(2) for p in _PARTS]
BODY2 = [f"blocks.2.{p}" for p in _PARTS]  # the third block of _Model(L=3)


def test_quantize_model_q4_swaps_the_right_modules():
    m = _Model(L=3)
    x = torch.randn(2, 128)
    ref = m(x)
    report = quantize_model(m, "q4")
    assert set(report) == set(BODY + BODY2) | {"head"}
    for name in BODY + BODY2:
        mod = m.get_submodule(name)
        if not name.startswith("blocks.2."):  # the first two blocks and the head stay at 8 bits
            assert isinstance(mod, Int8Linear) and mod.group_size == 32, name
        else:
            assert isinstance(mod, Int4Linear) and mod.group_size == 32, name
    assert isinstance(m.head, Int8Linear) and m.head.group_size == 32
    assert type(m.blocks[0].lora) is nn.Linear and type(m.biased) is nn.Linear
    assert type(m.emb) is nn.Embedding
    assert rel_rms(m(x), ref) < 0.2


def test_q4_policy_keeps_leading_blocks_by_index():
    assert schemes.Q4_Q8_BLOCKS == 2
    q4 = get_scheme("q4")
    big = nn.Linear(512, 512, bias=False)
    assert [schemes.default_action(f"blocks.{i}.att.key", big, q4) for i in (0, 1, 2, 10, 11)] == [
        "q8",
        "q8",
        "q4",
        "q4",
        "q4",
    ]
    assert schemes.default_action("head", big, q4) == "q8"
    assert schemes.default_action("blocks.x.att.key", big, q4) == "q4"  # not a block index: no special case


def test_quantize_model_q8_and_group_sizes():
    m = _Model()
    quantize_model(m, "q8")
    assert isinstance(m.head, Int8Linear) and m.blocks[1].att.key.group_size == 32
    m = _Model()
    quantize_model(m, "q8", group_size=-1)
    assert m.blocks[1].ffn.value.scales.shape == (128, 1)
    assert type(m.blocks[0].ffn.value) is DenseLinear and m.blocks[0].ffn.value.weight.dtype == torch.bfloat16
    m = _Model(L=3)
    quantize_model(m, "q4", group_size=128)
    assert m.blocks[2].ffn.value.group_size == 128 and m.head.group_size == 32
    assert m.blocks[1].ffn.value.group_size == 32  # 8 bits (group 32) under the default policy


@pytest.mark.parametrize("name,dtype", [("q0f32", torch.float32), ("q0bf16", torch.bfloat16), ("q0f16", torch.float16)])
def test_quantize_model_q0_casts_linears(name, dtype):
    m = _Model()
    report = quantize_model(m, name)
    assert set(report) == set(BODY) | {"head"}
    assert type(m.head) is DenseLinear and m.head.weight.dtype == dtype
    assert get_scheme(name).dtype == dtype


def test_quantize_model_policy_overrides():
    m = _Model()
    report = quantize_model(m, "q4", policy={"blocks.1.*": "keep", "head": "q0bf16", "blocks.0.lora": "q8"})
    assert not any(k.startswith("blocks.1.") for k in report)
    assert type(m.blocks[1].att.key) is nn.Linear
    assert type(m.head) is DenseLinear and m.head.weight.dtype == torch.bfloat16
    assert isinstance(m.blocks[0].lora, Int8Linear)
    m = _Model()
    quantize_model(m, "q8", policy=lambda name, mod: "q4" if name.endswith("ffn.key") else None)
    assert isinstance(m.blocks[0].ffn.key, Int4Linear) and isinstance(m.blocks[1].ffn.value, Int8Linear)


def test_mlc_aliases():
    s = get_scheme("q4f16_1")
    assert (s.name, s.weights, s.group_size, s.dtype) == ("q4", "int4", 32, torch.float16)
    assert get_scheme("q4f32_1").dtype == torch.float32
    assert get_scheme("Q8F16_1").weights == "int8"
    assert get_scheme("q0bf16").dtype == torch.bfloat16
    assert {"q0f32", "q0bf16", "q0f16", "q8", "q4", "q4f16_1", "q4f32_1", "q8f16_1"} <= set(scheme_names())


@pytest.mark.parametrize(
    "scheme,group_size",
    [("q5", None), ("q4f16_9", None), ("q4", 48), ("q4", 0), ("q8", 0), ("q0bf16", 32), (3, None), ("q4", 32.0)],
)
def test_bad_schemes_raise_input_error(scheme, group_size):
    with pytest.raises(InputError):
        quantize_model(_Model(), scheme, group_size)


def test_group_size_not_dividing_width_changes_nothing():
    m = _Model(C=192, F_=768, L=3)  # 192 % 128 = 64 (block 2 is int4)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(InputError, match="does not divide"):
        quantize_model(m, "q4", group_size=128)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    with pytest.raises(InputError, match="policy"):
        quantize_model(m, "q4", policy={"head": object()})


def test_quantize_model_empty_on_meta_then_load():
    src = _Model()
    quantize_model(src, "q4")
    sd = src.state_dict()
    with torch.device("meta"):
        dst = _Model()
    quantize_model(dst, "q4", empty=True)
    dst.load_state_dict(sd, assign=True)
    x = torch.randn(1, 128)
    assert torch.equal(src(x), dst(x))


def test_load_of_a_model_too_small_to_quantize_says_so(tmp_path, capsys):
    """R10: q4 of a model whose matrices are all below the policy's size quantized nothing, yet
    the model said q4: it says what it holds, and why, on stderr."""
    import rwkv_engine
    from rwkv_engine import testing

    path = testing.save_pth(testing.random_state_dict("7", n_layer=2, n_embd=32, vocab_size=256), tmp_path / "m.pth")
    capsys.readouterr()
    model = rwkv_engine.load(path, quantization="q4")
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules())
    assert model.quantization.weights == "dense" and model.quantization.dtype == model.dtype
    assert f"q4: {schemes.NOTHING_QUANTIZED}" in capsys.readouterr().err
    assert schemes.quantization_note("q4", model.quantization) == schemes.NOTHING_QUANTIZED
    big = testing.save_pth(testing.random_state_dict("7", n_layer=2, n_embd=32, vocab_size=2048), tmp_path / "b.pth")
    model = rwkv_engine.load(big, quantization="q4")  # its head (2048 x 32) is quantized
    assert model.quantization.name == "q4" and "nothing quantized" not in capsys.readouterr().err
    assert schemes.quantization_note("q4", model.quantization) is None
