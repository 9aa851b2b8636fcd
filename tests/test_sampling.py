"""The sampler against the `rwkv` pip package's PIPELINE (the reference every RWKV front end copies).

The reference draws with numpy's global RNG, so the comparisons capture the probability vector
it passes to `np.random.choice` and compare it with ours, step by step, feeding both the same
token so that the penalty counts evolve together.
"""

import json
import math

import numpy as np
import pytest
import torch

from rwkv_engine import sampling
from rwkv_engine.errors import InputError
from rwkv_engine.sampling import (
    Sampler,
    SamplingParams,
    apply_penalties,
    bias_vector,
    draw,
    rwkv_probs,
    sample_rows,
    update_counts,
)

rwkv_utils = pytest.importorskip("rwkv.utils")


def reference_probs(logits, temperature, top_p, top_k, monkeypatch):
    """The distribution the pip's sample_logits draws from."""
    seen = {}

    def choice(a, p):
        seen["p"] = np.array(p, dtype=np.float64)
        return 0

    monkeypatch.setattr(np.random, "choice", choice)
    rwkv_utils.PIPELINE.sample_logits(None, logits.clone(), temperature=temperature, top_p=top_p, top_k=top_k)
    return torch.from_numpy(seen["p"])


# --- parameters --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(top_p=-1),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(penalty_decay=1.5),
        dict(penalty_decay=-0.1),
        dict(presence_penalty=float("inf")),
        dict(frequency_penalty="x"),
        dict(max_tokens=-1),
        dict(seed=-3),
        dict(stop=[""]),
        dict(stop=[3]),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={5: float("inf")}),
        dict(logit_bias=[1, 2]),
        dict(banned_token_ids=["a"]),
        dict(stop_token_ids=[-2]),
        dict(temperature=True),
    ],
)
def test_bad_params_raise_input_error(bad):
    with pytest.raises(InputError):
        SamplingParams(**bad)


def test_infinite_temperature_is_named_as_such():
    """Smaller item: `temperature: 1e400` (JSON's inf) said "must be >= 0, got inf"."""
    for t in (float("inf"), 1e400, json.loads("1e400")):
        with pytest.raises(InputError, match=r"temperature must be a finite number >= 0 .*got inf"):
            SamplingParams(temperature=t)
    with pytest.raises(InputError, match=r"temperature must be a finite number >= 0 .*got -1"):
        SamplingParams(temperature=-1)


def test_params_normalise_and_replace():
    p = SamplingParams(stop="\n\n", stop_token_ids=[0, 0, 5], logit_bias={"7": -math.inf}, top_k=3.0)
    assert p.stop == ("\n\n",) and p.stop_token_ids == (0, 5) and p.logit_bias == {7: -math.inf}
    assert p.top_k == 3 and isinstance(p.top_k, int)
    q = p.replace(temperature=0)
    assert q.greedy and not p.greedy
    with pytest.raises(InputError):
        p.replace(top_p=0)
    with pytest.raises(InputError):
        p.replace(nonsense=1)
    with pytest.raises(InputError):
        SamplingParams(banned_token_ids=[100]).check_vocab(100)
    SamplingParams(banned_token_ids=[99]).check_vocab(100)
    with pytest.raises(InputError):
        Sampler(SamplingParams(banned_token_ids=range(10)), 10)


# --- the distribution --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [
        (1.0, 0.85, 0),
        (1.0, 0.3, 0),
        (0.6, 0.5, 0),
        (1.7, 0.9, 0),
        (1.0, 0.95, 7),
        (2.5, 0.99, 3),
        (0.8, 0.6, 1),
    ],
)
def test_probs_match_reference(temperature, top_p, top_k, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        logits = torch.randn(300, generator=gen) * 3
        ref = reference_probs(logits, temperature, top_p, top_k, monkeypatch)
        ours = rwkv_probs(logits, temperature, top_p, top_k).double()
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-7)
        assert (ours > 0).sum() == (ref > 0).sum()


def test_probs_batched_rows_equal_single_rows():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2)) * 2
    t, p, k = [1.0, 0.5, 2.0, 1.2], [1.0, 0.4, 0.9, 0.7], [0, 0, 5, 2]
    batched = rwkv_probs(logits, t, p, k)
    for b in range(4):
        torch.testing.assert_close(batched[b], rwkv_probs(logits[b], t[b], p[b], k[b]))
    assert torch.allclose(batched.sum(-1), torch.ones(4))


