"""`rwkv-engine serve` as a real server process, driven by real clients.

The server runs in a subprocess on a free loopback port, on a tiny random-weight World model
(vocab 65536, so the real World tokenizer applies). It is driven with the official `openai`
package (completions, chat, streaming) and with raw HTTP (httpx) for what a well-behaved client
never sends. The reference for every generated text is `rwkv_engine.generate` run here, in the
test process, on the same checkpoint: the server's batched, chunk-prefilled, cached decoding
must give the same tokens as one sequence run alone.

They are the same bit for bit, not just up to rounding, so the comparisons hold for any
sampling, also a nucleus of thousands of near-equal tokens (top_p up to 1, no top_k, on the
flat distributions of a random model), where a logit moved by 1e-6 could move a draw:
* decode runs per-row kernels (the fused native step for up to GEMV_MAX_ROWS rows; the engine
  steps a larger batch in groups of that many), so row i of a batched step has the logits and
  state of its sequence stepped alone;
* the sampler samples row by row with each request's own generator, as `generate` does;
* the server prefills a prompt in --prefill-chunk pieces and `generate` in one forward, both cut
  by `prefill_end`, whose pieces always take the same row-wise kernels, so the two give the same
  bits (checked directly by test_prefill_pieces_and_decode_groups_are_bit_identical).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import rwkv_engine  # noqa: E402
from rwkv_engine import SamplingParams  # noqa: E402
from rwkv_engine.kernels.native import GEMV_MAX_ROWS  # noqa: E402
from rwkv_engine.models.model import prefill_end  # noqa: E402
from rwkv_engine.serve.engine import decode_rows  # noqa: E402
from rwkv_engine.state import State  # noqa: E402
from rwkv_engine.testing import random_state_dict, save_pth  # noqa: E402

MODEL = "tiny-world"
LIMITED = "limited"
API_KEY = "sekret-key"
CHUNK = 128  # --prefill-chunk of the main server
REPO_ROOT = Path(rwkv_engine.__file__).resolve().parent.parent

GREEDY = dict(temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0, frequency_penalty=0.0, penalty_decay=0.996)


def sampled(seed: int) -> dict:
    return dict(
        temperature=0.9,
        top_p=0.9,
        top_k=40,
        presence_penalty=0.3,
        frequency_penalty=0.3,
        penalty_decay=0.996,
        seed=seed,
    )


def nucleus(seed: int, top_p: float, penalty: float = 0.0) -> dict:
    """Wide nucleus sampling: temperature 1, no top_k (thousands of candidates on a random model)."""
    return dict(
        temperature=1.0,
        top_p=top_p,
        presence_penalty=penalty,
        frequency_penalty=penalty,
        penalty_decay=0.996,
        seed=seed,
    )


def client_kwargs(sampling: dict) -> dict:
    """The sampling dict as `openai` create() arguments (extensions go in extra_body)."""
    extra = {k: sampling[k] for k in ("top_k", "penalty_decay") if k in sampling}
    std = {k: v for k, v in sampling.items() if k not in extra}
    return {**std, "extra_body": extra}


# --- the server processes ---------------------------------------------------------------------


class Server:
    def __init__(self, model_path: Path, log_path: Path, *flags: str):
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # `rwkv-engine serve ...` through the package's own entry point (this checkout's code).
        cmd = [
            sys.executable,
            "-c",
            "import sys; from rwkv_engine.cli import main; sys.exit(main())",
            "serve",
            str(model_path),
            "--port",
            "0",
            "--log-level",
            "warning",
            *flags,
        ]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_ready()

    def log(self) -> str:
        return self.log_path.read_text()

    def _wait_ready(self, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            if url is None:
                m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", self.log())
                url = m and m.group(1)
            if url:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not come up:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return parse_prometheus(text)

    def wait_metric(self, name: str, predicate, timeout: float = 10.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m.get(name, 0.0)):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} = {m.get(name)} after {timeout}s")
            time.sleep(0.05)


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, checking every metric has HELP and TYPE first."""
    declared, samples = set(), {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            declared.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge"), line
        elif line:
            m = re.fullmatch(r'([a-z_]+)(\{[a-z_]+="[^"]*"(?:,[a-z_]+="[^"]*")*\})? (\S+)', line)
            assert m, f"not a sample line: {line!r}"
            assert m.group(1) in declared, f"sample before its HELP: {line!r}"
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    model_path = save_pth(
        random_state_dict(version="5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=3),
        d / f"{MODEL}.pth",
    )
    states = d / "states"
    states.mkdir()
    (d / "secret.safetensors").write_bytes(b"not for clients")
    return {"dir": d, "model": model_path, "states": states}


@pytest.fixture(scope="module")
def ref(files):
    model = rwkv_engine.load(files["model"])
    return model, rwkv_engine.load_tokenizer(model)


@pytest.fixture(scope="module")
def server(files):
    s = Server(
        files["model"],
        files["dir"] / "server.log",
        "--max-batch",
        "8",
        "--max-queue",
        "64",
        "--prefill-chunk",
        str(CHUNK),
        "--state-dir",
        str(files["states"]),
        "--max-tokens",
        "4000",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def limited(files):
    s = Server(
        files["model"],
        files["dir"] / "limited.log",
        "--served-model-name",
        LIMITED,
        "--api-key",
        API_KEY,
        "--max-batch",
        "1",
        "--max-queue",
        "1",
        "--max-body-kb",
        "1",
        "--max-prompt-tokens",
        "64",
        "--max-tokens",
        "3000",
    )
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(ref, prompt, max_tokens: int, sampling: dict, stop=(), state=None, logit_bias=None):
    model, tok = ref
    params = SamplingParams(max_tokens=max_tokens, stop=stop, logit_bias=logit_bias or {}, **sampling)
    gen = rwkv_engine.generate(model, tok, prompt, params, state=state)
    gen.read()
    return gen


# --- completions and chat against the reference -------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert client.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize("sampling", [GREEDY, sampled(11)], ids=["greedy", "seeded"])
def test_completion_matches_generate(ref, client, sampling):
    prompt = "The capital of France is"
    want = reference(ref, prompt, 24, sampling)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **client_kwargs(sampling))
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(ref[1].encode(prompt))
    assert got.usage.completion_tokens == len(want.tokens)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens

    # Streamed: the same text in pieces, a final chunk with the finish reason, then the usage.
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        **client_kwargs(sampling),
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)


def test_completion_token_ids_and_stop_string(ref, client):
    ids = ref[1].encode("Once upon a time")
    sampling = sampled(5)
    full = reference(ref, ids, 30, sampling).text
    stop = full[6:8]
    assert stop.strip(), "the reference text should have something to stop on"
    got = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=30, stop=[stop, "never-there"], **client_kwargs(sampling)
    )
    assert got.choices[0].text == full[: full.find(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_chat_world_format_and_stop(ref, client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Name a colour\r\n\n\nplease  "},
    ]
    # Rendered by hand from docs/formats.md D: roles, "\n\n" between turns, user text without "\n\n".
    prompt = (
        "System: You are terse.\n\nUser: Hello there\n\nAssistant: Hi.\n\nUser: Name a colour\nplease\n\nAssistant:"
    )
    sampling = sampled(4)
    bias = {261: 7.0}  # make "\n\n" (the end of a reply) likely soon
    full = reference(ref, prompt, 40, sampling, logit_bias=bias).text
    assert "\n\n" in full, "the reference should reach the end of a reply"
    want = full[: full.find("\n\n")]
    want = want[1:] if want.startswith(" ") else want
    want_tokens = len(reference(ref, prompt, 40, sampling, stop=("\n\n",), logit_bias=bias).tokens)

    kw = client_kwargs(sampling)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, logit_bias={"261": 7.0}, **kw)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.prompt_tokens == len(ref[1].encode(prompt))
    assert got.usage.completion_tokens == want_tokens

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        logit_bias={"261": 7.0},
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == got.usage.prompt_tokens


def complete_concurrently(server, prompts, samplings, max_tokens, timeout):
    """One completion per prompt, all sent at once with the async `openai` client."""

    async def run():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
        async with ac:
            return await asyncio.gather(
                *(
                    ac.completions.create(model=MODEL, prompt=p, max_tokens=n, **client_kwargs(s))
                    for p, s, n in zip(prompts, samplings, max_tokens)
                )
            )

    return asyncio.run(run())


def test_concurrent_requests_batch_and_match_generate(ref, server):
    """Requests decoded together in one batch give the tokens each gives alone."""
    words = ["cat", "sea", "king", "road", "star", "bell", "rain", "wolf"]
    prompts = [f"Story {i}: the {w} was" for i, w in enumerate(words)]
    samplings = [GREEDY if i % 2 == 0 else sampled(100 + i) for i in range(len(prompts))]
    lengths = [28 - 2 * i for i in range(len(prompts))]
    before = server.metrics()

    results = complete_concurrently(server, prompts, samplings, lengths, timeout=60)
    after = server.metrics()
    for p, s, n, r in zip(prompts, samplings, lengths, results):
        want = reference(ref, p, n, s)
        assert r.choices[0].text == want.text, p
        assert r.usage.completion_tokens == len(want.tokens)
    steps = after["rwkv_engine_decode_steps_total"] - before["rwkv_engine_decode_steps_total"]
    rows = after["rwkv_engine_decode_rows_total"] - before["rwkv_engine_decode_rows_total"]
    print(f"\nmean decode batch of 8 concurrent requests: {rows / steps:.2f}")
    assert rows / steps > 1.5, f"requests were not decoded together (mean batch {rows / steps:.2f})"


def test_wide_nucleus_sampling_batched_matches_generate(ref, server):
    """Concurrent requests with top_p 0.9-1.0 and no top_k give, token for token, what each gives alone.

    The prompts (token ids) have lengths on both sides of every cut: shorter than GEMV_MAX_ROWS,
    a chunk and a few tokens (which a cut at the chunk would leave to the GEMV), a chunk and a
    WKV block's part, and more than `generate`'s own PREFILL_CHUNK of 512.
    """
    tok = ref[1]
    text = " ".join(f"{w}{i}" for i, w in enumerate(("harbour lantern meadow copper whistle " * 200).split()))
    ids = tok.encode(text)
    lengths = [3, 12, 40, CHUNK + 5, CHUNK + 20, 2 * CHUNK + 9, 520, 600]
    starts = [17 * i for i in range(len(lengths))]  # different prompts, partly shared prefixes don't matter
    prompts = [ids[s : s + n] for s, n in zip(starts, lengths)]
    assert [len(q) for q in prompts] == lengths
    top_ps = [1.0, 0.9, 0.95, 0.99, 1.0, 0.97, 0.9, 1.0]
    samplings = [nucleus(300 + i, tp, penalty=0.3 * (i % 2)) for i, tp in enumerate(top_ps)]
    assert all("top_k" not in s for s in samplings)
    n_tokens = 40
    before = server.metrics()

    results = complete_concurrently(server, prompts, samplings, [n_tokens] * len(prompts), timeout=120)
    after = server.metrics()
    for q, s, r in zip(prompts, samplings, results):
        want = reference(ref, q, n_tokens, s)
        assert len(want.tokens) > 10, "the reference should sample for a while"
        assert r.choices[0].text == want.text, (len(q), s)
        assert r.usage.completion_tokens == len(want.tokens)
        assert r.choices[0].finish_reason == want.finish_reason
    steps = after["rwkv_engine_decode_steps_total"] - before["rwkv_engine_decode_steps_total"]
    rows = after["rwkv_engine_decode_rows_total"] - before["rwkv_engine_decode_rows_total"]
    assert rows / steps > 1.5, f"requests were not decoded together (mean batch {rows / steps:.2f})"


def test_prefill_pieces_and_decode_groups_are_bit_identical(ref):
    """What the comparisons with `generate` rest on, checked on the logits and states themselves."""
    model, _ = ref
    g = torch.Generator().manual_seed(5)
    V = model.config.vocab_size
    # Prefill: the server's pieces (--prefill-chunk CHUNK and 256) and one forward, bit for bit.
    for n in (12, 40, CHUNK + 5, CHUNK + 16, CHUNK + 17, CHUNK + 20, 2 * CHUNK + 9, 520, 529, 600):
        ids = torch.randint(1, V, (n,), generator=g).tolist()
        want, want_state = model.forward(ids)
        for chunk in (CHUNK, 256):
            pos, state, pieces = 0, None, []
            while pos < n:
                end = prefill_end(pos, n, chunk)
                pieces.append(end - pos)
                logits, state = model.forward(ids[pos:end], state=state)
                pos = end
            assert all(k > GEMV_MAX_ROWS for k in pieces) or pieces == [n], pieces
            assert torch.equal(logits, want), (n, chunk, pieces)
            assert all(torch.equal(t, getattr(want_state, f)) for f, t in state.items()), (n, chunk, pieces)
    # Decode: a batch of more than GEMV_MAX_ROWS rows, each row as if stepped alone.
    B = GEMV_MAX_ROWS + 5
    states = [model.forward(torch.randint(1, V, (4,), generator=g).tolist())[1] for _ in range(B)]
    tokens = torch.randint(1, V, (B, 1), generator=g)
    logits, batch = decode_rows(model, tokens, State.cat(states))
    for i in range(B):
        alone, alone_state = model.forward(tokens[i], state=states[i])
        assert torch.equal(logits[i], alone), i
        assert all(torch.equal(t, getattr(batch, f)[i : i + 1]) for f, t in alone_state.items()), i


def test_prompt_cache_resumes_long_system_prompt(ref, server, client):
    """A second request with the same 2k-token system prompt resumes from the cached state, same output."""
    tok = ref[1]
    words = ["river", "stone", "light", "paper", "engine", "garden", "window", "silver", "morning", "violin", "harbour"]
    system = " ".join(f"{words[i % len(words)]}{i}" for i in range(1100))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}]
    n = len(tok.encode(f"System: {system}\n\nUser: Summarise.\n\nAssistant:"))
    assert n > 2048
    kw = client_kwargs(sampled(7))

    def timed():
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, stream=True, stream_options={"include_usage": True}, **kw
        )
        first, text = None, ""
        for c in stream:
            if c.choices and c.choices[0].delta.content:
                first = first or time.perf_counter() - t0
                text += c.choices[0].delta.content
        return text, c.usage, first

    m0 = server.metrics()
    cold_text, cold_usage, cold_ttft = timed()
    m1 = server.metrics()
    warm_text, warm_usage, warm_ttft = timed()
    m2 = server.metrics()
    print(f"\ntime to first token, {n}-token prompt: cold {cold_ttft * 1e3:.0f} ms, cached {warm_ttft * 1e3:.0f} ms")

    assert cold_usage.prompt_tokens == warm_usage.prompt_tokens == n
    assert cold_usage.prompt_tokens_details.cached_tokens == 0
    # Resumed at the last chunk boundary with more than GEMV_MAX_ROWS tokens after it (prefill_end).
    assert warm_usage.prompt_tokens_details.cached_tokens == (n - GEMV_MAX_ROWS - 1) // CHUNK * CHUNK
    assert warm_text == cold_text
    prefilled = lambda a, b: b["rwkv_engine_prefill_tokens_total"] - a["rwkv_engine_prefill_tokens_total"]
    assert prefilled(m0, m1) == n
    assert prefilled(m1, m2) == n - warm_usage.prompt_tokens_details.cached_tokens
    assert m2["rwkv_engine_prompt_cache_hits_total"] == m1["rwkv_engine_prompt_cache_hits_total"] + 1

    # Another question after the same system prompt: resumes too, and still equals a cold run.
    other = [messages[0], {"role": "user", "content": "And in one word?"}]
    prompt = f"System: {system}\n\nUser: And in one word?\n\nAssistant:"
    got = client.chat.completions.create(model=MODEL, messages=other, max_tokens=12, **client_kwargs(GREEDY))
    assert got.usage.prompt_tokens_details.cached_tokens >= 2048
    want = reference(ref, prompt, 12, GREEDY, stop=("\n\n",)).text
    assert got.choices[0].message.content == (want[1:] if want.startswith(" ") else want)


