"""Speculative decoding: the same output as plain decoding, in fewer passes.

Oracles: plain `generate` (greedy: token for token; penalties, bias, stops, grammar), a
from-scratch `model.forward` over prompt + tokens (the final state), token-by-token decode steps
(the logits of a k-token verify pass), and for sampling the exact law of the first two tokens,
enumerated from the target's own `forward` and `Sampler`, against many seeded runs (fixed seeds:
deterministic, it cannot flake).
"""

import argparse

import pytest
import torch

import rwkv_engine
from rwkv_engine.cli import main
from rwkv_engine.errors import InputError
from rwkv_engine.generation import generate
from rwkv_engine.sampling import Sampler, SamplingParams, rwkv_probs
from rwkv_engine.speculative import (
    DEFAULT_MAX_DRAFT,
    Drafter,
    DraftModel,
    PromptLookup,
    SpeculativeDecoder,
    SpeculativeRow,
    SpeculativeStats,
    decide,
    make_drafter,
)
from rwkv_engine.testing import KnownContinuation
from rwkv_engine.tokenizer import WorldTokenizer

from .conftest import run_engine, states_equal

WORLD = dict(n_layer=2, n_embd=64, vocab_size=65536, head_size=16)
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"


@pytest.fixture(scope="module")
def tok():
    return WorldTokenizer()


@pytest.fixture(scope="module", params=["5.2", "7"])
def version(request):
    return request.param


@pytest.fixture(scope="module")
def model(version, make_pth):
    return rwkv_engine.load(make_pth(version, **WORLD))


@pytest.fixture(scope="module")
def draft(version, make_pth):
    return DraftModel(rwkv_engine.load(make_pth(version, **{**WORLD, "n_layer": 1, "seed": 5})))


def plain_and_spec(model, tok, prompt, spec, **kw):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, **kw})
    a = generate(model, tok, prompt, params)
    a.read()
    b = generate(model, tok, prompt, params, speculative=spec)
    b.read()
    return a, b


def same(a, b):
    assert b.tokens == a.tokens and b.text == a.text and b.finish_reason == a.finish_reason
    states_equal(b.state, a.state, tol=1e-5)


# --- the verify pass -------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2])
def test_verify_pass_logits_equal_token_by_token(model, rows):
    torch.manual_seed(0)
    prompt = torch.randint(1, 65536, (rows, 6))
    drafts = torch.randint(1, 65536, (rows, 5))
    _, st = model.forward(prompt)
    logits, after = model.forward(drafts, st, all_logits=True)
    s = st
    for j in range(drafts.shape[1]):
        lg, s = model.forward(drafts[:, j : j + 1], s)
        assert (logits[:, j] - lg).abs().max() < 1e-4
    states_equal(after, s)


# --- greedy: token for token -----------------------------------------------------------------


def test_greedy_lookup_equals_plain(model, tok):
    a, b = plain_and_spec(model, tok, PROMPT, "lookup", max_tokens=40, stop_token_ids=[])
    same(a, b)
    st = b.stats.speculative
    assert st.passes < len(b.tokens) or st.drafted > 0  # it did speculate
    assert st.emitted == len(b.tokens) - 1  # the first token comes from the prompt's pass


def test_greedy_draft_model_equals_plain(model, tok, draft):
    a, b = plain_and_spec(model, tok, PROMPT, draft, max_tokens=16, stop_token_ids=[])
    same(a, b)
    assert b.stats.speculative.drafted > 0


def test_greedy_full_acceptance_takes_few_passes(model, tok):
    ids = tok.encode(PROMPT)
    cont = rwkv_engine.testing.greedy_tokens(model, ids, 33)
    a, b = plain_and_spec(model, tok, ids, KnownContinuation(ids, cont), max_tokens=33, stop_token_ids=[])
    same(a, b)
    st = b.stats.speculative
    assert st.accepted == st.drafted and st.tokens_per_pass > 3


def test_twin_draft_of_itself_accepts_everything(model, tok):
    a, b = plain_and_spec(model, tok, PROMPT, DraftModel(model), max_tokens=20, stop_token_ids=[])
    same(a, b)
    assert b.stats.speculative.acceptance_rate == 1.0