def test_cut_keeps_ties_and_top_p_one_keeps_all():
    logits = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1]))
    # running sum reaches 0.5 at the first 0.2: its tie is kept too, the 0.1s are dropped
    probs = rwkv_probs(logits, 1.0, 0.5)
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0]))
    assert (rwkv_probs(logits, 1.0, 1.0) > 0).all()


def test_small_temperature_does_not_underflow():
    logits = torch.randn(65536, generator=torch.Generator().manual_seed(3))
    probs = rwkv_probs(logits, 0.01, 1.0)
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
    assert probs.argmax() == logits.argmax() and probs.max() > 0.99


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    gen = torch.Generator().manual_seed(4)
    tokens = draw(probs.expand(20000, 5).contiguous(), gen)
    freq = torch.bincount(tokens, minlength=5).double() / 20000
    assert (freq - probs.double()).abs().max() < 0.015
    assert freq[4] == 0


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.5, 0.95, 3)])
def test_sample_rows_draws_from_rwkv_probs(temperature, top_p, top_k):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0])
    n = 3000
    gen = torch.Generator().manual_seed(8)
    tokens = torch.tensor(sample_rows(logits.expand(n, 6), [temperature] * n, [top_p] * n, [top_k] * n, [gen] * n))
    freq = torch.bincount(tokens, minlength=6).double() / n
    probs = rwkv_probs(logits, temperature, top_p, top_k).double()
    assert (freq - probs).abs().max() < 0.035
    assert (freq[probs == 0] == 0).all()


# --- penalties and whole sampling runs ---------------------------------------------------------


def test_penalty_functions():
    logits = torch.zeros(2, 4)
    counts = torch.tensor([[0.0, 1.0, 2.5, 0.0], [3.0, 0.0, 0.0, 0.0]])
    out = apply_penalties(logits, counts, [0.5, 1.0], [0.25, 0.0])
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.75, -1.125, 0.0], [-1.0, 0.0, 0.0, 0.0]]))
    new = update_counts(counts, torch.tensor([3, 0]), [0.5, 1.0])
    torch.testing.assert_close(new, torch.tensor([[0.0, 0.5, 1.25, 1.0], [4.0, 0.0, 0.0, 0.0]]))


