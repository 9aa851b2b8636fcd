"""RWKV-7 WKV: the chunked form against the naive recurrence; the recurrence against the definition."""

import pytest
import torch
import torch.nn.functional as F

from rwkv_engine.kernels import wkv7, wkv7_chunked, wkv7_export, wkv7_naive

from .conftest import rel_rms

# log_w = -exp(x): x = -12 is a decay of 0.999994, x = 4.5 a decay of e^-90 (0 in fp32).
DECAYS = {"mixed": (-9.0, 4.0), "near_one": (-12.0, -8.0), "near_zero": (2.5, 4.5)}


def _inputs(B, T, H, N, decay_range, seed=0, V=None):
    """RWKV-7's arguments: a = -kk, b = kk * iclr with kk unit-norm per head and iclr in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    V = V or N
    r, k = (torch.randn(B, T, H, N, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    log_w = -torch.exp(torch.empty(B, T, H, N).uniform_(*decay_range, generator=g))
    kk = F.normalize(torch.randn(B, T, H, N, generator=g), dim=-1)
    iclr = torch.rand(B, T, H, N, generator=g)
    state = torch.randn(B, H, N, V, generator=g)
    return r, k, v, log_w, -kk, kk * iclr, state


@pytest.mark.parametrize("T", [1, 7, 65, 300])
@pytest.mark.parametrize("decays", sorted(DECAYS))
def test_wkv7_chunked_matches_naive(T, decays):
    args = _inputs(2, T, 3, 16, DECAYS[decays], seed=T)
    y_ref, s_ref = wkv7_naive(*(t.double() for t in args))
    for fn in (wkv7_chunked, wkv7, wkv7_export):
        y, s = fn(*args)
        assert y.shape == (2, T, 3, 16) and s.shape == (2, 3, 16, 16)
        assert y.dtype == s.dtype == torch.float32
        assert torch.isfinite(y).all() and torch.isfinite(s).all()
        assert rel_rms(y, y_ref) < 1e-5
        assert rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_wkv7_chunk_size_does_not_change_result(chunk):
    args = _inputs(1, 37, 2, 8, DECAYS["mixed"], seed=1)
    y_ref, s_ref = wkv7_naive(*args)
    y, s = wkv7_chunked(*args, chunk=chunk)
    assert rel_rms(y, y_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5


def test_wkv7_split_at_a_chunk_boundary_is_bit_identical():
    # Prefill in pieces (the server) must give the bits of one call (generate): a last piece of
    # one partial chunk, of one whole chunk and of several, each against the same tokens in one call.
    for tail in (17, 20, 22, 31, 32, 45, 64, 75):
        args = _inputs(1, 128 + tail, 2, 16, DECAYS["mixed"], seed=tail)
        *xs, state = args
        y, s = wkv7(*args)
        y1, s1 = wkv7(*(x[:, :128] for x in xs), state)
        y2, s2 = wkv7(*(x[:, 128:] for x in xs), s1)
        assert torch.equal(torch.cat([y1, y2], dim=1), y) and torch.equal(s2, s), tail


def test_wkv7_value_size_differs_from_key_size():
    args = _inputs(2, 40, 2, 8, DECAYS["mixed"], seed=2, V=12)
    y_ref, s_ref = wkv7_naive(*args)
    y, s = wkv7_chunked(*args, chunk=16)
    assert y.shape == (2, 40, 2, 12) and s.shape == (2, 2, 8, 12)
    assert rel_rms(y, y_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5


def test_wkv7_long_sequence_stays_bounded():
    """Slow decays and many tokens: the rank-1 correction keeps the state bounded, in both forms."""
    args = _inputs(1, 2000, 1, 8, DECAYS["near_one"], seed=3)
    y_ref, s_ref = wkv7_naive(*args)
    y, s = wkv7_chunked(*args)
    assert torch.isfinite(s).all() and s.abs().max() < 1e3
    assert rel_rms(y, y_ref) < 1e-4 and rel_rms(s, s_ref) < 1e-4


def test_wkv7_does_not_modify_inputs():
    args = _inputs(1, 40, 2, 8, DECAYS["mixed"])
    before = [a.clone() for a in args]
    wkv7(*args)
    wkv7_naive(*args)
    wkv7_chunked(*args)
    for a, b in zip(args, before):
        assert torch.equal(a, b)


def test_wkv7_naive_is_the_recurrence():
    """The spec by hand on one head, in the rwkv package's orientation P = S^T ([value][key]):
    P <- P diag(w) + (P a) b^T + v k^T,  y = P r  (RWKV_x070_TMix_one)."""
    r, k, v, log_w, a, b, S = _inputs(1, 4, 1, 4, DECAYS["mixed"], seed=5)
    y, S_out = wkv7_naive(r, k, v, log_w, a, b, S)
    P = S[0, 0].T.clone()
    for t in range(4):
        w = torch.exp(log_w[0, t, 0])
        P = P * w[None, :] + torch.outer(P @ a[0, t, 0], b[0, t, 0]) + torch.outer(v[0, t, 0], k[0, t, 0])
        assert torch.allclose(y[0, t, 0], P @ r[0, t, 0], atol=1e-5)
    assert torch.allclose(S_out[0, 0], P.T, atol=1e-5)


def _native_or_skip():
    from rwkv_engine.kernels import native

    ops = native.load()
    if ops is None:
        pytest.skip("native kernels unavailable here (see log)")
    return ops


def _native_wkv7(ops, r, k, v, log_w, a, b, state):
    return ops.wkv7(r, k, v, torch.exp(log_w), a, b, state)


@pytest.mark.parametrize("N", [8, 16, 64, 128])  # 8: the plain loop; the others one of the SIMD widths
@pytest.mark.parametrize("decays", sorted(DECAYS))
def test_native_wkv7_matches_naive(N, decays):
    ops = _native_or_skip()
    args = _inputs(2, 45, 2, N, DECAYS[decays], seed=N)
    y_ref, s_ref = wkv7_naive(*(t.double() for t in args))
    before = [t.clone() for t in args]
    y, s = _native_wkv7(ops, *args)
    assert y.shape == (2, 45, 2, N) and s.shape == (2, 2, N, N) and y.dtype == s.dtype == torch.float32
    assert rel_rms(y, y_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5
    assert all(torch.equal(t, t0) for t, t0 in zip(args, before))  # inputs untouched, the state too


def test_wkv7_uses_the_native_recurrence_on_the_cpu():
    # The dispatcher's result is the native kernel's, bit for bit, at every length (the decode
    # step's one token and a prefill's many), and pieces give the bits of one call.
    ops = _native_or_skip()
    for T in (1, 5, 16, 100):
        args = _inputs(1, T, 2, 64, DECAYS["mixed"], seed=T)
        y, s = wkv7(*args)
        y_n, s_n = _native_wkv7(ops, *args)
        assert torch.equal(y, y_n) and torch.equal(s, s_n), T
    *xs, state = _inputs(1, 100, 2, 64, DECAYS["mixed"], seed=7)
    y, s = wkv7(*xs, state)
    y1, s1 = wkv7(*(x[:, :3] for x in xs), state)
    y2, s2 = wkv7(*(x[:, 3:] for x in xs), s1)
    assert torch.equal(torch.cat([y1, y2], dim=1), y) and torch.equal(s2, s)


def test_native_wkv7_rows_of_a_batch_equal_each_row_alone():
    # The server's promise: a sequence batched with others gets the bits it gets alone.
    ops = _native_or_skip()
    args = _inputs(3, 40, 4, 64, DECAYS["mixed"], seed=11)
    y, s = _native_wkv7(ops, *args)
    for row in range(3):
        y1, s1 = _native_wkv7(ops, *(t[row : row + 1].contiguous() for t in args))
        assert torch.equal(y1[0], y[row]) and torch.equal(s1[0], s[row]), row


def test_native_wkv7_rejects_bad_shapes():
    ops = _native_or_skip()
    r, k, v, log_w, a, b, state = _inputs(1, 4, 2, 16, DECAYS["mixed"])
    with pytest.raises(RuntimeError, match="state must be"):
        ops.wkv7(r, k, v, log_w, a, b, state[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="must be float32"):
        ops.wkv7(r, k.double(), v, log_w, a, b, state)