@pytest.mark.parametrize(
    "kw",
    [
        dict(presence_penalty=0.7, frequency_penalty=0.9, penalty_decay=0.9, max_tokens=14),
        dict(logit_bias={11: 4.0, 33: -1e9}, banned_token_ids=[261], max_tokens=14),
        dict(stop=["a"], max_tokens=40),
        dict(max_tokens=7),
    ],
    ids=["penalties", "bias", "stop-string", "max-tokens"],
)
def test_greedy_options_apply_at_every_verified_position(model, tok, kw):
    ids = tok.encode(PROMPT)
    for spec in ("lookup", DraftModel(model)):
        a, b = plain_and_spec(model, tok, ids, spec, **{"stop_token_ids": [], **kw})
        same(a, b)


def test_stop_token_inside_a_verified_draft(model, tok):
    ids = tok.encode(PROMPT)
    cont = rwkv_engine.testing.greedy_tokens(model, ids, 20)
    stop = cont[9]
    first = cont.index(stop)
    a, b = plain_and_spec(model, tok, ids, DraftModel(model), max_tokens=20, stop_token_ids=[stop])
    same(a, b)
    assert a.finish_reason == "stop" and len(a.tokens) == first


def test_grammar_mask_applies_at_every_verified_position(model, tok):
    pytest.importorskip("llguidance")
    a, b = plain_and_spec(model, tok, "JSON:", DraftModel(model), max_tokens=20, json_object=True)
    same(a, b)
    a, b = plain_and_spec(model, tok, "JSON:", "lookup", max_tokens=20, json_object=True)
    same(a, b)


def test_state_is_exact_when_abandoned_midway(model, tok):
    ids = tok.encode(PROMPT)
    gen = generate(model, tok, ids, SamplingParams(temperature=0, max_tokens=30), speculative=DraftModel(model))
    for _ in zip(range(3), gen):
        pass
    gen.close()
    _, ref = model.forward(ids + gen.tokens)
    states_equal(gen.state, ref)


# --- sampling: the target's distribution ---------------------------------------------------


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_decide_rejection_sampling_has_the_target_law():
    V, n = 8, 8000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(V, generator=g) * 2
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    p = rwkv_probs(logits, 0.8, 0.95, 0)
    q = torch.softmax(torch.randn(V, generator=g), -1)
    for draft_q in (None, q):  # prompt lookup (point mass) and a draft model's distribution
        counts = torch.zeros(V)
        sampler = Sampler(params, V)
        for i in range(n):
            d = int(torch.multinomial(q, 1, generator=g)) if draft_q is not None else i % 3
            t, _ = decide(sampler, logits, d, draft_q)
            counts[t] += 1
        # sampling error of 8000 draws over 8 outcomes: TV ~ 0.012, under 0.025 at the 99.9th
        # percentile; a wrong law (e.g. accepting every draft, or not renormalising the residual)
        # is off by 0.1 and more
        assert tv(counts, p) < 0.03


def exact_two_token_law(model, prompt, params):
    """P(t1, t2) of plain sampling: the target's logits and a Sampler's adjustments, enumerated."""
    V = model.config.vocab_size
    logits, st = model.forward(prompt)
    s0 = Sampler(params, V)
    p1 = rwkv_probs(s0.adjusted_logits(logits), params.temperature, params.top_p, params.top_k)
    law = torch.zeros(V, V)
    lg2, _ = model.forward(torch.arange(V)[:, None], _rows(st, V))
    for t1 in range(V):
        s = Sampler(params, V)
        s.accept(t1)
        p2 = rwkv_probs(s.adjusted_logits(lg2[t1]), params.temperature, params.top_p, params.top_k)
        law[t1] = p1[t1] * p2
    return law


def _rows(state, n):
    from rwkv_engine.state import State

    return State({k: v.expand(n, *v.shape[1:]).contiguous() for k, v in state.items()}, state.signature)


class FixedDraft(Drafter):
    """Draws its drafts from one fixed distribution (a model draft's q, without the model's cost)."""

    q = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed + 10**6)  # independent of the sampler's stream

    def propose(self, context, k):
        tokens = torch.multinomial(self.q, k, replacement=True, generator=self.g).tolist()
        return tokens, [self.q] * k


class Memo:
    """The target's forward memoized by the tokens fed (every pass here starts from one state):
    the same logits, without running the model a thousand times."""

    def __init__(self, model):
        self.model, self.config, self.seen = model, model.config, {}

    def forward(self, tokens, state=None, all_logits=False):
        key = (tuple(tokens), all_logits)
        if key not in self.seen:
            self.seen[key] = self.model.forward(tokens, state=state, all_logits=all_logits)
        return self.seen[key]