class _FakeModel:
    """Deterministic logits that depend on the whole token history (its 'state')."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def forward(self, tokens, state):
        state = (state or 0) * 1000003 + sum((i + 1) * t for i, t in enumerate(tokens)) + len(tokens)
        gen = torch.Generator().manual_seed(state % (2**62))
        return torch.randn(self.vocab_size, generator=gen) * 2, state


class _FakeVocab:
    def encode(self, text):
        return [int(x) for x in text.split()]

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)  # never a digit/space string: no pip penalty exemption


@pytest.mark.parametrize(
    "temperature,top_p,top_k,presence,frequency,decay,ban",
    [
        (0.0, 0.85, 0, 0.7, 0.4, 0.996, []),  # greedy: penalties decide the tokens
        (1.0, 0.85, 0, 0.2, 0.2, 0.996, [3]),
        (1.3, 0.5, 4, 0.5, 0.5, 0.9, [0, 7]),
        (0.7, 0.95, 0, 0.0, 1.0, 0.5, []),
    ],
)
def test_sampler_matches_reference_pipeline(temperature, top_p, top_k, presence, frequency, decay, ban, monkeypatch):
    V, steps = 24, 40
    pipe = rwkv_utils.PIPELINE.__new__(rwkv_utils.PIPELINE)
    pipe.model, pipe.tokenizer = _FakeModel(V), _FakeVocab()
    rng = np.random.default_rng(5)
    seen_logits, seen_p, picked = [], [], []
    orig_sample = rwkv_utils.PIPELINE.sample_logits

    def sample_logits(self, logits, **kw):
        seen_logits.append(logits.clone())
        return orig_sample(self, logits, **kw)

    def choice(a, p):
        seen_p.append(np.array(p, dtype=np.float64))
        q = np.asarray(p, dtype=np.float64)
        tok = int(rng.choice(a, p=q / q.sum()))
        picked.append(tok)
        return tok

    monkeypatch.setattr(rwkv_utils.PIPELINE, "sample_logits", sample_logits)
    monkeypatch.setattr(np.random, "choice", choice)
    args = rwkv_utils.PIPELINE_ARGS(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        alpha_frequency=frequency,
        alpha_presence=presence,
        alpha_decay=decay,
        token_ban=ban,
        token_stop=[],
    )
    text = pipe.generate("1 2 3", token_count=steps, args=args)
    ref_tokens = [int(x) for x in text.strip("<>").split("><")]
    assert len(ref_tokens) == steps

    # Replay: the same raw logits (the fake model's, recomputed) through our sampler.
    model = _FakeModel(V)
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        presence_penalty=presence,
        frequency_penalty=frequency,
        penalty_decay=decay,
        banned_token_ids=ban,
        seed=0,
    )
    sampler = Sampler(params, V)
    logits, state = model.forward([1, 2, 3], None)
    ours = []
    for i, ref_token in enumerate(ref_tokens):
        adjusted = sampler.adjusted_logits(logits)
        if temperature == 0:
            token = sampler(logits)  # greedy: must pick what the reference picked
            assert token == ref_token, f"step {i}"
        else:
            probs = rwkv_probs(adjusted, temperature, top_p, top_k).double()
            torch.testing.assert_close(probs, torch.from_numpy(seen_p[i]), rtol=1e-4, atol=1e-7)
            sampler.accept(ref_token)
        ours.append(ref_token)
        logits, state = model.forward([ref_token], state)
    assert len(set(ours)) < len(ours)  # tokens repeated, so the penalties were exercised


def test_same_seed_same_tokens_and_batch_equals_single():
    V = 1000
    logits = torch.randn(30, V, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=11, presence_penalty=0.3),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=1.5, top_k=20, seed=12, logit_bias={5: 3.0}, banned_token_ids=[6]),
    ]

    def run_alone(p):
        s = Sampler(p, V)
        return [s(row) for row in logits]

    alone = [run_alone(p) for p in params]
    assert alone[0] == run_alone(params[0])  # same seed, same tokens
    assert alone[0] != run_alone(params[0].replace(seed=13))
    assert 6 not in alone[2]
    samplers = [Sampler(p, V) for p in params]
    batched = [Sampler.sample_batch(samplers, torch.stack([row] * 3)) for row in logits]
    assert [[b[i] for b in batched] for i in range(3)] == alone


def test_min_tokens_keeps_stop_tokens_out_until_then():
    """vLLM's min_tokens: the stop tokens cannot be sampled before that many tokens were accepted
    (greedy and drawn, batched or alone); afterwards they can again."""
    V = 50
    logits = torch.zeros(V)
    logits[0], logits[5], logits[9] = 8.0, 7.0, 6.0  # the stop tokens are the most likely
    for p in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)):
        p = p.replace(stop_token_ids=(0, 5), min_tokens=4)
        s = Sampler(p, V)
        early = [s(logits) for _ in range(4)]
        assert not {0, 5} & set(early), early
        if p.greedy:
            assert early == [9] * 4 and s(logits) == 0
        batch = [Sampler(p, V), Sampler(p.replace(min_tokens=0), V)]
        got = Sampler.sample_batch(batch, torch.stack([logits, logits]))
        assert got[0] not in (0, 5) and (not p.greedy or got[1] == 0)
    with pytest.raises(InputError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(InputError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    assert SamplingParams(min_tokens=7, max_tokens=None).min_tokens == 7


def test_shared_generator_overrides_seed():
    V = 500
    logits = torch.randn(V, generator=torch.Generator().manual_seed(7))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = [Sampler(SamplingParams(seed=1), V, generator=g1)(logits) for _ in range(20)]
    b = [Sampler(SamplingParams(seed=2), V, generator=g2)(logits) for _ in range(20)]
    assert a == b and len(set(a)) > 1


# --- the batched O(V) sampler against plain oracles --------------------------------------------
# The top-p cut is found from a histogram of each row (sampling._nucleus_cutoff) and the draw is
# one uniform number a row, the inverse of the running sum in token-id order. The oracles here
# are the rule written plainly: a float64 sort of the row, its running sum, and a draw by hand.


def _logits(gen, n, V, scale, step=None):
    x = torch.randn(n, V, generator=gen) * scale
    if step is not None:
        x = (x / step).round() * step  # many exactly equal logits, also at the top (as bf16 logits)
    return x


def _kept_by_sorting(logits, top_p, top_k):
    """The kept tokens of a row [V] by the module docstring's steps 4-5, with a sort (float64)."""
    p = torch.softmax(logits.double(), dim=0)
    values, ids = torch.sort(p, descending=True, stable=True)
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_p < 1:
        first = min(int((values.cumsum(0) < top_p).sum()), len(p) - 1)
        keep = p >= values[first]
    if 0 < top_k < len(p):  # ties at the k-th: the order of torch.topk(row, max(k, 256))
        ranked = torch.zeros_like(keep)
        ranked[torch.topk(logits, min(len(p), max(top_k, 256))).indices[:top_k]] = True
        keep &= ranked
    return keep