def test_saved_state_extension(ref, server, client, files):
    model, tok = ref
    _, persona = model.forward(tok.encode("User: who are you?\n\nAssistant: I am a lighthouse keeper.\n\n"))
    persona.save(files["states"] / "keeper.safetensors")
    State(dict(persona.items()), "some-other-model").save(files["states"] / "alien.safetensors")
    # a state-tuning file (RWKV-PEFT's time_state) is read too; RWKV-5.2 has none: refused
    torch.save({"blocks.0.att.time_state": torch.zeros(4, 16, 16)}, files["states"] / "tuned.pth")

    prompt = "User: what do you do?\n\nAssistant:"
    want = reference(ref, prompt, 20, GREEDY, state=persona)
    got = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=20,
        **{**client_kwargs(GREEDY), "extra_body": {"state": "keeper.safetensors"}},
    )
    assert got.choices[0].text == want.text
    assert got.choices[0].text != reference(ref, prompt, 20, GREEDY).text  # the state mattered

    for name in (
        "../secret.safetensors",
        str(files["dir"] / "secret.safetensors"),
        "missing.safetensors",
        "alien.safetensors",
        "tuned.pth",
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body={"state": name})
        assert e.value.param == "state", name


# --- bad input ------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

BAD = [
    (COMPLETIONS, b'{"model": "tiny-world", "prompt": ', 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, b'{"model": "tiny-world", "prompt": "x", "temperature": NaN}', 400, None),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 4001}, 400, "max_tokens"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": 5}, 400, "stop"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"70000": 1}}, 400, None),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, 70000]}, 400, None),
    (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logprobs": 6.5}, 400, "logprobs"),
    (COMPLETIONS, b'{"model": "tiny-world", "prompt": "lone \\ud800 surrogate"}', 400, "prompt"),
    (COMPLETIONS, b"[" * 50000 + b"]" * 50000, 400, None),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": ["y" * 300]}, 400, "stop[0]"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "state": "a\x00b"}, 400, "state"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokenz": 5}, 400, "max_tokenz"),
    (
        COMPLETIONS,
        {"model": MODEL, "prompt": "x", "stream": False, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (COMPLETIONS, {"model": "gpt-4o", "prompt": "x"}, 404, "model"),
    (CHAT, {**OK_CHAT, "messages": []}, 400, "messages"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),  # no tool_call_id
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    (
        CHAT,
        {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (CHAT, {**OK_CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function"),  # a tool without its function
    (CHAT, {**OK_CHAT, "presence_penalty": "high"}, 400, "presence_penalty"),
]


def test_bad_input_gets_openai_errors_without_disturbing_others(ref, server):
    prompt = "A long walk through the"
    want = reference(ref, prompt, 64, GREEDY).text
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "stream": True, **GREEDY}
    streamed = []

    def good():
        with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])

    runner = threading.Thread(target=good)
    runner.start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, payload, status, param in BAD:
            if isinstance(payload, bytes):
                r = http.post(path, content=payload, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=payload)
            assert r.status_code == status, (payload, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] and "Traceback" not in r.text, r.text
            if param is not None:
                assert err["param"] == param, (payload, err)
        r = http.get("/v1/nowhere")
        assert r.status_code == 404 and r.json()["error"]["message"]
        r = http.get(COMPLETIONS)
        assert r.status_code == 405 and r.json()["error"]["message"]
    runner.join(60)
    assert "".join(streamed) == want
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x")
    assert e.value.code == "model_not_found"


# --- disconnects, limits, load, shutdown ------------------------------------------------------------


def drop_stream(server, body: dict, events: int) -> None:
    """Stream a completion with raw HTTP and close the connection after `events` events."""
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == events:
                break


def test_disconnect_frees_the_slot(server, client):
    long = {"max_tokens": 4000, "logit_bias": {"0": -100}, "temperature": 0}
    cancelled = lambda m: m.get('rwkv_engine_requests_total{outcome="cancelled"}', 0.0)
    base = cancelled(server.metrics())

    # A raw SSE stream dropped after three events.
    drop_stream(server, {"model": MODEL, "prompt": "Go", "stream": True, **long}, events=3)
    m = server.wait_metric("rwkv_engine_requests_running", lambda v: v == 0, timeout=5)
    assert cancelled(m) == base + 1

    # The openai client closing its stream.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Go"}],
        stream=True,
        max_tokens=4000,
        logit_bias={"0": -100},
        temperature=0,
    )
    next(iter(stream)), next(iter(stream))
    stream.close()
    m = server.wait_metric("rwkv_engine_requests_running", lambda v: v == 0, timeout=5)
    assert cancelled(m) == base + 2

    # A non-streaming request whose client gives up.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + COMPLETIONS, json={"model": MODEL, "prompt": "Go", **long}, timeout=0.5)
    m = server.wait_metric("rwkv_engine_requests_running", lambda v: v == 0, timeout=5)
    assert cancelled(m) == base + 3


def test_load_32_concurrent_streams(ref, server):
    """32 streaming clients at once (8 decode slots, the rest queued), two rounds: every answer complete."""
    kinds = [(f"Item {k}: a list of", GREEDY if k % 2 else sampled(200 + k), 8 + k) for k in range(8)]
    wants = [reference(ref, p, n, s).text for p, s, n in kinds]

    async def one(ac, k):
        prompt, sampling, n = kinds[k]
        stream = await ac.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
            **client_kwargs(sampling),
        )
        text, finish, usage = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
            usage = c.usage or usage
        return k, text, finish, usage

    async def rounds():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        async with ac:
            out = []
            for _ in range(2):
                out += await asyncio.gather(*(one(ac, i % 8) for i in range(32)))
            return out

    results = asyncio.run(rounds())
    assert len(results) == 64
    for k, text, finish, usage in results:
        assert text == wants[k], kinds[k][0]
        assert finish in ("stop", "length") and usage is not None
    m = server.metrics()
    assert m["rwkv_engine_requests_running"] == 0 and m["rwkv_engine_requests_waiting"] == 0


