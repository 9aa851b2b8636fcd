"""The OpenAI API beyond plain generation: log-probabilities, echo, n choices, prompt lists,
/tokenize and /detokenize, against a live `rwkv-engine serve` (the fixtures of test_serve.py).

The references are independent of the server: log-probabilities against `log_softmax` of
`model.forward(..., all_logits=True)` run here on the same checkpoint; choices and prompt lists
against single requests (and `rwkv_engine.generate`); tokens against the tokenizer; and the
echo answer is read by lm-evaluation-harness's own `local-completions` parser.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import rwkv_engine
from rwkv_engine import SamplingParams

from .test_serve import (  # noqa: F401  (fixtures)
    CHUNK,
    GREEDY,
    MODEL,
    client,
    client_kwargs,
    drop_stream,
    files,
    ref,
    reference,
    sampled,
    server,
)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

ATOL = 2e-4  # the server's per-row decode kernels vs one whole-sequence forward: rounding only


def forward_logp(ref, ids: list[int]) -> torch.Tensor:
    """[T, V]: row t is log p(. | ids[:t + 1]) by the reference model."""
    logits, _ = ref[0].forward(ids, all_logits=True)
    return torch.log_softmax(logits.float(), dim=-1)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


# --- log-probabilities --------------------------------------------------------------------------


def test_completion_logprobs_match_forward(ref, client):
    prompt, sampling = "The quick brown fox", sampled(21)
    tok = ref[1]
    want = reference(ref, prompt, 10, sampling)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, logprobs=3, **client_kwargs(sampling))
    choice = got.choices[0]
    assert choice.text == want.text
    lp = choice.logprobs
    ids = tok.encode(prompt) + list(want.tokens)
    logp = forward_logp(ref, ids)
    P = len(tok.encode(prompt))
    assert lp.tokens == [tok.decode_bytes([t]).decode("utf-8", errors="replace") for t in want.tokens]
    for j, t in enumerate(want.tokens):
        row = logp[P + j - 1]
        assert lp.token_logprobs[j] == pytest.approx(float(row[t]), abs=ATOL)
        values, top_ids = torch.topk(row, 3)
        top = lp.top_logprobs[j]
        # The 3 most probable, plus the sampled token when it is not among them.
        assert len(top) == 3 + (t not in top_ids.tolist())
        for v, i in zip(values.tolist(), top_ids.tolist()):
            assert top[tok.decode_bytes([i]).decode("utf-8", errors="replace")] == pytest.approx(v, abs=ATOL)
    # text_offset: where each token's text starts in the returned text.
    assert lp.text_offset == [len(tok.decode(want.tokens[:j])) for j in range(len(want.tokens))]

    # Streamed: the same numbers, split over the chunks.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, logprobs=3, stream=True, **client_kwargs(sampling)
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_logprobs_match_forward_and_stream(ref, client):
    messages = [{"role": "user", "content": "Say something 🙂"}]
    prompt = "User: Say something 🙂\n\nAssistant:"
    sampling = sampled(8)
    kw = dict(model=MODEL, messages=messages, max_tokens=12, logprobs=True, top_logprobs=4, **client_kwargs(sampling))
    got = client.chat.completions.create(**kw)
    tok = ref[1]
    want = reference(ref, prompt, 12, sampling, stop=("\n\n",))
    content = got.choices[0].logprobs.content
    generated = list(want.tokens)
    assert len(content) == len(generated) == got.usage.completion_tokens, "12 tokens, no stop (or fix the seed)"
    assert [bytes(c.bytes) for c in content] == [tok.decode_bytes([t]) for t in generated]
    assert (
        b"".join(bytes(c.bytes) for c in content).decode("utf-8", errors="replace")[1:]
        == got.choices[0].message.content
    )
    ids = tok.encode(prompt) + generated
    logp = forward_logp(ref, ids)
    P = len(tok.encode(prompt))
    for j, (c, t) in enumerate(zip(content, generated)):
        row = logp[P + j - 1]
        assert c.logprob == pytest.approx(float(row[t]), abs=ATOL)
        values, top_ids = torch.topk(row, 4)
        assert [bytes(x.bytes) for x in c.top_logprobs] == [tok.decode_bytes([i]) for i in top_ids.tolist()]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(values.tolist(), abs=ATOL)

    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [(x.token, x.logprob, x.bytes) for x in streamed] == [(x.token, x.logprob, x.bytes) for x in content]


def test_logprobs_the_same_batched_or_alone(server):
    bodies = [
        dict(model=MODEL, prompt=f"Tale {i} of the river", max_tokens=12, logprobs=2, **sampled(40 + i))
        for i in range(6)
    ]
    alone = [post(server, "/v1/completions", b).json()["choices"][0]["logprobs"] for b in bodies]

    async def together():
        async with httpx.AsyncClient(timeout=60) as ac:
            rs = await asyncio.gather(*(ac.post(server.url + "/v1/completions", json=b) for b in bodies))
        return [r.json()["choices"][0]["logprobs"] for r in rs]

    assert asyncio.run(together()) == alone


def test_logprobs_bad_values(server):
    base = dict(model=MODEL, prompt="x", max_tokens=2)
    assert post(server, "/v1/completions", {**base, "logprobs": 21}).status_code == 400
    assert post(server, "/v1/completions", {**base, "logprobs": -1}).status_code == 400
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    r = post(server, "/v1/chat/completions", {**chat, "top_logprobs": 3})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
    assert post(server, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}).status_code == 400


# --- ignore_eos and min_tokens (vLLM's extensions) -----------------------------------------------


def test_ignore_eos_and_min_tokens(ref, server, client):
    """End-of-text made certain by a logit bias ends a request at once; with ignore_eos the same
    request runs to max_tokens (token 0 has no text), streamed too. min_tokens keeps the stop
    token and stop strings out until then, and the answer is `generate`'s with the same params."""
    model, tok = ref
    prompt, bias = "The capital of France is", {"0": 100}

    def create(max_tokens=6, stop=None, **extra):
        kw = client_kwargs(GREEDY)
        kw["extra_body"].update(extra)
        return client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            stop=stop,
            logit_bias=bias if stop is None else None,
            **kw,
        )

    got = create()
    assert (got.choices[0].finish_reason, got.usage.completion_tokens, got.choices[0].text) == ("stop", 0, "")
    got = create(ignore_eos=True)
    assert (got.choices[0].finish_reason, got.usage.completion_tokens, got.choices[0].text) == ("length", 6, "")
    kw = client_kwargs(GREEDY)
    kw["extra_body"]["ignore_eos"] = True
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        logit_bias=bias,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    assert list(stream)[-1].usage.completion_tokens == 5
    got = create(min_tokens=3)
    assert (got.choices[0].finish_reason, got.usage.completion_tokens) == ("stop", 3)

    # A stop string that the plain answer meets early is held off by min_tokens.
    free = SamplingParams(max_tokens=24, **GREEDY)
    full = rwkv_engine.generate(model, tok, prompt, free)
    full.read()
    stop = full.text[2:4]
    early = len(tok.encode(prompt + full.text[:4])) - len(tok.encode(prompt))  # tokens up to the stop, about
    want = rwkv_engine.generate(model, tok, prompt, free.replace(stop=(stop,), min_tokens=early + 4))
    want.read()
    got = create(max_tokens=24, stop=[stop], min_tokens=early + 4)
    assert got.choices[0].text == want.text and len(want.text) > 2
    assert got.usage.completion_tokens == len(want.tokens) >= early + 4

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, logit_bias=bias)
    r = post(server, "/v1/chat/completions", {**chat, **GREEDY, "min_tokens": 4}).json()
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "stop"
    for bad in ({"min_tokens": 9}, {"min_tokens": -1}, {"min_tokens": "2"}, {"ignore_eos": 1}):
        r = post(server, "/v1/chat/completions", {**chat, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text


# --- echo ---------------------------------------------------------------------------------------


def lm_eval_parse(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    lm_eval = pytest.importorskip("lm_eval.models.openai_completions")
    return lm_eval.LocalCompletionsAPI.parse_logprobs(outputs=response, ctxlens=ctxlens)


def test_echo_loglikelihood_as_lm_eval_sends_it(ref, server, client):
    """lm-eval's local-completions request: token-id prompts, 4 at a time, logprobs 1, echo, max_tokens 1.

    Prompt lengths cross prefill chunks; one prompt's prefix is in the prompt cache first (an echo
    must still get every position's log-probability)."""
    tok = ref[1]
    text = " ".join(f"word{i}" for i in range(400))
    base = tok.encode(text)
    prompts = [base[:5], base[: CHUNK + 40], base[7 : 7 + 2 * CHUNK + 3], tok.encode("The answer is yes")]
    client.completions.create(model=MODEL, prompt=base[: CHUNK + 40], max_tokens=1)  # fills the cache
    ctxlens = [2, CHUNK, 100, 3]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    want = []
    for ids, c, ctx in zip(prompts, out["choices"], ctxlens):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the one generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert c["text"].startswith(tok.decode(ids))
        logp = forward_logp(ref, ids)
        expected = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=ATOL)
        greedy_next = int(logp[-1].argmax())
        assert lp["token_logprobs"][-1] == pytest.approx(float(logp[-1, greedy_next]), abs=ATOL)
        for t in range(1, len(ids)):  # the top entry is the argmax, equal to the token's own when greedy
            top = lp["top_logprobs"][t]
            assert max(top.values()) == pytest.approx(float(logp[t - 1].max()), abs=ATOL)
            if int(logp[t - 1].argmax()) == ids[t]:
                assert max(top.values()) == lp["token_logprobs"][t]
        cont = [float(logp[t - 1, ids[t]]) for t in range(ctx, len(ids))]
        is_greedy = all(int(logp[t - 1].argmax()) == ids[t] for t in range(ctx, len(ids)))
        want.append((sum(cont), is_greedy))
    got = lm_eval_parse(out, ctxlens)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=ATOL * 300)
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_echo_with_zero_tokens_and_streamed(ref, server, client):
    tok = ref[1]
    prompt = "Echo me back, please"
    ids = tok.encode(prompt)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    c = got.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.text_offset == [len(tok.decode(ids[:j])) for j in range(len(ids))]
    # logprobs 0: the token's own log-probability only
    assert all(list(top) == [t] for top, t in zip(c.logprobs.top_logprobs[1:], c.logprobs.tokens[1:]))
    assert got.usage.completion_tokens == 0

    # Echo without logprobs: the prompt text before the answer.
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, **client_kwargs(GREEDY))
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **client_kwargs(GREEDY))
    assert plain.choices[0].text == prompt + alone.choices[0].text

    # Streamed: the first chunk is the prompt with its log-probabilities.
    full = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2, **client_kwargs(GREEDY)
    )
    chunks = [
        c
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2, stream=True, **client_kwargs(GREEDY)
        )
        if c.choices
    ]
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((x.token_logprobs for x in lps), []) == full.choices[0].logprobs.token_logprobs
    assert sum((x.text_offset for x in lps), []) == full.choices[0].logprobs.text_offset

    # The end-of-text token that stops an answer has its entry (lm-eval counts on one generated entry).
    eos = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, logit_bias={"0": 100}, temperature=0
    )
    c = eos.choices[0]
    assert c.finish_reason == "stop" and c.text == prompt and eos.usage.completion_tokens == 0
    assert len(c.logprobs.token_logprobs) == len(ids) + 1 and c.logprobs.tokens[-1] == ""
    assert c.logprobs.token_logprobs[-1] == pytest.approx(float(forward_logp(ref, ids)[-1, 0]), abs=ATOL)

    r = post(server, "/v1/completions", dict(model=MODEL, prompt=prompt, max_tokens=0))
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