def test_speculative_sampling_has_the_target_law(make_pth):
    V = 4
    target = rwkv_engine.load(make_pth("7", n_layer=1, n_embd=32, vocab_size=V, head_size=16, seed=2))
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 1]  # every token occurs: prompt lookup always has a draft
    params = SamplingParams(temperature=1.3, presence_penalty=0.5, logit_bias={3: 0.7}, stop_token_ids=[])
    law = exact_two_token_law(target, prompt, params).reshape(-1)
    logits, st = target.forward(prompt)
    memo = Memo(target)
    n = 1000
    for make in (lambda p: PromptLookup(), lambda p: FixedDraft(p.seed)):
        counts = torch.zeros(V * V)
        drafted = 0
        for seed in range(n):
            p = params.replace(seed=seed)
            dec = SpeculativeDecoder(memo, make(p), Sampler(p, V), prompt, st, logits, max_draft=2)
            got = [t for _, t in zip(range(2), dec.tokens())]
            counts[got[0] * V + got[1]] += 1
            drafted += dec.stats.drafted
        assert drafted >= n  # the second token was verified against a draft
        # the sampling error of 1000 draws of this law: TV 0.03 on average, 0.068 at the 99.9th
        # percentile; accepting the drafts unchecked moves the law by far more
        assert tv(counts, law) < 0.07


# --- the API's edges ---------------------------------------------------------------------------


def test_bad_speculative_values_are_input_errors(model, tok, make_pth):
    with pytest.raises(InputError):
        generate(model, tok, "x", speculative="fast")
    other = rwkv_engine.load(make_pth("5.2", n_layer=1, n_embd=64, vocab_size=300, head_size=16))
    with pytest.raises(InputError, match="vocabulary"):
        make_drafter("draft", model, other)
    with pytest.raises(InputError, match="draft length"):
        SpeculativeRow(PromptLookup(), Sampler(SamplingParams(), 65536), [1], max_draft=0)


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    look = PromptLookup(max_ngram=2)
    assert look.propose([1, 2, 3, 4, 9, 2, 3], 3) == ([4, 9, 2], None)
    assert look.propose([1, 2, 3, 7, 3], 2) == ([7, 3], None)  # 1-gram fallback, latest match
    assert look.propose([1, 2, 3], 4) == ([], None)


def test_stats_add_up():
    s = SpeculativeStats(passes=4, drafted=10, accepted=6, emitted=10)
    assert s.acceptance_rate == 0.6 and s.tokens_per_pass == 2.5


