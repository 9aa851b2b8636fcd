"""Forward semantics: prefill == token by token == chunks with carried state; batching; State; dtypes."""

import os

import pytest
import torch

import rwkv_engine
from rwkv_engine import State, testing
from rwkv_engine.errors import InputError, StateError
from rwkv_engine.models import model as model_module

from .conftest import rel_rms

VERSIONS = ["4", "5.2"]


@pytest.fixture(scope="module", params=VERSIONS)
def model(request, tmp_path_factory):
    sd = testing.random_state_dict(request.param, n_layer=2, n_embd=64, vocab_size=300, head_size=16, seed=7)
    return rwkv_engine.load(testing.save_pth(sd, tmp_path_factory.mktemp("m") / "m.pth"))


def tokens(n, seed=0):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_equals_token_by_token_equals_chunks(model):
    ids = tokens(97)
    full_logits, full_state = model.forward(ids, all_logits=True)
    state, step_logits = None, []
    for t in ids:
        lg, state = model.forward([t], state)
        step_logits.append(lg)
    assert rel_rms(torch.stack(step_logits), full_logits) < 1e-5
    assert full_state.allclose(state, rtol=1e-4, atol=1e-5)
    state = None
    for a, b in ((0, 5), (5, 6), (6, 40), (40, 97)):
        lg, state = model.forward(ids[a:b], state)
    assert rel_rms(lg, full_logits[-1]) < 1e-5
    assert full_state.allclose(state, rtol=1e-4, atol=1e-5)


def test_internal_prefill_chunking_is_invisible(model, monkeypatch):
    ids = tokens(150, seed=1)
    ref_logits, ref_state = model.forward(ids, all_logits=True)
    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 16)
    logits, state = model.forward(ids, all_logits=True)
    assert rel_rms(logits, ref_logits) < 1e-5 and ref_state.allclose(state, rtol=1e-4, atol=1e-5)


def test_batched_rows_equal_separate_runs(model):
    rows = [tokens(33, seed=s) for s in range(3)]
    starts = [model.forward(tokens(5, seed=10 + s))[1] for s in range(3)]  # each row its own history
    logits, state = model.forward(torch.tensor(rows), State.cat(starts), all_logits=True)
    assert logits.shape == (3, 33, 300) and state.batch_size == 3
    for i in range(3):
        lg, st = model.forward(rows[i], starts[i], all_logits=True)
        assert rel_rms(logits[i], lg) < 1e-5
        assert state[i].allclose(st, rtol=1e-4, atol=1e-5)
    # one batched decode step
    nxt = torch.tensor([[1], [2], [3]])
    lg_b, _ = model.forward(nxt, state)
    assert lg_b.shape == (3, 300)
    for i in range(3):
        assert rel_rms(lg_b[i], model.forward([i + 1], state[i])[0]) < 1e-5


def test_shapes_and_input_forms(model):
    V = model.config.vocab_size
    a, _ = model.forward([5, 6, 7])
    b, _ = model.forward(torch.tensor([5, 6, 7]))
    c, _ = model.forward(torch.tensor([[5, 6, 7]]))
    assert a.shape == (V,) and c.shape == (1, V) and a.dtype == torch.float32
    assert torch.equal(a, b) and torch.equal(a, c[0])
    assert model.forward([5, 6, 7], all_logits=True)[0].shape == (3, V)


def test_forward_does_not_mutate_state(model):
    _, state = model.forward(tokens(10))
    before = state.clone()
    model.forward(tokens(20, seed=3), state)
    model.forward([4], state)
    assert before.allclose(state, rtol=0, atol=0)


def test_state_operations(model, tmp_path):
    _, s1 = model.forward(tokens(10, 1))
    _, s2 = model.forward(tokens(10, 2))
    both = State.cat([s1, s2])
    assert both.batch_size == 2 and len(both) == 2
    assert both[0].allclose(s1, 0, 0) and both[1].allclose(s2, 0, 0) and both[-1].allclose(s2, 0, 0)
    assert both[0:1].allclose(s1, 0, 0)
    assert both.nbytes == 2 * s1.nbytes > 0
    c = s1.clone()
    c.att_x_prev.add_(1.0)
    assert not c.allclose(s1)
    path = s1.save(tmp_path / "s.state")
    back = State.load(path)
    assert back.allclose(s1, 0, 0) and back.signature == s1.signature
    lg1, _ = model.forward([9], s1)
    lg2, _ = model.forward([9], back)
    assert torch.equal(lg1, lg2)
    with pytest.raises(IndexError):
        both[2]
    fields = set(model.new_state().fields)
    assert {"att_x_prev", "ffn_x_prev"} <= fields