# --- n choices and prompt lists -----------------------------------------------------------------


def test_n_choices_equal_single_requests_with_derived_seeds(ref, server, client):
    prompt, sampling = "In the beginning", sampled(7)
    prefilled = lambda: server.metrics()["rwkv_engine_prefill_tokens_total"]
    before = prefilled()
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=3, **client_kwargs(sampling))
    assert prefilled() - before == len(ref[1].encode(prompt))  # one prefill for the three choices
    assert [c.index for c in got.choices] == [0, 1, 2]
    singles = [
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, **client_kwargs({**sampling, "seed": 7 + i})
        )
        for i in range(3)
    ]
    assert [c.text for c in got.choices] == [s.choices[0].text for s in singles]
    assert [c.text for c in got.choices] == [
        reference(ref, prompt, 12, {**sampling, "seed": 7 + i}).text for i in range(3)
    ]
    assert len({c.text for c in got.choices}) > 1, "different seeds should give different choices"
    assert got.usage.prompt_tokens == singles[0].usage.prompt_tokens  # one prompt, read once
    assert got.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)

    # Chat, streamed: each chunk names its choice.
    messages = [{"role": "user", "content": "Tell me a story"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=10, **client_kwargs(sampled(30)))
    chat = client.chat.completions.create(n=2, **kw)
    texts = ["", ""]
    for ch in client.chat.completions.create(n=2, stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]
    single = client.chat.completions.create(**{**kw, "seed": 31})
    assert chat.choices[1].message.content == single.choices[0].message.content


def test_prompt_lists_equal_single_requests(ref, server, client):
    tok = ref[1]
    prompts = ["A red door", tok.encode("Seven blue birds"), "Under the bridge"]
    sampling = sampled(50)
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=2, **client_kwargs(sampling))
    assert [c.index for c in got.choices] == list(range(6))
    for k, c in enumerate(got.choices):
        p, j = divmod(k, 2)
        single = client.completions.create(
            model=MODEL, prompt=prompts[p], max_tokens=8, **client_kwargs({**sampling, "seed": 50 + j})
        )
        assert c.text == single.choices[0].text, k
    lens = [len(tok.encode(p)) if isinstance(p, str) else len(p) for p in prompts]
    assert got.usage.prompt_tokens == sum(lens)

    texts = [""] * 6
    for ch in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, n=2, stream=True, **client_kwargs(sampling)
    ):
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in got.choices]

    base = dict(model=MODEL, max_tokens=2)
    for bad in ([], [[]], [1, "a"], [[1, 2], [True]], [["a"]]):
        assert post(server, "/v1/completions", {**base, "prompt": bad}).status_code == 400, bad
    # R2: more choices than one request may hold rows at once (--max-batch 8) take turns.
    r = post(server, "/v1/completions", {**base, "prompt": "x", "n": 9, "logprobs": 20, **sampled(60)})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(9))
    assert [c["text"] for c in choices] == [reference(ref, "x", 2, sampled(60 + i)).text for i in range(9)]
    assert all(len(c["logprobs"]["token_logprobs"]) == 2 for c in choices)
    r = post(server, "/v1/completions", {**base, "prompt": "x", "n": 129})  # OpenAI's limit is 128
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert post(server, "/v1/completions", {**base, "prompt": "x", "best_of": 2}).status_code == 400