def test_cli_generate_speculative_matches_plain(make_pth, capsys):
    path = make_pth("5.2", **WORLD)
    args = ["generate", str(path), "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "12"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative", "lookup", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and "tokens per pass" in err
    assert main(args + ["--speculative", "draft", "--draft", str(path), "--max-draft", "3"]) == 0
    assert capsys.readouterr().out == plain
    assert main(args + ["--max-draft", "40"]) != 0
    assert "--max-draft" in capsys.readouterr().err


# --- NaN and infinite logits: one error on every route ---------------------------------------


class Wrapped(torch.nn.Module):
    """A model behind a module of its own (its attributes read through), whose forward a test
    replaces."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class BadLogits(Wrapped):
    """The model, with `bad` (NaN or +inf) at token 5 of every logit row of a forward that starts
    from a state: what a weight or state gone bad gives once decoding runs (the prompt's own
    forward, from the fresh state, stays finite, so the first token is drawn as usual)."""

    def __init__(self, inner, bad: float):
        super().__init__(inner)
        self.bad = bad

    def forward(self, tokens, state=None, all_logits=False):
        logits, after = self.inner.forward(tokens, state=state, all_logits=all_logits)
        if state is not None:
            logits = logits.clone()
            logits[..., 5] = self.bad
        return logits, after


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nan_or_infinite_logits_fail_every_route(bad, make_pth, tok):
    """The speculative route had its own copy of the sampling rule, without its finiteness check:
    a 2 x 128 RWKV-7 with a NaN head gave no tokens and no error through
    generate(speculative="lookup") at temperature 0, and a bare RuntimeError at temperature 1
    (plain decoding raised ModelOutputError); a +inf logit was taken as the arg-max. Every route,
    greedy and sampled, plain, prompt lookup and draft model, through `generate` and through the
    server's engine, now ends in ModelOutputError (the engine: that request's error)."""
    from rwkv_engine.errors import ModelOutputError
    from rwkv_engine.serve.engine import EngineConfig, Request

    path = make_pth("7", n_layer=2, n_embd=128, vocab_size=65536)
    clean = rwkv_engine.load(path)
    model = BadLogits(clean, bad)
    prompt = "a b c a b c a b c a b"  # prompt lookup finds drafts in it
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[]),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=8, stop_token_ids=[]),
    ]
    for p in params:
        for spec in (None, "lookup", DraftModel(clean), DraftModel(model)):
            with pytest.raises(ModelOutputError, match="NaN or infinite"):
                generate(model, tok, prompt, p, speculative=spec).read()
    requests = [Request(tok.encode(prompt), p, speculative=s) for p in params for s in ("off", "lookup", "draft")]
    config = EngineConfig(max_batch=6, draft=str(path), state_cache_bytes=0)
    results, _ = run_engine(model, tok, requests, config)
    for request, (_, fin) in zip(requests, results):
        assert fin.reason == "error" and "NaN or infinite" in fin.message, (request.speculative, fin)


# --- the serving engine: speculating and plain rows in one batch ------------------------------


def spec_requests(tok, requests):
    """(prompt, params, speculative) -> engine Requests."""
    from rwkv_engine.serve.engine import Request

    return [Request(tok.encode(prompt), params, speculative=spec) for prompt, params, spec in requests]


def test_engine_mixes_speculating_and_plain_rows(model, tok, version, make_pth):
    from rwkv_engine.serve.engine import EngineConfig

    small = str(make_pth(version, **{**WORLD, "n_layer": 1, "seed": 5}))  # a draft that is often wrong
    greedy = SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=[])
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=10, stop_token_ids=[])
    requests = [
        (PROMPT, greedy, None),  # the engine's default: lookup
        (PROMPT + " a", greedy, "off"),
        ("x = [1, 2, 3, 1, 2, 3, 1, 2", greedy, "draft"),
        (PROMPT, seeded, "off"),
        (PROMPT, greedy.replace(stop=["b"], max_tokens=24), "draft"),
    ]
    config = EngineConfig(max_batch=5, speculative="lookup", draft=small, max_draft=4)
    results, engine = run_engine(model, tok, spec_requests(tok, requests), config)
    for (prompt, params, spec), (text, fin) in zip(requests, results):
        want = generate(model, tok, prompt, params)
        assert text == want.read() and fin.reason == want.finish_reason, (prompt, spec)
    sp = engine.speculative
    assert sp.accepted < sp.drafted  # drafts were verified in the batch and rejected (accepted: below)
    gauges = engine.gauges()
    assert gauges["speculative_tokens_per_pass"] >= 1 and 0 <= gauges["speculative_acceptance_rate"] < 1


def test_engine_verify_passes_are_cut_to_the_native_step(model):
    """A verify pass of B rows x T tokens over GEMV_MAX_ROWS runs in groups (serve/engine.py
    decode_rows): each row's logits and state are those of its own pass, bit for bit."""
    from rwkv_engine.kernels.native import GEMV_MAX_ROWS
    from rwkv_engine.serve.engine import decode_rows
    from rwkv_engine.state import State

    g = torch.Generator().manual_seed(9)
    B, T = 5, GEMV_MAX_ROWS // 4  # 4 rows a group
    states = [model.forward(torch.randint(0, 65536, (3,), generator=g))[1] for _ in range(B)]
    tokens = torch.randint(0, 65536, (B, T), generator=g)
    logits, after = decode_rows(model, tokens, State.cat(states), all_logits=True)
    assert logits.shape == (B, T, 65536)
    for i, st in enumerate(states):
        alone, ast = model.forward(tokens[i : i + 1], st, all_logits=True)
        assert torch.equal(logits[i], alone[0])
        states_equal(after[i], ast)


