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

from tests.test_serve import CHAT, COMPLETIONS, MODEL, Server, files  # noqa: F401 (files: the fixture)

httpx = pytest.importorskip("httpx")

HEADER_TIMEOUT = 2
BODY_TIMEOUT = 2
MAX_CONNECTIONS = 24
KEY = "file-key-123"
LONG = {"max_tokens": 2000, "logit_bias": {"0": -100}}


@pytest.fixture(scope="module")
def open_server(files):
    """Loopback, no key, small limits (one batch of 8, 2 waiting)."""
    s = Server(
        files["model"],
        files["dir"] / "hardening.log",
        "--max-batch",
        "8",
        "--max-queue",
        "2",
        "--state-dir",
        str(files["states"]),
        "--shutdown-timeout",
        "2",
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--max-connections",
        str(MAX_CONNECTIONS),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed_server(files):
    """The key from a file; a browser origin allowed; one more host name allowed."""
    key_file = files["dir"] / "key.txt"
    key_file.write_text(KEY + "\n")
    s = Server(
        files["model"],
        files["dir"] / "keyed.log",
        "--api-key-file",
        str(key_file),
        "--cors-origin",
        "http://app.example",
        "--allowed-host",
        "rwkv.lan",
    )
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
        except (TimeoutError, ConnectionResetError):
            pass
        return out


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
            bodies = [
                {
                    "model": MODEL,
                    "prompt": f"The story {i}:",
                    "max_tokens": 40,
                    "stream": True,
                    "seed": i,
                    "temperature": 1.5e-38 if i == 6 else 1.0,
                    "top_p": 1,
                }
                for i in range(7)
            ]
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

        def _ready(self, device):  # called for every sampler of a batch, every step
            self.calls = getattr(self, "calls", 0) + 1
            if self.params.seed == 666 and self.calls >= 3:
                raise RuntimeError("boom")
            return super()._ready(device)

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
                accepted.append(
                    engine.submit(
                        Request(
                            tok.encode(f"Go {i}"), SamplingParams(temperature=0, max_tokens=100000, stop_token_ids=())
                        ),
                        lambda e: None,
                    )
                )
            except QueueFull as e:
                refused += 1
                assert "2 requests are already waiting" in str(e)
        assert len(accepted) == 10 and refused == 10
        for h in accepted:
            h.cancel()
    finally:
        engine.stop()


def test_health_says_starting_until_the_warm_up_is_done(model_and_tokenizer):
    """D8: the kernels are built by a warm-up forward before /health says ok (503 "starting" until then)."""
    import threading

    from fastapi.testclient import TestClient

    from rwkv_engine.serve.app import create_app
    from rwkv_engine.serve.engine import Engine
    from rwkv_engine.settings import Config, ModelSpec, ServerSettings

    model, tok = model_and_tokenizer
    release, calls = threading.Event(), []

    class SlowFirstForward:
        """The model, with a first forward that waits (a kernel build, say)."""

        def __getattr__(self, name):
            return getattr(model, name)

        def forward(self, *args, **kw):
            calls.append(1)
            if len(calls) == 1:
                assert release.wait(30)
            return model.forward(*args, **kw)

    engine = Engine(SlowFirstForward(), tok)
    with TestClient(create_app(engine, Config(ModelSpec(MODEL), server=ServerSettings(allowed_hosts=("*",))))) as http:
        r = http.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "starting"}
        release.set()
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http.get("/health").json() == {"status": "ok"}
        # the warm-up's prefill and decode step, and where a prefill thread runs beside the decode
        # steps its check (a piece on each thread count), before any request
        assert len(calls) == (4 if engine._worker is not None else 2)


def test_twenty_at_once_with_eight_slots_and_two_queue_places(open_server):
    """D3 as reported: --max-batch 8 --max-queue 2 and 20 requests at once: 10 are answered, 10 get 429."""

    async def one(ac, i, statuses, answered):
        body = {"model": MODEL, "prompt": f"Go {i}", "stream": True, "temperature": 0, **LONG}
        async with ac.stream("POST", COMPLETIONS, json=body) as r:
            statuses.append(r.status_code)
            if len(statuses) == 20:
                answered.set()
            if r.status_code == 200:
                # No stream closes (which cancels it and frees its slot) before every request
                # has its answer: else a fast engine let an eleventh request in.
                await asyncio.wait_for(answered.wait(), 60)
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # it runs (or waits for a slot, then runs): enough; closing cancels it

    async def run():
        statuses, answered = [], asyncio.Event()
        async with httpx.AsyncClient(
            base_url=open_server.url, timeout=60, limits=httpx.Limits(max_connections=40)
        ) as ac:
            await asyncio.gather(*(one(ac, i, statuses, answered) for i in range(20)))
        return statuses

    statuses = asyncio.run(run())
    assert sorted(statuses) == [200] * 10 + [429] * 10
    open_server.wait_metric("rwkv_engine_requests_running", lambda v: v == 0, timeout=30)


