"""Each kernel against its naive reference: odd lengths, extreme decays, non-zero initial state."""

import pytest
import torch

from rwkv_engine.kernels import wkv4, wkv4_reference, wkv5, wkv5_chunked, wkv5_export, wkv5_naive, wkv7

from .conftest import rel_rms


def _inputs(B, T, H, N, decay_range, seed=0, per_token=False):
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, generator=g) for _ in range(3))
    shape = (B, T, H, N) if per_token else (H, N)
    # log_w = -exp(x): x = -9 is a decay of 0.9999, x = 4 a decay of e^-55 (underflows to 0 in fp32).
    log_w = -torch.exp(torch.empty(shape).uniform_(*decay_range, generator=g))
    u = torch.randn(H, N, generator=g)
    state = torch.randn(B, H, N, N, generator=g)
    return r, k, v, log_w, u, state


DECAYS = {"mixed": (-9.0, 4.0), "near_one": (-12.0, -8.0), "near_zero": (2.5, 4.5)}


@pytest.mark.parametrize("T", [1, 7, 65, 300])
@pytest.mark.parametrize("decays", sorted(DECAYS))
@pytest.mark.parametrize("per_token", [False, True], ids=["constant", "per_token"])
def test_wkv5_chunked_matches_naive(T, decays, per_token):
    r, k, v, log_w, u, state = _inputs(2, T, 3, 16, DECAYS[decays], seed=T, per_token=per_token)
    y_ref, s_ref = wkv5_naive(*(t.double() for t in (r, k, v, log_w, u, state)))
    for fn in (wkv5_chunked, wkv5, wkv5_export):
        y, s = fn(r, k, v, log_w, u, state)
        assert y.shape == (2, T, 3, 16) and s.shape == (2, 3, 16, 16)
        assert torch.isfinite(y).all() and torch.isfinite(s).all()
        assert rel_rms(y, y_ref) < 1e-5
        assert rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_wkv5_chunk_size_does_not_change_result(chunk):
    r, k, v, log_w, u, state = _inputs(1, 37, 2, 8, DECAYS["mixed"], seed=1)
    y_ref, s_ref = wkv5_naive(r, k, v, log_w, u, state)
    y, s = wkv5_chunked(r, k, v, log_w, u, state, chunk=chunk)
    assert rel_rms(y, y_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("per_token", [False, True], ids=["constant", "per_token"])
def test_wkv5_split_at_a_chunk_boundary_is_bit_identical(per_token):
    # Prefill in pieces (the server) must give the bits of one call (generate): a last piece of
    # one partial chunk, of one whole chunk and of several, each against the same tokens in one call.
    for tail in (17, 20, 31, 32, 45, 64, 75):
        r, k, v, log_w, u, state = _inputs(1, 128 + tail, 2, 16, DECAYS["mixed"], seed=tail, per_token=per_token)
        y, s = wkv5(r, k, v, log_w, u, state)
        w = (lambda a, b: log_w[:, a:b]) if per_token else (lambda a, b: log_w)
        y1, s1 = wkv5(r[:, :128], k[:, :128], v[:, :128], w(0, 128), u, state)
        y2, s2 = wkv5(r[:, 128:], k[:, 128:], v[:, 128:], w(128, None), u, s1)
        assert torch.equal(torch.cat([y1, y2], dim=1), y) and torch.equal(s2, s), tail


def test_wkv5_does_not_modify_inputs():
    args = _inputs(1, 20, 2, 8, DECAYS["mixed"])
    before = [a.clone() for a in args]
    wkv5(*args)
    wkv5_naive(*args)
    for a, b in zip(args, before):
        assert torch.equal(a, b)


def test_wkv5_naive_is_the_recurrence():
    """The spec itself, checked by hand on one head: y = r (u k v^T + S), S <- w S + k v^T."""
    r, k, v, log_w, u, S = _inputs(1, 3, 1, 4, DECAYS["mixed"], seed=5)
    y, S_out = wkv5_naive(r, k, v, log_w, u, S)
    w = torch.exp(log_w[0])
    s = S[0, 0].clone()
    for t in range(3):
        kv = torch.outer(k[0, t, 0], v[0, t, 0])
        assert torch.allclose(y[0, t, 0], r[0, t, 0] @ (u[0][:, None] * kv + s), atol=1e-5)
        s = w[:, None] * s + kv
    assert torch.allclose(S_out[0, 0], s, atol=1e-5)


@pytest.mark.parametrize("T", [1, 7, 65])
@pytest.mark.parametrize("decays", [(-9.0, -7.0), (-6.0, 2.0), (2.0, 3.5)])
def test_wkv4_matches_direct_formula(T, decays):
    g = torch.Generator().manual_seed(T)
    B, C = 2, 16
    k = 3 * torch.randn(B, T, C, generator=g)
    v = torch.randn(B, T, C, generator=g)
    w = -torch.exp(torch.empty(C).uniform_(*decays, generator=g))
    u = torch.randn(C, generator=g)
    num, den, mx = torch.randn(B, C, generator=g), torch.rand(B, C, generator=g) + 0.1, torch.randn(B, C, generator=g)
    y, *_ = wkv4(k, v, w, u, num, den, mx)
    assert rel_rms(y, wkv4_reference(k, v, w, u, num, den, mx)) < 1e-5


def test_wkv4_large_keys_stay_finite():
    """k of +-80 overflows exp() in fp32; the log-space form must not."""
    B, T, C = 1, 50, 8
    k = torch.linspace(-80, 80, T)[None, :, None].expand(B, T, C).contiguous()
    v = torch.randn(B, T, C)
    w, u = -torch.ones(C), torch.zeros(C)
    fresh = (torch.zeros(B, C), torch.zeros(B, C), torch.full((B, C), -1e30))
    y, num, den, mx = wkv4(k, v, w, u, *fresh)
    assert torch.isfinite(y).all() and torch.isfinite(num).all() and torch.isfinite(den).all()
    assert (
        rel_rms(y, wkv4_reference(k, v, w, u, torch.zeros(B, C), torch.zeros(B, C), torch.full((B, C), -1e30))) < 1e-5
    )


class _Kernels(torch.nn.Module):
    def forward(self, r, k, v, log_w, u, a, b, state):
        return wkv5(r, k, v, log_w, u, state), wkv7(r, k, v, log_w, a, b, state)


@pytest.mark.parametrize("T", [1, 8])
def test_export_forms_are_picked_under_torch_export(T):
    """Under torch.export the dispatchers give graphs of ops ExecuTorch has: no diagonal_scatter
    (in-place diagonal writes), no cumsum / flip / triangular solve; the results are the kernels'."""
    r, k, v, log_w, u, state = _inputs(1, T, 2, 8, DECAYS["mixed"], per_token=True)
    a, b = -torch.nn.functional.normalize(k, dim=-1), torch.nn.functional.normalize(k, dim=-1) * 0.5
    args = (r, k, v, log_w, u, a, b, state)
    ep = torch.export.export(_Kernels(), args)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not [op for op in ops if any(bad in op for bad in ("scatter", "cumsum", "flip", "linalg", "copy_"))], ops
    for got, want in zip(ep.module()(*args), _Kernels()(*args)):
        assert rel_rms(got[0], want[0]) < 1e-5 and rel_rms(got[1], want[1]) < 1e-5


def test_mean_norm_is_layer_norm_and_group_norm():
    from rwkv_engine.models.layers import mean_norm

    x = torch.randn(2, 5, 64) * 3 + 1
    w, b = torch.randn(64), torch.randn(64)
    assert rel_rms(mean_norm(x, 1, w, b, 1e-5), torch.nn.functional.layer_norm(x, (64,), w, b, 1e-5)) < 1e-6
    ref = torch.nn.functional.group_norm(x.reshape(10, 64), 4, w, b, eps=64e-5).view(2, 5, 64)
    assert rel_rms(mean_norm(x, 4, w, b, 64e-5), ref) < 1e-6