def test_default_draft_length_fills_one_read_of_the_weights():
    from rwkv_engine.cli.common import add_speculative_args
    from rwkv_engine.kernels.native import GEMV_MAX_ROWS, GEMV_ROWS_PER_READ
    from rwkv_engine.settings import MAX_PASS_TOKENS

    ap = argparse.ArgumentParser()
    add_speculative_args(ap)
    assert ap.parse_args([]).max_draft == DEFAULT_MAX_DRAFT == GEMV_ROWS_PER_READ - 1
    # (settings.py writes the kernels' limits as numbers: it must not import torch)
    assert MAX_PASS_TOKENS == GEMV_MAX_ROWS
    row = SpeculativeRow(PromptLookup(), Sampler(SamplingParams(), 65536), list(range(5, 20)) + [5])
    row._accepted = row._drafted  # drafts that were always right: the longest draft pays
    row.take(6)  # "5 6" occurred before, followed by 7, 8, ...
    assert len(row.plan()) == GEMV_ROWS_PER_READ  # the last token + 7 drafts
    row.pending = [1, 2, 3, 1, 2]  # after a rejection: fewer drafts, the pass stays in one read
    assert len(row.plan()) == GEMV_ROWS_PER_READ


def _row(drafter, acceptance, max_draft=DEFAULT_MAX_DRAFT):
    row = SpeculativeRow(drafter, Sampler(SamplingParams(), 65536), [1, 2, 3], max_draft)
    row._accepted, row._drafted = acceptance * 100, 100.0
    return row


def test_the_draft_length_follows_acceptance_and_cost():
    # Free drafts (prompt lookup): the better they are, the longer; even poor ones are worth one.
    lengths = [_row(PromptLookup(), a).draft_length() for a in (0.15, 0.4, 0.7, 0.99)]
    assert lengths == sorted(lengths) and lengths[0] >= 1 and lengths[-1] == DEFAULT_MAX_DRAFT
    # A draft model that reads a third of the target's bytes: a poor one pays less than plain
    # decoding (no drafts; the bench's random q4 twin agreed on 27%), a good one pays.
    twin = Drafter()
    twin.cost = 0.35
    assert _row(twin, 0.27).draft_length() == 0
    assert _row(twin, 0.8).draft_length() >= 2


def test_drafting_pauses_then_probes():
    twin = Drafter()
    twin.cost = 0.35
    row = _row(twin, 0.1)
    seen = [row.draft_length() for _ in range(1 + 1 + 2 + 1 + 4 + 1)]
    # no length pays: 0 (pause 1, probe), 0 0 (pause 2, probe), 0 0 0 0 (pause 4, probe) ...
    assert seen == [0, 1, 0, 0, 1, 0, 0, 0, 0, 1]


def test_a_model_draft_is_priced_by_the_bytes_it_reads(model, version, make_pth):
    small = rwkv_engine.load(make_pth(version, **{**WORLD, "n_layer": 1, "seed": 5}))
    drafter = make_drafter("draft", model, small)

    def nbytes(m):  # what a step reads: the blocks and the head, one row of the embedding
        return sum(t.numel() * t.element_size() for t in [*m.blocks.state_dict().values(), m.head.weight])

    assert drafter.cost == pytest.approx(nbytes(small) / nbytes(model), abs=1e-3) and drafter.cost < 1
    assert drafter.for_params(SamplingParams()).cost == drafter.cost
    assert DraftModel(small).cost is None and DraftModel(small).priced(model).cost == drafter.cost


def test_a_draft_model_reads_the_prompt_during_prefill(model, tok):
    fed = []

    class Counting(torch.nn.Module):  # the draft model, recording what each forward reads
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, tokens, state=None):
            fed.append(len(tokens))
            return self.inner.forward(tokens, state=state)

    params = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[])
    gen = generate(model, tok, PROMPT, params, speculative=DraftModel(Counting(model)))
    gen.read()
    # the prompt alone, in the prefill (the first draft would read it with the first token), then
    # only the decided tokens
    assert fed[0] == len(gen.prompt_tokens) and max(fed[1:]) <= DEFAULT_MAX_DRAFT + 1
    assert gen.text == generate(model, tok, PROMPT, params).read()


