"""Shared fixtures: small random-weight checkpoints written on the fly, and comparison helpers."""

from __future__ import annotations

import os

# Before anything imports them: no hub traffic from tests, and the reference package's plain
# Python path (its TorchScript compile only costs time here).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RWKV_JIT_ON", "0")
os.environ.setdefault("RWKV_CUDA_ON", "0")

import pytest

from rwkv_engine import testing

SIZES = dict(n_layer=3, n_embd=64, vocab_size=300, head_size=16)


rel_rms = testing.rel_rms


def states_equal(a, b, tol=1e-5):
    """Equal up to float rounding (e.g. token-by-token vs chunked prefill): relative RMS per field."""
    assert sorted(a.fields) == sorted(b.fields) and a.signature == b.signature
    for name, t in a.items():
        err = rel_rms(t, getattr(b, name))
        assert err < tol, f"{name}: relative RMS difference {err:.2e}"


def run_engine(model, tok, requests, config):
    """Every `serve.engine.Request` through one Engine at once; ([(text, Finished)] per request,
    the engine, stopped)."""
    import threading

    from rwkv_engine.serve.engine import Delta, Engine

    engine = Engine(model, tok, config)
    engine.start()
    results = [None] * len(requests)
    done = threading.Semaphore(0)
    try:
        for i, request in enumerate(requests):
            parts = []

            def sink(event, i=i, parts=parts):
                if isinstance(event, Delta):
                    parts.append(event.text)
                else:
                    results[i] = ("".join(parts), event)
                    done.release()

            engine.submit(request, sink)
        for _ in requests:
            assert done.acquire(timeout=300)
    finally:
        engine.stop()
    return results, engine


async def read_body(receive) -> bytes:
    """An ASGI request's whole body (test servers)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="session")
def make_pth(ckpt_dir):
    """make_pth(version, **sizes) -> path of a fp32 .pth (cached per arguments)."""
    cache = {}

    def make(version: str = "5.2", **kw):
        key = (version, tuple(sorted(kw.items())))
        if key not in cache:
            sd = testing.random_state_dict(version, **{**SIZES, **kw})
            cache[key] = testing.save_pth(sd, ckpt_dir / f"m{len(cache)}-{version}.pth")
        return cache[key]

    return make


def pytest_terminal_summary(terminalreporter):
    """Which native ISA levels were compiled and run, and which were skipped and why."""
    import sys

    isa = sys.modules.get(f"{__package__}.test_native_isa")
    if isa is None or not isa.REPORT:
        return
    terminalreporter.section("native kernels by ISA level")
    for name, notes in isa.REPORT.items():
        terminalreporter.write_line(f"{name}: {'; '.join(dict.fromkeys(notes))}")