def test_disconnect_cancels_every_choice(server):
    """A client that drops a stream of 2 prompts x 2 choices frees all four batch rows."""
    cancelled = lambda m: m.get('rwkv_engine_requests_total{outcome="cancelled"}', 0.0)
    base = cancelled(server.metrics())
    body = {
        "model": MODEL,
        "prompt": ["Go", "Run"],
        "n": 2,
        "stream": True,
        "max_tokens": 4000,
        "logit_bias": {"0": -100},
        "temperature": 0,
        "logprobs": 1,
    }
    drop_stream(server, body, events=12)
    m = server.wait_metric("rwkv_engine_requests_running", lambda v: v == 0, timeout=10)
    assert cancelled(m) == base + 4


# --- tokenize -----------------------------------------------------------------------------------


def test_tokenize_and_detokenize(ref, server):
    tok = ref[1]
    text = "Hello, wörld! 你好 🙂"
    ids = tok.encode(text)
    for path in ("/tokenize", "/v1/tokenize"):
        for field in ("content", "prompt"):
            r = post(server, path, {field: text, "add_special": False})
            assert r.status_code == 200 and r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    pieces = post(server, "/tokenize", {"content": "🙂", "with_pieces": True}).json()["tokens"]
    assert (
        b"".join(bytes(x["piece"]) if isinstance(x["piece"], list) else x["piece"].encode() for x in pieces)
        == "🙂".encode()
    )
    for path in ("/detokenize", "/v1/detokenize"):
        out = post(server, path, {"tokens": ids}).json()
        assert out["content"] == out["prompt"] == text
    for path, body in (
        ("/tokenize", {}),
        ("/tokenize", {"content": "a", "prompt": "b"}),
        ("/tokenize", {"content": 5}),
        ("/detokenize", {"tokens": [70000]}),
        ("/detokenize", {"tokens": "abc"}),
        ("/detokenize", {"tokens": [-1]}),
        ("/tokenize", {"content": "a", "model": "other"}),
    ):
        r = post(server, path, body)
        assert r.status_code in (400, 404) and "error" in r.json(), (path, body, r.text)