def test_engine_draft_rows(model, tok, version, make_pth):
    from rwkv_engine.serve.engine import EngineConfig

    greedy = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[])
    path = str(make_pth(version, **WORLD))  # the target itself as the draft: every draft accepted
    requests = [(PROMPT, greedy, "draft"), ("Hello", greedy, "draft"), ("Hello", greedy, None)]
    results, engine = run_engine(model, tok, spec_requests(tok, requests), EngineConfig(max_batch=3, draft=path))
    for (prompt, params, _), (text, _) in zip(requests, results):
        assert text == generate(model, tok, prompt, params).read()
    assert engine.speculative.acceptance_rate == 1.0


class CountingDraft(Wrapped):
    """A draft model recording each forward's length and whether it ran inside a decode step."""

    def __init__(self, inner, inside: list[bool]):
        super().__init__(inner)
        self.inside, self.reads = inside, []

    def forward(self, tokens, state=None, all_logits=False):
        self.reads.append((len(tokens), self.inside[0]))
        return self.inner.forward(tokens, state=state, all_logits=all_logits)


def test_engine_draft_reads_are_scheduled_like_prompts(tok, make_pth, monkeypatch):
    """R6: the server read a speculating row's prompt on the draft model in one piece inside a
    decode step (every row waited for it), and after a pause the draft read every token it had
    missed there too. Long reads of the draft are now prefill work: pieces of at most
    --prefill-chunk tokens between decode steps, round-robin with the prompts; inside a decode
    step the draft reads at most one pass (MAX_PASS_TOKENS tokens)."""
    from rwkv_engine.serve.engine import Engine, EngineConfig
    from rwkv_engine.settings import MAX_PASS_TOKENS

    inside = [False]
    model = rwkv_engine.load(make_pth("7", **WORLD))  # (one version: the engine's scheduling is under test)
    # A draft that is nearly always wrong and costs about a target step: drafting pauses, for
    # up to 32 passes, so the draft falls behind by more than a pass.
    draft = CountingDraft(rwkv_engine.load(make_pth("7", **{**WORLD, "n_layer": 1, "seed": 9})), inside)
    step = Engine._decode_step

    def decode_step(self):
        inside[0] = True
        try:
            step(self)
        finally:
            inside[0] = False

    monkeypatch.setattr(Engine, "_decode_step", decode_step)
    chunk = 32
    greedy = SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[])
    prompt = " ".join(f"w{i}" for i in range(60))  # some 120 tokens
    requests = [(prompt, greedy, "draft"), ("Hello", greedy, None)]
    config = EngineConfig(max_batch=2, prefill_chunk=chunk, draft=draft, state_cache_bytes=0)
    results, engine = run_engine(model, tok, spec_requests(tok, requests), config)
    for (text, params, _), (got, _) in zip(requests, results):
        assert got == generate(model, tok, text, params).read()
    n_prompt = len(tok.encode(prompt))
    assert max(n for n, within in draft.reads if within) <= MAX_PASS_TOKENS
    scheduled = [n for n, within in draft.reads if not within]
    assert max(scheduled) <= chunk and sum(scheduled) > n_prompt  # the prompt, then a catch-up
    assert engine.speculative.drafted > 0


def test_chat_session_speculative_replies_match_plain(model, tok):
    from rwkv_engine.chat import ChatSession

    params = SamplingParams(temperature=0.0, max_tokens=12)
    plain = ChatSession(model, tok, params, system="")
    spec = ChatSession(model, tok, params, system="", speculative=DraftModel(model), max_draft=4)
    for message in ("Hello there", "Say it again"):
        assert "".join(spec.ask(message)) == "".join(plain.ask(message))
        states_equal(spec.state, plain.state)
    assert spec.last_stats.speculative.accepted > 0 and "tokens per pass" in spec.stats()


def test_request_field_is_validated():
    from pydantic import ValidationError

    from rwkv_engine.serve import protocol

    ok = protocol.CompletionRequest.model_validate({"model": "m", "prompt": "x", "speculative": "lookup"})
    assert ok.speculative == "lookup"
    with pytest.raises(ValidationError):
        protocol.ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "speculative": "fast"}
        )


class Wrong(Drafter):
    """Always proposes a token the model does not pick (token 0 is banned below)."""

    def propose(self, context, k):
        return [0] * k, None


def test_a_draft_that_is_always_wrong_is_paused(model, tok):
    a, b = plain_and_spec(model, tok, PROMPT, Wrong(), max_tokens=40, banned_token_ids=[0], stop_token_ids=[])
    same(a, b)
    st = b.stats.speculative
    assert st.accepted == 0 and 0 < st.drafted < 20
