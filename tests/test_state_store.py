"""--state-store: the prompt cache's states on disk (rwkv_engine/serve/state_store.py).

`StateStore` on states of a tiny model: a state read back is the state written, bit for bit, also
by another store object on the same directory (a restart); truncated, corrupt, foreign (another
model's weights, dtype) and other-prompt files are skipped with one warning and never served; the
size cap deletes the least recently used files. Then a live `rwkv-engine serve` stopped and
started again on the same directory resumes a long prompt from the store: the prompt-cache and
store hit counters of /metrics say so, and the answer is the one the cold server gave.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import rwkv_engine
from rwkv_engine.kernels.native import GEMV_MAX_ROWS
from rwkv_engine.serve.state_store import StateStore, model_key
from rwkv_engine.state import State
from rwkv_engine.testing import random_state_dict, save_pth

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    make = lambda seed, name: save_pth(  # noqa: E731
        random_state_dict(version="5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=seed), d / name
    )
    return {"dir": d, "model": make(3, "m.pth"), "other": make(4, "other.pth")}


@pytest.fixture(scope="module")
def model(paths):
    return rwkv_engine.load(paths["model"])


def new_store(root, model, capacity=1 << 30) -> StateStore:
    return StateStore(root, capacity, model_key(model), check=lambda s: s.check_usable(model))


def after(model, ids):
    return model.forward(ids)[1]


def same(a, b) -> bool:
    return a.signature == b.signature and all(torch.equal(t, getattr(b, k)) for k, t in a.items())


def test_round_trip_and_a_restart_read_the_same_bits(model, tmp_path):
    ids = list(range(10, 60))
    state = after(model, ids)
    store = new_store(tmp_path, model)
    store.put("", ids, state)
    store.flush()
    assert same(store.get("", ids), state)
    assert store.get("", ids[:-1]) is None and store.get("file:x", ids) is None  # another prefix, start
    store.close()
    again = new_store(tmp_path, model)  # a restarted server
    assert same(again.get("", ids), state) and again.counts["hits"] == 1
    assert len(list(tmp_path.glob("*.state.safetensors"))) == 1
    again.close()


def test_model_key_tells_weights_and_dtype_apart(paths, model):
    assert model_key(model) == model_key(rwkv_engine.load(paths["model"]))  # the same model loaded again
    assert model_key(model) != model_key(rwkv_engine.load(paths["other"]))  # same shape, other weights
    assert model_key(model) != model_key(rwkv_engine.load(paths["model"], dtype="bf16"))


def test_bad_files_are_skipped_with_one_warning_never_served(paths, model, tmp_path, capfd):
    store = new_store(tmp_path, model)
    a, b = list(range(1, 40)), list(range(2, 40))
    for ids in (a, b):
        store.put("", ids, after(model, ids))
    store.flush()

    # Truncated (a crash mid-copy, a full disk).
    data = store.path("", a).read_bytes()
    store.path("", a).write_bytes(data[: len(data) // 2])
    assert store.get("", a) is None and store.get("", a) is None
    # Corrupt: one byte of the tensor data flipped.
    data = bytearray(store.path("", b).read_bytes())
    data[-5] ^= 0x40
    store.path("", b).write_bytes(bytes(data))
    assert store.get("", b) is None
    # Another prompt's file under this prompt's name.
    c, d = list(range(3, 40)), list(range(4, 40))
    store.put("", c, after(model, c))
    store.flush()
    shutil.copy(store.path("", c), store.path("", d))
    assert store.get("", d) is None and same(store.get("", c), after(model, c))
    # Another model's state (same shape, other weights), and a file that is no safetensors at all.
    other = rwkv_engine.load(paths["other"])
    theirs = new_store(tmp_path / "theirs", other)
    theirs.put("", c, after(other, c))
    theirs.close()
    os.replace(theirs.path("", c), store.path("", c))
    assert store.get("", c) is None
    e = list(range(5, 40))
    store.path("", e).write_text("hello")
    assert store.get("", e) is None

    err = capfd.readouterr().err
    assert err.count("warning: state store: skipped") == 5, err  # once per file
    for why in ("not a readable safetensors file", "do not match their checksum", "another prompt", "another model"):
        assert why in err, err
    assert store.counts["skipped"] == 6 and store.counts["hits"] == 1
    store.close()


def test_the_servers_store_reads_a_state_without_a_forward(model, tmp_path, monkeypatch):
    """The engine's store checks a file's layout and values, not the model's output from it (a
    17-token forward with all logits, most of a restored first token's extra time: issue 38's
    1.2x); a NaN in a file with a valid checksum is still never served."""
    from rwkv_engine.serve.engine import Engine
    from rwkv_engine.settings import EngineConfig

    engine = Engine(model, rwkv_engine.WorldTokenizer(), EngineConfig(state_store=str(tmp_path)))
    store = engine.cache.store
    ids = list(range(1, 40))
    state = after(model, ids)
    bad = State({k: t.clone() for k, t in state.items()}, state.signature)
    next(t for _, t in bad.items() if t.is_floating_point()).view(-1)[0] = float("nan")
    store.put("", ids, state)
    store.put("", ids[:-1], bad)
    store.flush()

    def no_forward(*args, **kw):
        raise AssertionError("the store ran the model")

    monkeypatch.setattr(model, "forward", no_forward)
    assert same(store.get("", ids), state)
    assert store.get("", ids[:-1]) is None and store.counts["skipped"] == 1
    store.close()


def test_capacity_evicts_the_least_recently_used(model, tmp_path):
    prompts = [list(range(k, k + 30)) for k in (1, 2, 3)]
    store = new_store(tmp_path, model)
    store.put("", prompts[0], after(model, prompts[0]))
    store.flush()
    size = store.path("", prompts[0]).stat().st_size
    store.close()

    store = new_store(tmp_path, model, capacity=int(2.5 * size))
    store.put("", prompts[1], after(model, prompts[1]))
    store.flush()
    past = time.time() - 100
    os.utime(store.path("", prompts[0]), (past, past))
    os.utime(store.path("", prompts[1]), (past + 1, past + 1))
    assert store.get("", prompts[0]) is not None  # used now: the newest
    store.put("", prompts[2], after(model, prompts[2]))
    store.flush()
    assert [store.path("", p).exists() for p in prompts] == [True, False, True]
    assert store.counts["evicted"] == 1 and store.gauges()["state_store_bytes"] == 2 * size
    store.close()


def test_the_flag_reaches_the_engine_config_of_serve_ray_and_batch(paths, tmp_path):
    from rwkv_engine.cli import serve
    from rwkv_engine.errors import InputError

    new = tmp_path / "new" / "states"
    config, _ = serve.parse([str(paths["model"]), "--state-store", str(new), "--state-store-mb", "5", "--ray"])
    assert config.engine.state_store == str(new.resolve()) and new.is_dir()  # created; absolute for replicas
    assert config.engine.state_store_bytes == 5 << 20
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        serve.parse([str(paths["model"]), "--state-store", str(tmp_path / "file")])


def test_a_restarted_server_resumes_from_the_store(paths, tmp_path):
    from .test_serve import Server

    chunk = 32
    store = tmp_path / "states"
    flags = ("--prefill-chunk", str(chunk), "--state-store", str(store), "--state-cache-mb", "64")
    ids = [(i * 7919) % 60000 + 1 for i in range(150)]
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "stream": False}
    resumed_at = (len(ids) - GEMV_MAX_ROWS - 1) // chunk * chunk

    server = Server(paths["model"], tmp_path / "cold.log", *flags)
    try:
        cold = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    finally:
        server.stop()  # SIGTERM: the states queued for the disk are written before it exits
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(list(store.glob("*.state.safetensors"))) == resumed_at // chunk

    server = Server(paths["model"], tmp_path / "warm.log", *flags)
    try:
        warm = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        m = server.metrics()
    finally:
        server.stop()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == resumed_at
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert m["rwkv_engine_prompt_cache_hits_total"] == 1 and m["rwkv_engine_state_store_hits_total"] == 1
    assert m["rwkv_engine_prefill_tokens_total"] == len(ids) - resumed_at
    assert m["rwkv_engine_state_store_bytes"] > 0