def test_lm_eval_local_completions_loglikelihood(ref, server):
    """lm-evaluation-harness's own `local-completions` model (token-id prompts, batches of 4),
    which finds the server's tokenizer through /tokenizer_info and /tokenize: its loglikelihoods
    equal log_softmax of model.forward, its generate_until answers equal `generate`."""
    api = pytest.importorskip("lm_eval.models.openai_completions")
    from lm_eval.api.instance import Instance

    lm = api.LocalCompletionsAPI(
        base_url=server.url + "/v1/completions",
        model=MODEL,
        tokenized_requests=True,
        batch_size=4,
        max_retries=1,
        custom_prefix_token_id=0,
    )
    assert lm.tokenizer_backend == "remote"
    pairs = [
        ("The cat sat on the", " mat"),
        ("Two plus two is", " four"),
        ("Paris is in", " France today"),
        ("A B C D E F G", " H"),
        ("", "Hello world"),
    ]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    tok = ref[1]
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        if context:  # lm-eval encodes the whole text and the context, and splits
            ctx, whole = tok.encode(context), tok.encode(context + continuation)
        else:  # its prefix token (custom_prefix_token_id) stands for an empty context
            ctx, whole = [0], [0] + tok.encode(continuation)
        logp = forward_logp(ref, whole)
        want = sum(float(logp[t - 1, whole[t]]) for t in range(len(ctx), len(whole)))
        assert ll == pytest.approx(want, abs=1e-3), (context, continuation)
        assert greedy == all(int(logp[t - 1].argmax()) == whole[t] for t in range(len(ctx), len(whole)))

    # generate_until: the same batches of token-id prompts; what lm-eval leaves out takes the
    # API's defaults (it sends temperature 0, so: plain greedy decoding, no penalties).
    contexts = ["The cat sat on the", "Two plus two is", "Paris is in", LOOPING]
    gen = [
        Instance(request_type="generate_until", doc={}, arguments=(c, {"until": ["\n"], "max_gen_toks": 16}), idx=i)
        for i, c in enumerate(contexts)
    ]
    want = [reference(ref, tok.encode(c), 16, PLAIN_GREEDY, stop=("\n",)).text for c in contexts]
    assert any(want) and lm.generate_until(gen, disable_tqdm=True) == want