@pytest.mark.parametrize("V", [65536, 50277, 300])
def test_kept_tokens_equal_the_sorted_rule(V):
    gen = torch.Generator().manual_seed(21)
    top_p = [0.1, 0.3, 0.85, 0.9, 0.95, 0.999, 1.0, 1.0, 0.5, 0.7, 0.6, 1.0]
    top_k = [0, 0, 0, 40, 1, 0, 40, 0, 300, 7, 256, 1]
    for scale, step in [(0.3, None), (2.0, None), (6.0, None), (20.0, None), (4.0, 0.5), (4.0, 1e-3)]:
        logits = _logits(gen, len(top_p), V, scale, step)
        logits[0, 5] = logits[0].max()  # a tie with the most probable token
        logits[2, 10:310] = logits[2].max() + 3  # 300 tied top tokens
        logits[3, :100] = -math.inf  # banned tokens
        kept = sampling._kept(logits - logits.amax(1, keepdim=True), top_p, top_k)
        for b in range(len(top_p)):
            want = _kept_by_sorting(logits[b], top_p[b], top_k[b])
            assert torch.equal(kept[b], want), (scale, step, b, int(kept[b].sum()), int(want.sum()))


def test_a_flat_row_keeps_its_wide_nucleus():
    """A random model's row: the nucleus of top_p 0.85 holds thousands of tokens (the case the
    histogram is for: a sort of the row cost 10-90 ms)."""
    logits = torch.randn(2, 65536, generator=torch.Generator().manual_seed(38)) * 0.5
    kept = sampling._kept(logits - logits.amax(1, keepdim=True), [0.85, 0.99], [0, 3000])
    for b, (p, k) in enumerate([(0.85, 0), (0.99, 3000)]):
        want = _kept_by_sorting(logits[b], p, k)
        assert want.sum() > 2000 and torch.equal(kept[b], want)


def test_draw_is_the_running_sum_inverted_at_one_uniform_number():
    V = 65536
    gen = torch.Generator().manual_seed(22)
    temperature = [1e-3, 0.01, 0.3, 1.0, 1.0, 2.0, 5.0, 100.0, 1e-3, 100.0]
    top_p = [0.9, 0.85, 0.3, 1.0, 0.95, 0.9, 0.99, 0.9, 1.0, 1.0]
    top_k = [0, 40, 0, 40, 0, 1, 5, 0, 0, 256]
    mine = [torch.Generator().manual_seed(30 + b) for b in range(len(temperature))]
    mirror = [torch.Generator().manual_seed(30 + b) for b in range(len(temperature))]
    for t, (scale, step) in enumerate([(1.0, None), (5.0, None), (3.0, 0.25), (12.0, None)] * 2):
        logits = _logits(gen, len(temperature), V, scale, step)
        got = sample_rows(logits, temperature, top_p, top_k, mine)
        probs = rwkv_probs(logits, temperature, top_p, top_k).double()
        for b in range(len(temperature)):
            u = 1 - float(torch.rand(1, generator=mirror[b]))
            cum = probs[b].cumsum(0)
            want = int((cum < u * cum[-1]).sum())
            assert probs[b, got[b]] > 0, (t, b)
            # the same token, or (fp32 against float64 running sums) a neighbour across a rounding
            assert got[b] == want or abs(float(cum[got[b]] - u * cum[-1])) < 1e-5, (t, b, got[b], want)
    # One random number a row a step: the generators are still in step with the mirror.
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, mirror))


@pytest.mark.parametrize("V", [65536, 300])
def test_the_compact_draw_is_the_full_draw(V):
    """Rows whose kept tokens lie among their 256 most probable draw among those only; they must
    draw the token the whole row's running sum gives for the same u, ties and bans included."""
    gen = torch.Generator().manual_seed(24)
    temperature = [1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 2.0, 1e-3, 1.0, 1.0]
    top_p = [0.85, 0.3, 1.0, 0.95, 0.5, 0.1, 0.9, 0.9, 0.99, 0.6]
    top_k = [0, 0, 40, 5, 1, 0, 256, 0, 300, 7]
    n, compact, wide = len(top_p), 0, 0
    for scale, step in [(0.5, None), (3.0, None), (8.0, None), (4.0, 0.5), (20.0, None)]:
        logits = _logits(gen, n, V, scale, step)
        logits[0, :50] = logits[0].max()  # 50 tied top tokens
        logits[3, 100:200] = -math.inf
        top = logits.amax(1, keepdim=True)
        u = 1 - torch.rand(n, 1, generator=gen)
        got, done, handed = sampling._draw_compact(logits, top, u, temperature, top_p, top_k)
        want = sampling._draw_full(logits, top, u, temperature, top_p, top_k)
        assert done and all(got[j] == want[j] for j in done), (scale, step, done, got, want)
        if handed is not None:  # the wide nuclei, drawn from what the compact path computed
            local, tokens = handed
            assert sorted(local + done) == list(range(n))
            assert tokens.tolist() == [int(want[j]) for j in local], (scale, step, local)
            wide += len(local)
        compact += len(done)
    assert compact > n * 5 // 2 and wide > 0  # most rows of the peaked steps drew compactly