def test_bad_inputs(model, tmp_path):
    V = model.config.vocab_size
    with pytest.raises(InputError, match="empty"):
        model.forward([])
    with pytest.raises(InputError, match=f"token id {V} is outside"):
        model.forward([1, V])
    with pytest.raises(InputError, match="token id -1"):
        model.forward(torch.tensor([-1]))
    with pytest.raises(InputError, match="integers"):
        model.forward(torch.tensor([1.0, 2.0]))
    with pytest.raises(InputError):
        model.forward(["a", "b"])
    with pytest.raises(InputError, match="shape"):
        model.forward(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(StateError, match="batch size"):
        model.forward(torch.tensor([[1], [2]]), model.new_state(1))
    with pytest.raises(StateError, match="not a state file|no such state file"):
        State.load(tmp_path / "missing")
    bad = tmp_path / "bad.state"
    bad.write_text("nope")
    with pytest.raises(StateError):
        State.load(bad)


def test_state_from_another_model(tmp_path, make_pth):
    m4 = rwkv_engine.load(make_pth("4"))
    m5 = rwkv_engine.load(make_pth("5.2"))
    m5_wide = rwkv_engine.load(make_pth("5.2", n_embd=128))
    for a, b in ((m4, m5), (m5, m5_wide)):
        with pytest.raises(StateError, match="another model"):
            b.forward([1], a.new_state())
    path = m4.new_state().save(tmp_path / "m4.state")
    with pytest.raises(StateError, match="another model"):
        m5.forward([1], State.load(path))


@pytest.mark.parametrize("version", VERSIONS)
def test_16bit_close_to_fp32(version, make_pth):
    """Stated tolerance: logits of bf16 / fp16 weights within 3% / 1% relative RMS of fp32."""
    path = make_pth(version)
    ids = tokens(64, seed=4)
    ref, ref_state = rwkv_engine.load(path).forward(ids, all_logits=True)
    for dtype, tol in (("bf16", 0.03), ("fp16", 0.01)):
        logits, state = rwkv_engine.load(path, dtype=dtype).forward(ids, all_logits=True)
        assert rel_rms(logits, ref) < tol, dtype
        assert state.att_x_prev.dtype == torch.float32


def test_fp16_deep_model_stays_finite(tmp_path):
    """24 layers whose late blocks write values past fp16's range unless the rescale trick halves them."""
    sd = testing.random_state_dict("5.2", n_layer=24, n_embd=64, vocab_size=300, head_size=16, seed=2)
    for i in range(24):
        sd[f"blocks.{i}.ffn.value.weight"] *= 1.6**i  # later blocks write larger values, as trained ones do
    path = testing.save_pth(sd, tmp_path / "deep.pth")
    ids = tokens(40, seed=5)
    ref, _ = rwkv_engine.load(path).forward(ids, all_logits=True)
    logits, state = rwkv_engine.load(path, dtype="fp16").forward(ids, all_logits=True)
    assert torch.isfinite(logits).all() and all(torch.isfinite(t).all() for _, t in state.items())
    assert rel_rms(logits, ref) < 0.03
    plain, _ = rwkv_engine.load(path, dtype="fp16", rescale_every=0).forward(ids, all_logits=True)
    assert not torch.isfinite(plain).all()  # the trick is what keeps it finite


def _peak_rss_kb(fn):
    """Peak resident memory while fn runs (resets the kernel's high-water mark first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_long_prompt_bounded_memory_and_exact(tmp_path):
    sd = testing.random_state_dict("5.2", n_layer=1, n_embd=256, vocab_size=300, head_size=64, seed=9)
    model = rwkv_engine.load(testing.save_pth(sd, tmp_path / "long.pth"))
    ids = torch.randint(0, 300, (20_000,), generator=torch.Generator().manual_seed(0))
    model.forward(ids[:2000])  # warm up allocator
    base = _peak_rss_kb(lambda: None)
    short = _peak_rss_kb(lambda: model.forward(ids[:2000])) - base
    out = {}
    long = _peak_rss_kb(lambda: out.update(r=model.forward(ids))) - base
    # 10x the tokens; an unchunked forward would hold [20000, 896] fp32 activations (70 MB) at least.
    assert long - short < 24 * 1024, (short, long)
    logits, state = out["r"]
    # the same as feeding the tokens one chunk of 1..600 at a time, then one by one
    st, g = None, torch.Generator().manual_seed(1)
    pos = 0
    while pos < 19_900:
        n = int(torch.randint(1, 600, (1,), generator=g))
        n = min(n, 19_900 - pos)
        _, st = model.forward(ids[pos : pos + n], st)
        pos += n
    for t in ids[19_900:]:
        lg, st = model.forward(t[None], st)
    assert rel_rms(lg, logits) < 1e-4
    assert state.allclose(st, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("version", ["4", "5.2", "6.0", "7"])
def test_fresh_state_written_over_gives_the_same_bits(version, tmp_path):
    # forward / hidden / prefill without a state write the new state over the fresh one they make
    # (no second copy); with a state given, it is never modified. Both give the same bits.
    sd = testing.random_state_dict(version, n_layer=2, n_embd=64, vocab_size=300, head_size=16, seed=3)
    m = rwkv_engine.load(testing.save_pth(sd, tmp_path / "m.pth"))
    ids = tokens(70, seed=4)
    given = m.new_state()
    kept = given.clone()
    logits, state = m.forward(ids)
    logits2, state2 = m.forward(ids, given)
    assert torch.equal(logits, logits2) and state.allclose(state2, rtol=0, atol=0)
    assert given.allclose(kept, rtol=0, atol=0)
    h, hs = m.hidden(ids)
    h2, hs2 = m.hidden(ids, given)
    assert torch.equal(h, h2) and hs.allclose(hs2, rtol=0, atol=0)
    assert m.prefill(ids).allclose(m.prefill(ids, given), rtol=0, atol=0)
    assert given.allclose(kept, rtol=0, atol=0) and not state.allclose(given, rtol=0, atol=0)
