"""K-quants (ggml's Q4_K, Q5_K, Q6_K) executed from their blocks: the native decoder against the
`gguf` package bit for bit, the native GEMV against x (rounded as the format's decode rounds it)
times the dequantized weight, batched = alone bit for bit, NaN in -> NaN out, and KQuantLinear's
three paths (decode, prefill, plain PyTorch) against each other.

Blocks are random bytes with finite fp16 scales: every byte pattern is a valid block.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rwkv_engine.errors import InputError
from rwkv_engine.kernels import native
from rwkv_engine.quant import primitives as P
from rwkv_engine.quant.kquant_linear import KQUANT_TYPES, KQuantLinear, block_bytes, ktype_id, x_group
from rwkv_engine.quant.linear import prefill_dtype

from .conftest import rel_rms

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf import quants as gq  # noqa: E402

ops = native.load()
needs_native = pytest.mark.skipif(ops is None, reason="native kernels unavailable here (see log)")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-3, torch.float16: 6e-4}  # output rounding + fp32 sums


def random_blocks(qtype: str, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """uint8 [N, K / 256 * block bytes]: random bytes, the fp16 scale fields finite (|d| <= 0.01)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // 256, block_bytes(qtype)), dtype=np.uint8)
    for o in [208] if qtype == "Q6_K" else [0, 2]:
        raw[:, :, o : o + 2] = np.float16(rng.uniform(-0.01, 0.01, (N, K // 256, 1))).view(np.uint8)
    return torch.from_numpy(raw.reshape(N, -1))


def gguf_weight(qtype: str, blocks: torch.Tensor, K: int) -> torch.Tensor:
    """The `gguf` package's values of the blocks, fp32 [N, K]."""
    return torch.from_numpy(gq.dequantize(blocks.numpy(), GT[qtype]).reshape(blocks.shape[0], K))


def spec(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None = None, block: int = 32) -> torch.Tensor:
    """The integer kernel's math: x times the column scales, rounded to int8 per `block` columns
    (the decode GEMV's 32; kq_x_group), times w (fp64)."""
    xs = x.float() if c is None else x.float() * c.float()
    return P.round_activations_int8(xs, block).double() @ w.double().T


@needs_native
@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_native_dequant_is_gguf_bit_for_bit(qtype):
    N, K = 9, 512
    blocks = random_blocks(qtype, N, K, seed=ktype_id(qtype))
    want = gguf_weight(qtype, blocks, K)
    for dt in DTYPES:
        assert torch.equal(ops.dequant_kq(blocks, ktype_id(qtype), K, 0, N, dt), want.to(dt)), dt
    out = torch.empty(5, K, dtype=torch.bfloat16)
    tile = ops.dequant_kq(blocks, ktype_id(qtype), K, 3, 8, torch.bfloat16, out)
    assert tile.data_ptr() == out.data_ptr() and torch.equal(out, want[3:8].bfloat16())
    # the module's plain path (quant/ggml_quants.py) gives the same values
    assert torch.equal(KQuantLinear.from_blocks(qtype, blocks, (N, K)).dequantize(), want)


@needs_native
@pytest.mark.parametrize("qtype", KQUANT_TYPES)
@pytest.mark.parametrize("N,K", [(37, 256), (5, 768), (64, 2048)])
def test_gemv_kq_matches_reference(qtype, N, K):
    g = torch.Generator().manual_seed(N + K)
    blocks = random_blocks(qtype, N, K, seed=N)
    w = gguf_weight(qtype, blocks, K)
    c = (torch.rand(K, generator=g) * 3 + 0.2).half()
    # every batch size of a pass (1-8 rows of x) and two passes; each dtype of x, with and
    # without column scales
    # and more than GEMV_MAX_ROWS rows (a prefill piece)
    cases = [
        (1, 0, None),
        (2, 1, c),
        (3, 2, None),
        (5, 0, c),
        (8, 1, None),
        (11, 2, c),
        (4, 0, c),
        (17, 0, c),
        (40, 1, None),
    ]
    for B, d, cs in cases:
        xdt = DTYPES[d]
        x = torch.randn(B, K, generator=g).to(xdt)
        y = ops.gemv_kq(x, blocks, ktype_id(qtype), K, cs)
        assert y.dtype == xdt and y.shape == (B, N)
        block = ops.kq_x_group(ktype_id(qtype), B)
        assert block == 32 or B > native.GEMV_MAX_ROWS, (qtype, B)  # decode batches: per 32 everywhere
        assert rel_rms(y, spec(x, w, cs, block)) < TOL[xdt], (B, xdt, cs is None)
        # and the rounding of x is small next to any 4-6 bit format's own error
        xs = x.double() if cs is None else x.double() * cs.double()
        assert rel_rms(y, xs @ w.double().T) < 2e-2


@needs_native
def test_gemv_kq_rows_of_a_batch_equal_each_row_alone():
    # Up to GEMV_MAX_ROWS rows (a decode batch) each row has the bits it gets alone; past it (a
    # prefill piece) a row's bits do not depend on which rows share its call either, or a prompt's
    # tokens would depend on where it is cut into pieces.
    N, K = 30, 2304
    g = torch.Generator().manual_seed(4)
    x = torch.randn(57, K, generator=g)
    for qtype in KQUANT_TYPES:
        blocks = random_blocks(qtype, N, K, seed=5)
        f = lambda x, b=blocks, t=ktype_id(qtype): ops.gemv_kq(x, b, t, K)  # noqa: E731
        alone = torch.cat([f(x[i : i + 1]) for i in range(16)])
        for B in (2, 3, 4, 5, 8, 9, 16):
            assert torch.equal(f(x[:B]), alone[:B]), (qtype, B)
        y = f(x)
        for a, b in ((0, 17), (3, 40), (20, 57), (17, 34)):
            assert torch.equal(f(x[a:b]), y[a:b]), (qtype, a, b)


@needs_native
@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_prefill_on_the_avx2_level_rounds_x_per_256_columns(qtype):
    """The AVX2 level's K-quant prefill (more than GEMV_MAX_ROWS rows) rounds x per 256 columns, as
    ggml's Q8_K (kernels.cpp gemv_kq_prefill); its decode batches keep 32."""
    why = dict((lv.name, why) for lv, why in native.supported_levels()).get("avx2", "not an x86 machine")
    if why:
        pytest.skip(f"avx2 level: {why}")
    N, K, B, t = 37, 1024, 41, ktype_id(qtype)
    blocks = random_blocks(qtype, N, K, seed=11)
    w = gguf_weight(qtype, blocks, K)
    x = torch.randn(B, K, generator=torch.Generator().manual_seed(12))
    x[:, 5] *= 30  # an outlier column, where the two roundings differ most
    with native.using("avx2"):
        assert ops.kq_x_group(t, B) == 256 and ops.kq_x_group(t, native.GEMV_MAX_ROWS) == 32
        y = ops.gemv_kq(x, blocks, t, K)
        alone = ops.gemv_kq(x[3:4], blocks, t, K)
    assert rel_rms(y, spec(x, w, None, 256)) < 2e-5
    assert rel_rms(y, spec(x, w, None, 32)) > 1e-3  # not the decode kernel's rounding
    assert rel_rms(alone, spec(x[3:4], w)) < 2e-5


@needs_native
def test_gemv_kq_threads_give_identical_results():
    N, K = 1030, 2048
    blocks = {t: random_blocks(t, N, K, seed=6) for t in KQUANT_TYPES}
    xs = [torch.randn(3, K), torch.randn(40, K)]  # a decode batch and a prefill piece
    old = torch.get_num_threads()
    try:
        out = {}
        for nt in (1, 2):
            torch.set_num_threads(nt)
            out[nt] = [ops.gemv_kq(x, b, ktype_id(t), K) for t, b in blocks.items() for x in xs]
    finally:
        torch.set_num_threads(old)
    for a, b in zip(out[1], out[2]):
        assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_kq_nan_or_inf_in_x_gives_non_finite_rows(dtype):
    K, N = 512, 24
    for B in (3, 20):  # a decode batch, a prefill piece
        x = torch.randn(B, K).to(dtype)
        x[0, 70] = float("nan")
        x[1, 300] = float("inf")
        for qtype in KQUANT_TYPES:
            blocks = random_blocks(qtype, N, K, seed=7)
            y = ops.gemv_kq(x, blocks, ktype_id(qtype), K)
            assert not torch.isfinite(y[:2]).any(), qtype
            assert torch.isfinite(y[2:]).all(), qtype
            if B == 3:
                assert torch.equal(y[2:], ops.gemv_kq(x[2:], blocks, ktype_id(qtype), K)), qtype


@needs_native
def test_kernels_reject_bad_blocks():
    blocks = random_blocks("Q4_K", 4, 512)
    with pytest.raises(RuntimeError, match="K = 512"):
        ops.gemv_kq(torch.randn(1, 256), blocks, 12, 512)
    with pytest.raises(RuntimeError, match=r"blocks must be uint8 \[N, 352\]"):
        ops.gemv_kq(torch.randn(1, 512), blocks, 13, 512)
    with pytest.raises(RuntimeError, match="ggml type must be"):
        ops.gemv_kq(torch.randn(1, 512), blocks, 8, 512)
    with pytest.raises(RuntimeError, match="whole blocks of 256"):
        ops.dequant_kq(blocks, 12, 500, 0, 1, torch.float32)
    with pytest.raises(RuntimeError, match="row range"):
        ops.dequant_kq(blocks, 12, 512, 2, 9, torch.float32)


def test_module_constructor_checks():
    with pytest.raises(InputError, match="Q4_K, Q5_K, Q6_K"):
        KQuantLinear(256, 4, "Q4_0")
    with pytest.raises(InputError, match="multiple of 256"):
        KQuantLinear(200, 4, "Q6_K")
    with pytest.raises(InputError, match=r"uint8 \(4, 288\)"):
        KQuantLinear.from_blocks("Q4_K", torch.zeros(4, 287, dtype=torch.uint8), (4, 512))
    with pytest.raises(InputError, match="col_scales"):
        KQuantLinear.from_blocks("Q4_K", random_blocks("Q4_K", 4, 256), (4, 256), torch.ones(256))
    m = KQuantLinear.from_blocks(14, random_blocks("Q6_K", 4, 512), (4, 512))
    assert m.qtype == "Q6_K" and "qtype=Q6_K" in repr(m)


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_module_paths_agree(qtype, monkeypatch):
    """Decode (native GEMV), prefill (native tiles + GEMM) and the plain PyTorch path (the
    specification), for fp32 and bf16 x and several tokens per row."""
    N, K = 48, 512
    g = torch.Generator().manual_seed(8)
    c = (torch.rand(K, generator=g) + 0.5).half()
    m = KQuantLinear.from_blocks(qtype, random_blocks(qtype, N, K, seed=9), (N, K), c)
    w = m.dequantize()
    assert torch.equal(w, gguf_weight(qtype, m.qweight, K) * c.float())
    for shape in ((1, K), (3, 4, K), (40, K)):  # decode, 4 tokens per row (12 rows), prefill
        x = torch.randn(*shape, generator=g)
        y = m(x)
        assert y.shape == (*shape[:-1], N)
        x2 = x.reshape(-1, K)
        # prefill where the GEMM would be fp32: the integer kernel's math (kquant_linear docstring),
        # x rounded per kq_x_group columns of the kernels in use (32 without them)
        rounded = x2.shape[0] <= native.GEMV_MAX_ROWS or prefill_dtype(torch.bfloat16) == torch.float32
        exact = x2.double() @ w.double().T

        def want(block):
            return spec(x2, w / c.float(), c, block) if rounded else exact

        block = x_group(qtype, x2.shape[0])
        assert rel_rms(y.reshape(-1, N), want(block)) < 2e-5, shape
        with monkeypatch.context() as mp:  # the plain path, with and without the kernels' rounding
            mp.setattr(m, "_native_ok", lambda: False)
            assert rel_rms(m(x).reshape(-1, N), want(block)) < 2e-5, shape
            mp.setattr(native, "load", lambda *a, **k: None)
            assert rel_rms(m(x).reshape(-1, N), want(32)) < 2e-5, shape
        yb = m(x.bfloat16())
        assert yb.dtype == torch.bfloat16 and rel_rms(yb.reshape(-1, N), want(block)) < 1e-2
    # state dict round trip into an empty module of the same type
    empty = KQuantLinear(K, N, qtype)
    empty.load_state_dict(m.state_dict())
    assert torch.equal(empty(x), m(x))


# --- the fused decode step (models/native_step.py) with K-quant weights ------------------------

STEP_VOCAB = 300


@pytest.fixture(scope="module")
def kquant_models(tmp_path_factory):
    """{version: path} of small random checkpoints whose matrices are 256 wide (K-quant rows)."""
    from rwkv_engine import testing

    d = tmp_path_factory.mktemp("kquant_step")
    return {
        v: testing.save_pth(
            testing.random_state_dict(v, n_layer=2, n_embd=256, vocab_size=STEP_VOCAB, head_size=64, seed=21),
            d / f"v{v}.pth",
        )
        for v in ("7", "6.0")
    }


def _kquantized(path, dtype):
    """The checkpoint with every linear of a K-quant width as KQuantLinear, the three types in
    turn (a mixed file: each matrix in its own type), made by the test quantizer of ggml_writers."""
    import rwkv_engine
    from rwkv_engine.quant.schemes import replace_module
    from rwkv_engine.testing.ggml_writers import quantize

    model = rwkv_engine.load(path, dtype=dtype, progress=False)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.in_features % 256 == 0]
    for i, name in enumerate(names):
        w = model.get_submodule(name).weight.detach().float()
        qtype = KQUANT_TYPES[i % 3]
        blocks = torch.from_numpy(quantize(w.numpy(), qtype))
        replace_module(model, name, KQuantLinear.from_blocks(qtype, blocks, tuple(w.shape)))
    assert len(names) >= 8
    return model


@needs_native
@pytest.mark.parametrize("version,dtype", [("7", "bf16"), ("6.0", "fp32")])
def test_native_step_with_kquant_weights_matches_pytorch_modules(kquant_models, version, dtype):
    model = _kquantized(kquant_models[version], dtype)
    g = torch.Generator().manual_seed(5)
    _, state = model.forward(torch.randint(0, STEP_VOCAB, (3, 5), generator=g))
    tokens = torch.randint(0, STEP_VOCAB, (3, 3), generator=g)
    out = {}
    for native_decode in (True, False):
        model.native_decode = native_decode
        steps, st = [], state
        for t in range(3):
            logits, st = model.forward(tokens[:, t : t + 1], st)
            steps.append(logits)
        # the same tokens as one pass (a speculative verify pass: one read of the weights)
        out[native_decode] = (torch.stack(steps, 1), st, model.forward(tokens, state, all_logits=True))
    model.native_decode = True
    assert model._native_step[1] is not None, "the native step was not used"
    # Both paths round x to int8 per 32 columns; where x differs in its last bit between them (the
    # fp32 LoRA GEMMs of RWKV-6 run in MKL on one side), a value can land on the next step: one
    # row of three was 3e-3 off on a Zen 4 (family 25 model 17), the others 2e-7.
    tol = 1e-2 if dtype == "fp32" else 2e-2
    (ln, sn, (pn, psn)), (lt, stt, (pt, pst)) = out[True], out[False]
    for a, b in ((ln, lt), (pn, pt), (sn.att_kv, stt.att_kv), (psn.att_kv, pst.att_kv)):
        assert rel_rms(a, b) < tol
    # a pass gives the bits of one-token steps, and each row the bits it gets alone
    assert torch.equal(pn, ln)
    for i in range(3):
        alone, ast = model.forward(tokens[i : i + 1], state[i : i + 1], all_logits=True)
        assert torch.equal(alone[0], pn[i]) and torch.equal(ast.att_kv[0], psn.att_kv[i])


@needs_native
def test_native_step_with_kquant_weights_nan_state_gives_nan_logits(kquant_models):
    model = _kquantized(kquant_models["7"], "fp32")
    _, state = model.forward(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    state = state.clone()
    state.att_kv[0] = float("nan")
    logits, _ = model.forward(torch.tensor([[7], [8]]), state)
    assert model._native_step[1] is not None
    assert torch.isnan(logits[0]).all() and torch.isfinite(logits[1]).all()
