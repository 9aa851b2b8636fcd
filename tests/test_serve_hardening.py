"""`rwkv-engine serve` under misuse: what issue 14 reported (D1-D8 and the smaller items) and
the hardening for exposure (timeouts, connection cap, Host and Origin checks, the API key).

Like tests/test_serve.py (whose `Server` helper and checkpoint fixture this reuses), every
test drives a real server subprocess, here mostly with raw sockets and httpx: what a
well-behaved client never sends. The servers run with short timeouts so the tests stay short.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import pytest
import torch

from tests.test_serve import COMPLETIONS, CHAT, GREEDY, MODEL, Server, files, parse_prometheus  # noqa: F401

httpx = pytest.importorskip("httpx")

HEADER_TIMEOUT = 2
BODY_TIMEOUT = 2
MAX_CONNECTIONS = 24
KEY = "file-key-123"
LONG = {"max_tokens": 2000, "logit_bias": {"0": -100}}


@pytest.fixture(scope="module")
def open_server(files):
    """Loopback, no key, small limits (one batch of 8, 2 waiting)."""
    s = Server(files["model"], files["dir"] / "hardening.log", "--max-batch", "8", "--max-queue", "2",
               "--state-dir", str(files["states"]), "--shutdown-timeout", "2",
               "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
               "--max-connections", str(MAX_CONNECTIONS))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed_server(files):
    """The key from a file; a browser origin allowed; one more host name allowed."""
    key_file = files["dir"] / "key.txt"
    key_file.write_text(KEY + "\n")
    s = Server(files["model"], files["dir"] / "keyed.log", "--api-key-file", str(key_file),
               "--cors-origin", "http://app.example", "--allowed-host", "rwkv.lan")
    yield s
    s.stop()


def raw(server, data: bytes, wait: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection; everything the server sends until it closes (or `wait`)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def stream_lines(url: str, body: dict, headers=None) -> list[str]:
    with httpx.stream("POST", url + COMPLETIONS, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def errors_500(server) -> float:
    return server.metrics().get('rwkv_engine_http_errors_total{status="500"}', 0.0)


# --- D1: tiny temperatures, one row's failure ----------------------------------------------------


def test_tiny_temperature_streams_next_to_normal_ones(open_server):
    """D1: 6 normal streams and one at temperature 1.5e-38 all finish (they all died with the model step)."""
    url = open_server.url

    async def one(ac, body):
        lines = []
        async with ac.stream("POST", COMPLETIONS, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
        return lines

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
            bodies = [{"model": MODEL, "prompt": f"The story {i}:", "max_tokens": 40, "stream": True, "seed": i,
                       "temperature": 1.5e-38 if i == 6 else 1.0, "top_p": 1} for i in range(7)]
            return await asyncio.gather(*(one(ac, b) for b in bodies))

    for lines in asyncio.run(run()):
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length"), lines[-2]

    # Alone, any tiny temperature is the greedy answer (its T -> 0 limit), with the same penalties.
    base = {"model": MODEL, "prompt": "The story 0:", "max_tokens": 12, "top_p": 1, "seed": 0}
    greedy = httpx.post(url + COMPLETIONS, json={**base, "temperature": 0}, timeout=60).json()["choices"][0]["text"]
    for t in (1e-300, 1e-40, 1e-38):
        r = httpx.post(url + COMPLETIONS, json={**base, "temperature": t}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, (t, r.text)


@pytest.fixture(scope="module")
def model_and_tokenizer(files):
    import rwkv_engine

    model = rwkv_engine.load(files["model"])
    return model, rwkv_engine.load_tokenizer(model)


def test_one_rows_sampling_failure_fails_that_request_only(model_and_tokenizer, monkeypatch):
    """D1, second half: a row whose sampling raises ends with an error; the rows sampled with it do not."""
    import rwkv_engine
    from rwkv_engine import SamplingParams
    from rwkv_engine.sampling import Sampler
    from rwkv_engine.serve import engine as engine_module
    from rwkv_engine.serve.engine import Engine, EngineConfig, Finished, Request

    class Flaky(Sampler):
        """Seed 666 raises from its third token on (in batched decode steps, not at the first token)."""

        def _adjust_(self, out):
            self.calls = getattr(self, "calls", 0) + 1
            if self.params.seed == 666 and self.calls >= 3:
                raise RuntimeError("boom")
            return super()._adjust_(out)

    monkeypatch.setattr(engine_module, "Sampler", Flaky)
    model, tok = model_and_tokenizer
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=12, stop_token_ids=()) for s in (1, 666, 2)]
    engine = Engine(model, tok, EngineConfig(max_batch=4))
    engine.start()
    try:
        finished, texts = {}, {i: "" for i in range(3)}
        got_all = __import__("threading").Event()

        def sink_for(i):
            def sink(e):
                if isinstance(e, Finished):
                    finished[i] = e
                    if len(finished) == 3:
                        got_all.set()
                else:
                    texts[i] += e.text
            return sink

        for i, p in enumerate(params):
            engine.submit(Request(tok.encode(f"Row {i} says"), p), sink_for(i))
        assert got_all.wait(60)
    finally:
        engine.stop()
    assert finished[1].reason == "error"
    for i in (0, 2):
        assert finished[i].reason == "length", finished[i]
        want = rwkv_engine.generate(model, tok, f"Row {i} says", params[i])
        assert texts[i] == want.read()


def test_only_requests_waiting_count_against_the_queue(model_and_tokenizer):
    """D3: --max-batch 8 --max-queue 2 and 20 requests at once: 10 are taken (8 run, 2 wait), not 3 or 4."""
    from rwkv_engine import SamplingParams
    from rwkv_engine.serve.engine import Engine, EngineConfig, QueueFull, Request

    model, tok = model_and_tokenizer
    engine = Engine(model, tok, EngineConfig(max_batch=8, max_queue=2))
    engine.start()
    try:
        accepted, refused = [], 0
        for i in range(20):
            try:
                accepted.append(engine.submit(Request(tok.encode(f"Go {i}"), SamplingParams(
                    temperature=0, max_tokens=100000, stop_token_ids=())), lambda e: None))
            except QueueFull as e:
                refused += 1
                assert "2 requests are already waiting" in str(e)
        assert len(accepted) == 10 and refused == 10
        for h in accepted:
            h.cancel()
    finally:
        engine.stop()