def test_a_row_draws_the_same_alone_and_in_any_batch():
    V = 65536
    gen = torch.Generator().manual_seed(23)
    temperature, top_p, top_k = [1.0, 0.7, 1.3, 1.0], [0.85, 0.3, 1.0, 0.95], [0, 0, 40, 5]
    batch = [torch.Generator().manual_seed(b) for b in range(4)]
    alone = [torch.Generator().manual_seed(b) for b in range(4)]
    for scale in (0.5, 3.0, 8.0):
        logits = _logits(gen, 4, V, scale)
        got = sample_rows(logits, temperature, top_p, top_k, batch)
        want = [sample_rows(logits[b : b + 1], temperature[b], top_p[b], top_k[b], [alone[b]])[0] for b in range(4)]
        assert got == want


def test_a_row_with_no_token_left_is_an_error_not_token_zero():
    V = 20
    params = SamplingParams(banned_token_ids=range(1, V), stop_token_ids=(0,), min_tokens=1)
    logits = torch.randn(2, V)
    for p in (params.replace(temperature=0), params.replace(seed=1)):
        samplers = [Sampler(p, V), Sampler(p.replace(min_tokens=0, banned_token_ids=()), V)]
        with pytest.raises(InputError, match="every token is banned"):
            Sampler.sample_batch(samplers, logits)


def test_sampler_adjusts_in_place_as_the_dense_functions_do():
    V = 65536
    params = SamplingParams(
        presence_penalty=0.4,
        frequency_penalty=0.3,
        penalty_decay=0.9,
        logit_bias={0: -100, 17: 2.5, 99: -0.0},
        banned_token_ids=[3, 17],
        seed=1,
    )
    sampler = Sampler(params, V)
    for token in [5, 9, 5, 1000, 5]:
        sampler.accept(token)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(23))
    before = logits.clone()
    want = apply_penalties(logits + bias_vector(params, V), sampler.counts, 0.4, 0.3)
    assert torch.equal(sampler.adjusted_logits(logits), want)
    assert torch.equal(logits, before)  # the caller's logits are left alone
    assert torch.isinf(want[[3, 17]]).all()


@pytest.mark.parametrize("temperature", [1.5e-38, 1e-40, 1e-45, 1e-300, 1e-3])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_every_accepted_temperature_samples_without_nan(temperature, top_p):
    """Issue 14 D1: log p / T overflowed fp32 for T near 1e-38 and below (NaN, multinomial raised).

    Any T > 0 is accepted, and a tiny one must behave as the limit T -> 0: the most probable kept
    token (or one of its exact ties), never a NaN or an error.
    """
    logits = torch.randn(2, 65536, generator=torch.Generator().manual_seed(5)) * 4
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # row 1: an exact tie for the top
    probs = rwkv_probs(logits, temperature, top_p)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    for _ in range(4):
        a, b = sample_rows(logits, [temperature] * 2, [top_p] * 2, [0, 0], gens)
        assert a == int(logits[0].argmax()) and b in (7, 9)
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p), 65536)
    assert sampler(logits[0]) == int(logits[0].argmax())


def test_nan_or_infinite_logits_are_an_error_not_a_token():
    """R6 / fuzz: NaN logits (a NaN weight or state) were sampled as token 0 by greedy ("stop",
    empty output: NaN in, finite out) and raised torch's RuntimeError otherwise."""
    from rwkv_engine.errors import ModelOutputError

    V = 50
    for bad in (float("nan"), float("inf")):
        logits = torch.randn(3, V)
        logits[1, 7] = bad
        for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)):
            samplers = [Sampler(params, V) for _ in range(3)]
            with pytest.raises(ModelOutputError, match="NaN or infinite"):
                Sampler.sample_batch(samplers, logits)
            with pytest.raises(ModelOutputError):
                samplers[1](logits[1])
            assert samplers[0](logits[0]) >= 0  # the finite rows sample as usual
    banned = torch.randn(V)
    banned[:10] = -math.inf  # -inf (a ban) is fine
    assert Sampler(SamplingParams(temperature=0), V)(banned) >= 10