def test_limits_auth_body_queue(limited):
    url = limited.url
    auth = {"Authorization": f"Bearer {API_KEY}"}
    # API key: required on /v1, not on /health and /metrics.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200
    c = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
    assert [m.id for m in c.models.list().data] == [LIMITED]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()

    # Body size, prompt length, max_tokens cap.
    r = httpx.post(url + COMPLETIONS, headers=auth, json={"model": LIMITED, "prompt": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["message"]
    r = httpx.post(url + COMPLETIONS, headers=auth, json={"model": LIMITED, "prompt": list(range(1, 100))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url + COMPLETIONS, headers=auth, json={"model": LIMITED, "prompt": "x", "max_tokens": 3001})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"

    # One slot, one queue place: the third concurrent request gets 429 with Retry-After.
    hold = {"model": LIMITED, "prompt": "Go", "stream": True, "max_tokens": 3000, "logit_bias": {"0": -100}}
    with (
        httpx.Client(base_url=url, headers=auth, timeout=30) as h1,
        httpx.Client(base_url=url, headers=auth, timeout=30) as h2,
    ):
        with h1.stream("POST", COMPLETIONS, json=hold) as first:
            lines1 = first.iter_lines()
            next(line for line in lines1 if line.startswith("data: "))
            with h2.stream("POST", COMPLETIONS, json=hold) as second:
                limited.wait_metric("rwkv_engine_requests_waiting", lambda v: v == 1)
                r = httpx.post(url + COMPLETIONS, headers=auth, json={"model": LIMITED, "prompt": "x", "max_tokens": 1})
                assert r.status_code == 429, r.text
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
                first.close()  # frees the slot: the queued request starts
                lines2 = second.iter_lines()
                next(line for line in lines2 if line.startswith("data: {"))
    limited.wait_metric("rwkv_engine_requests_running", lambda v: v == 0, timeout=5)


def test_sigterm_finishes_the_stream_then_exits(limited):
    body = {"model": LIMITED, "prompt": "Go", "stream": True, "max_tokens": 60, "logit_bias": {"0": -100}}
    lines = []
    with httpx.stream(
        "POST", limited.url + COMPLETIONS, json=body, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and not lines:
                limited.proc.send_signal(signal.SIGTERM)
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert limited.proc.wait(20) == 0
    assert "stopped" in limited.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(limited.url + "/health", timeout=2)
