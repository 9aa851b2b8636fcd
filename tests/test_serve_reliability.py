"""`rwkv-engine serve` as issue 28 probed it: framing and slow clients, requests that can never
fit, states that break the model step, a request without "model".

Like tests/test_serve_hardening.py, every test drives a real server subprocess (tests/test_serve.py's
`Server` helper and checkpoint), mostly with raw sockets: the bugs live in the HTTP layer.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from tests.test_serve import COMPLETIONS, MODEL, Server, files  # noqa: F401 (files: the fixture)

from .conftest import read_body

httpx = pytest.importorskip("httpx")

WRITE_TIMEOUT = 2


@pytest.fixture(scope="module")
def rel_server(files):
    s = Server(
        files["model"],
        files["dir"] / "reliability.log",
        "--max-batch",
        "8",
        "--max-queue",
        "64",
        "--state-dir",
        str(files["states"]),
        "--write-timeout",
        str(WRITE_TIMEOUT),
        "--shutdown-timeout",
        "2",
    )
    yield s
    s.stop()


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


# --- the HTTP layer alone: uvicorn with serve/connections.py's protocol, on a loopback socket -------


@contextlib.contextmanager
def live(app, parser: str, write_timeout: float = 1.0):
    """A uvicorn server for `app` in a thread, with the server's guarded protocol over the
    `parser` uvicorn protocol ("httptools" or "h11": an install without httptools gets h11)."""
    import uvicorn

    from rwkv_engine.serve.connections import guarded_protocol
    from rwkv_engine.serve.launch import bind

    if parser == "httptools":
        pytest.importorskip("httptools")
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    sock = bind("127.0.0.1", 0)
    config = uvicorn.Config(app, lifespan="off", log_level="warning")
    config.load()
    config.http_protocol_class = guarded_protocol(base, 64, 10.0, write_timeout)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


BIG = 8 << 20  # bytes: more than the socket buffers of both ends hold (about 3 MB on loopback)


async def echo_app(scope, receive, send):
    """GET /big: BIG bytes; anything else: its body back."""
    body = await read_body(receive)
    if scope["path"] == "/big":
        body = b"x" * BIG
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_both_content_length_and_transfer_encoding_close_the_connection(parser):
    """Smaller item (RFC 9112 6.3): a request with both headers kept the connection open (h11
    takes the chunked body), so a request behind it, one a proxy reading Content-Length would
    not see, was answered too. Now the connection is closed after the first answer (httptools
    refuses such a request outright)."""
    chunk = b'{"text": "hi"}'
    request = (
        b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(chunk):x}\r\n".encode()
        + chunk
        + b"\r\n0\r\n\r\n"
    )
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with live(echo_app, parser) as where:
        t0 = time.monotonic()
        with socket.create_connection(where, timeout=10) as s:
            s.sendall(request + smuggled)
            out = read_all(s)
        assert out.count(b"HTTP/1.1 ") == 1, out
        assert time.monotonic() - t0 < 4  # closed after the answer, not by the keep-alive timeout
        # Chunked alone: the connection is kept, and the next request on it answered.
        plain = request.replace(b"Content-Length: 4\r\n", b"")
        with socket.create_connection(where, timeout=3) as s:
            s.sendall(plain + smuggled.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
            out = read_all(s)
        assert out.count(b"HTTP/1.1 200") == 2 and chunk in out, out


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_client_that_stops_reading_is_cut_off(parser):
    """R7: a client asks for a big answer (it was a 2.8 MB echo with logprobs) and never reads:
    the answer stayed queued in the server (memory 511 -> 617 MB) and the connection open for
    good. Now the server cuts it off once nothing has gone out for --write-timeout seconds."""
    with live(echo_app, parser) as where:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: it sets the window)
        s.settimeout(10)
        with s:
            s.connect(where)
            s.sendall(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            got = s.recv(4096)
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
            time.sleep(2.5)  # the write timeout is 1 s
            got += read_all(s)
        assert len(got) < BIG  # cut off, not delivered whole to a client that woke up late

        # A slow but steady reader gets all of it.
        with socket.create_connection(where, timeout=10) as s:
            s.sendall(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            time.sleep(0.5)
            assert len(read_all(s)) > BIG


def test_the_server_takes_its_write_timeout_flag(rel_server):
    """--write-timeout reaches the server (the fixture passes it), which serves as usual."""
    assert httpx.get(rel_server.url + "/health", timeout=10).status_code == 200


# --- through the model server --------------------------------------------------------------------


def test_more_prompts_than_can_ever_fit_are_a_400(rel_server):
    """R2: `"prompt": [[1,2]]*80` on an idle server with --max-queue 64 was a 429 "64 requests are
    already waiting" (its own prompts), which clients retry forever: a 400 naming the limit."""
    body = {"model": MODEL, "prompt": [[1, 2]] * 80, "max_tokens": 1}
    r = httpx.post(rel_server.url + COMPLETIONS, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "80 prompts" in r.json()["error"]["message"] and "at most 72" in r.json()["error"]["message"]
    m = rel_server.metrics()
    assert m.get("rwkv_engine_requests_waiting", 0) == 0 and m.get("rwkv_engine_requests_running", 0) == 0
    r = httpx.post(rel_server.url + COMPLETIONS, json={**body, "prompt": [[1, 2]] * 72}, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 72


def _write_state(path, tensors: dict, signature: str) -> None:
    from safetensors.torch import save_file

    meta = {"format": "rwkv-engine-state/1", "signature": signature, "fields": ",".join(tensors)}
    save_file(tensors, str(path), metadata=meta)


def test_crafted_states_get_a_400_or_one_clean_error(rel_server, files):
    """R6: a --state-dir file holding a 0-dim tensor was a 500 with its traceback logged twice; a
    state of finite 3e38 values a 500 "model step failed" with a traceback (NaN logits). Now both
    are a 400 before any work (issue 34, R1: the state file is the client's choice, refused when
    the model's output from it is not finite); no traceback in the log."""
    import rwkv_engine

    model = rwkv_engine.load(files["model"])
    good = model.new_state(1)
    sig = model.config.state_signature()
    tensors = {k: t.contiguous() for k, t in good.items()}
    flat = dict(tensors, **{next(iter(tensors)): torch.tensor(1.0)})
    _write_state(files["states"] / "flat.safetensors", flat, sig)
    _write_state(files["states"] / "huge.safetensors", {k: torch.full_like(t, 3e38) for k, t in tensors.items()}, sig)
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
    r = httpx.post(rel_server.url + COMPLETIONS, json={**base, "state": "flat.safetensors"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "state", r.text
    r = httpx.post(rel_server.url + COMPLETIONS, json={**base, "state": "huge.safetensors"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "state", r.text
    assert "NaN or infinite" in r.json()["error"]["message"], r.text
    assert "Traceback" not in rel_server.log()
    assert httpx.post(rel_server.url + COMPLETIONS, json=base, timeout=60).status_code == 200


def test_an_unexpected_route_error_is_logged_once(files, capfd):
    """Smaller item: an unexpected error in a route was logged twice (the app's handler printed
    it, then Starlette re-raised it to uvicorn, which logged it again). Now once, with a 500."""
    import rwkv_engine
    from rwkv_engine.serve.app import create_app
    from rwkv_engine.serve.engine import Engine
    from rwkv_engine.settings import Config, ModelSpec

    model = rwkv_engine.load(files["model"])
    app = create_app(Engine(model, rwkv_engine.load_tokenizer(model)), Config(ModelSpec(MODEL)))

    async def boom():
        raise ZeroDivisionError("a bug")

    app.add_api_route("/boom", boom)
    capfd.readouterr()
    with live(app, "httptools") as where:
        r = httpx.get(f"http://{where[0]}:{where[1]}/boom", timeout=30)
        assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]
        time.sleep(0.2)
    err = capfd.readouterr().err
    assert err.count("ZeroDivisionError: a bug") == 1, err


def test_a_request_without_model_is_for_the_served_model(rel_server):
    """N7: a request without "model" was refused; llama.cpp's server takes it as the served model."""
    for path, body in (
        (COMPLETIONS, {"prompt": "Hello", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ):
        r = httpx.post(rel_server.url + path, json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    r = httpx.post(rel_server.url + COMPLETIONS, json={"model": "other", "prompt": "x"}, timeout=60)
    assert r.status_code == 404