# --- D2: TCP_NODELAY -----------------------------------------------------------------------------


def test_accepted_connections_have_tcp_nodelay():
    """D2: the listening socket was made with protocol 0, so asyncio never set TCP_NODELAY on the
    connections and a small response waited for the client's delayed ACK (about 40 ms)."""
    from rwkv_engine.serve.launch import bind

    async def run():
        sock = bind("127.0.0.1", 0)
        accepted = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                accepted.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(run()) != 0  # (plain asyncio; uvloop sets it whatever the protocol)


# --- D4, D5 and the smaller items ----------------------------------------------------------------


def test_bad_requests_get_a_4xx_naming_the_field(open_server, files, model_and_tokenizer):
    url = open_server.url
    model, _ = model_and_tokenizer
    fresh = model.new_state(1)
    bad_shape = {k: (v[:, :1] if k == "att_x_prev" else v) for k, v in fresh.items()}
    type(fresh)(bad_shape, fresh.signature).save(files["states"] / "bad-shape.safetensors")
    nan = {k: torch.full_like(v, float("nan")) for k, v in fresh.items()}
    type(fresh)(nan, fresh.signature).save(files["states"] / "nan.safetensors")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (COMPLETIONS, {"model": MODEL, "prompt": "x", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),  # D4
        (CHAT, {**chat, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
        (COMPLETIONS, {"model": MODEL, "prompt": "x", "state": "bad-shape.safetensors"}, 400, "state"),
        (COMPLETIONS, {"model": MODEL, "prompt": "x", "state": "nan.safetensors"}, 400, "state"),
        (COMPLETIONS, {"model": "m" * 1_000_000, "prompt": "x"}, 404, "model"),
    ]
    with httpx.Client(base_url=url, timeout=60) as http:
        for path, body, status, param in cases:
            r = http.post(path, json=body)
            assert r.status_code == status and r.json()["error"]["param"] == param, (param, r.text[:300])
            assert len(r.text) < 1000
        # A trailing slash: the same endpoint, not a bodyless redirect.
        r = http.post(CHAT + "/", json={**chat, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
    assert errors_500(open_server) == 0


def test_client_gone_mid_body_is_a_cancel(open_server):
    """D5: headers and part of the body, then the client closes: no 500, no traceback."""
    host, port = open_server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b'Content-Length: 500\r\n\r\n{"model": "tiny-world", "pro'
            )
            time.sleep(0.2)
    time.sleep(0.5)
    assert httpx.get(open_server.url + "/health").status_code == 200
    assert errors_500(open_server) == 0
    assert "Traceback" not in open_server.log()


# --- D6 and hardening: timeouts, connection cap, Host, Origin, key --------------------------------


def test_stalled_headers_and_bodies_are_timed_out(open_server):
    from concurrent.futures import ThreadPoolExecutor

    stalls = [
        b"GET /health HTTP/1.1\r\nHost: localhost\r\n",  # half the headers, then nothing
        b"",  # a connection that never sends a byte
        b'POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{"mo',  # half a body
    ]
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(stalls)) as pool:
        half_headers, nothing, half_body = pool.map(lambda data: raw(open_server, data, wait=30), stalls)
    # Stalled headers: closed after --header-timeout, without an answer; a stalled body: 408, then closed.
    assert half_headers == b"" and nothing == b""
    assert half_body.startswith(b"HTTP/1.1 408") and b"connection: close" in half_body.lower(), half_body
    assert json.loads(half_body.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < max(HEADER_TIMEOUT, BODY_TIMEOUT) + 20
    assert errors_500(open_server) == 0


def test_connection_cap(open_server):
    host, port = open_server.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        # One more: refused at once with a 503 (no file descriptors or memory held for it).
        t0 = time.monotonic()
        out = raw(open_server, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 503") and time.monotonic() - t0 < HEADER_TIMEOUT, out
        # The stalled ones are closed by the header timeout; then the server answers again.
        for s in idle:
            s.settimeout(HEADER_TIMEOUT + 10)
            assert s.recv(100) == b""
        assert httpx.get(open_server.url + "/health", timeout=10).status_code == 200
    finally:
        for s in idle:
            s.close()


def test_host_and_origin_checks_on_a_loopback_server(open_server):
    url = open_server.url
    port = url.rsplit(":", 1)[1]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    with httpx.Client(base_url=url, timeout=30) as http:
        for host in ("localhost", f"localhost:{port}", "127.0.0.1", "127.1.2.3:99", "[::1]", f"[::1]:{port}"):
            assert http.get("/health", headers={"Host": host}).status_code == 200, host
        # DNS rebinding: a page of evil.example whose name now points at 127.0.0.1.
        for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io"):
            r = http.post(COMPLETIONS, json=body, headers={"Host": host})
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
        # Another site's page posting here (no CORS origin is allowed by default): refused, and a
        # preflight gets no Access-Control-Allow-Origin. The same origin (a page this server serves) is fine.
        r = http.post(COMPLETIONS, json=body, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        r = http.options(
            COMPLETIONS, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
        )
        assert "access-control-allow-origin" not in r.headers
        r = http.post(COMPLETIONS, json=body, headers={"Origin": f"http://127.0.0.1:{port}"})
        assert r.status_code == 200, r.text


def test_key_file_early_key_check_cors_and_allowed_host(keyed_server):
    url = keyed_server.url
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert httpx.post(url + COMPLETIONS, json=body, headers=auth, timeout=30).status_code == 200
    assert httpx.post(url + COMPLETIONS, json=body, timeout=30).status_code == 401
    # A wrong key is refused as soon as the headers are in: the body is never waited for.
    t0 = time.monotonic()
    out = raw(
        keyed_server,
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer nope\r\n"
        b"Content-Length: 100000\r\n\r\n{",
    )
    assert out.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 5, out
    # --allowed-host adds a name; others are still refused.
    assert httpx.get(url + "/health", headers={"Host": "rwkv.lan:8000"}).status_code == 200
    assert httpx.get(url + "/health", headers={"Host": "evil.example"}).status_code == 403
    # --cors-origin: the preflight and the answer carry the origin; the key is still needed.
    origin = {"Origin": "http://app.example"}
    r = httpx.options(
        url + COMPLETIONS,
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.post(url + COMPLETIONS, json=body, headers={**origin, **auth}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.post(url + COMPLETIONS, json=body, headers={"Origin": "http://other.example", **auth}, timeout=30)
    assert r.status_code == 403


def test_api_key_sources_and_exposure_warning(tmp_path):
    import argparse

    from rwkv_engine.cli import serve
    from rwkv_engine.errors import InputError
    from rwkv_engine.serve.security import api_key, exposure_warning

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    parse = lambda *a: parser.parse_args(["model.pth", *a])  # noqa: E731
    key = lambda args, environ: serve.config(args, environ).server.api_key  # noqa: E731
    assert key(parse(), {}) is None
    assert key(parse(), {"RWKV_ENGINE_API_KEY": "from-env"}) == "from-env"
    assert key(parse("--api-key-file", str(key_file)), {"RWKV_ENGINE_API_KEY": "from-env"}) == "from-file"
    assert key(parse("--api-key", "k"), {}) == "k"
    assert api_key(None, key_file, {}) == "from-file"
    for bad in (
        ("--api-key", "k", "--api-key-file", str(key_file)),
        ("--api-key-file", str(tmp_path / "none")),
        ("--api-key", ""),
    ):
        with pytest.raises(InputError):
            key(parse(*bad), {})
    assert exposure_warning("0.0.0.0", None) and "WARNING" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("::", None)
    assert exposure_warning("0.0.0.0", "k") is None
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None


# --- D7: SIGTERM (last: it stops the server) -------------------------------------------------------


def test_sigterm_cuts_long_streams_with_an_error_event_and_done(open_server):
    lines = {i: [] for i in range(3)}
    started = {i: __import__("threading").Event() for i in range(3)}

    def read(i):
        body = {"model": MODEL, "prompt": f"Go {i}", "stream": True, "temperature": 0, **LONG}
        with httpx.stream("POST", open_server.url + COMPLETIONS, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines[i].append(line)
                    started[i].set()

    import threading

    readers = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in readers:
        t.start()
    for e in started.values():
        assert e.wait(60)
    open_server.proc.send_signal(signal.SIGTERM)
    for t in readers:
        t.join(60)
    assert open_server.proc.wait(30) == 0
    for i in range(3):
        assert lines[i][-1] == "data: [DONE]", lines[i][-3:]
        err = json.loads(lines[i][-2][6:])["error"]
        assert err["code"] == "engine_error" and "shutting down" in err["message"]
    log = open_server.log()  # ("Cancel": uvicorn's backstop cancelled tasks, 10 s after the engine's cut)
    assert "Traceback" not in log and "Cancel" not in log, log