# --- sampling fields a request leaves out ---------------------------------------------------------

PLAIN_GREEDY = dict(temperature=0.0, top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0)
# The prompt whose greedy continuation repeats a token at its 13th (on the test model): where a
# penalty a request never asked for changes the answer.
LOOPING = "User: hi\n\nAssistant:"


def test_omitted_fields_take_openai_defaults(ref, client):
    """R7: a request that names only temperature 0 gets plain greedy decoding, as on any other
    OpenAI-compatible server of the same weights: omitted penalties are the API's 0, on both
    endpoints (they were RWKV's 0.2 for completions and 0.5 for chat, which change this answer)."""
    plain = reference(ref, LOOPING, 16, PLAIN_GREEDY).text
    assert (
        plain != reference(ref, LOOPING, 16, {**PLAIN_GREEDY, "presence_penalty": 0.2, "frequency_penalty": 0.2}).text
    )
    got = client.completions.create(model=MODEL, prompt=LOOPING, max_tokens=16, temperature=0)
    assert got.choices[0].text == plain

    reply = reference(ref, LOOPING, 16, PLAIN_GREEDY, stop=("\n\n",)).text.removeprefix(" ")
    chat_preset = {**PLAIN_GREEDY, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    assert reply != reference(ref, LOOPING, 16, chat_preset, stop=("\n\n",)).text.removeprefix(" ")
    messages = [{"role": "user", "content": "hi"}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == reply


def test_serve_sampling_flags_set_the_defaults(ref, files):
    """R7: `serve --presence-penalty X --frequency-penalty Y` gives requests that name no
    penalties those values (here RWKV's completion preset, 0.2: the answer the old default gave),
    on the app `serve` builds; a bad value is one clear error naming the flag."""
    from fastapi.testclient import TestClient

    from rwkv_engine.cli import serve
    from rwkv_engine.errors import InputError
    from rwkv_engine.serve.server import build

    penalized = {**PLAIN_GREEDY, "presence_penalty": 0.2, "frequency_penalty": 0.2}
    config, _ = serve.parse([str(files["model"]), "--presence-penalty", "0.2", "--frequency-penalty", "0.2"])
    engine, app = build(config, progress=False)
    with TestClient(app, base_url="http://127.0.0.1") as http:  # (a loopback Host, as the server checks)
        body = {"prompt": LOOPING, "max_tokens": 16, "temperature": 0}
        got = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert got == reference(ref, LOOPING, 16, penalized).text != reference(ref, LOOPING, 16, PLAIN_GREEDY).text
        named = http.post("/v1/completions", json={**body, "presence_penalty": 0, "frequency_penalty": 0}).json()
        assert named["choices"][0]["text"] == reference(ref, LOOPING, 16, PLAIN_GREEDY).text  # the request wins
    with pytest.raises(InputError, match=r"^--top-p must be in \(0, 1\]"):
        serve.parse([str(files["model"]), "--top-p", "0"])
