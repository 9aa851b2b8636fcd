"""Scale-out on Ray, on a local Ray instance (loopback only) with a tiny random-weight World model.

Two engine replicas behind one endpoint, driven by the official `openai` client: answers equal to
`rwkv_engine.generate` (streamed or not), prefix affinity shown by the per-replica cache hits and
routing counters in /metrics, a killed replica replaced while the other keeps answering, and
`rwkv-engine batch` on Ray Data writing the file the local run writes. Embeddings and rerank: a
second application on the same Ray instance, under /emb, serves an EmbeddingRWKV model with its
reranker (random weights); its answers and the World model's equal the single-process server's
(the same app in this process) and `rwkv_engine.embed` / `Reranker.rerank`, and the same
documents under other queries go to the replica that cached them.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import rwkv_engine  # noqa: E402
from rwkv_engine import SamplingParams, testing  # noqa: E402
from rwkv_engine.chat_format import render_chat  # noqa: E402
from rwkv_engine.settings import Config, EngineConfig, ModelSpec  # noqa: E402

from .test_serve import parse_prometheus  # noqa: E402

NAME = "tiny-ray"
CHUNK = 32
SYSTEM = (
    "You are a careful assistant. Answer briefly, cite nothing, and never make things up. "
    "If a question is unclear, ask one short question back. "
) * 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    sd = testing.random_state_dict("5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=9)
    return testing.save_pth(sd, tmp_path_factory.mktemp("m") / f"{NAME}.pth")


@pytest.fixture(scope="module")
def ref(model_path):
    model = rwkv_engine.load(model_path)
    return model, rwkv_engine.load_tokenizer(model)


def test_routing_key_is_the_templates_prompt(ref):
    """The router keys a chat by the first chunk of the prompt the replicas read: rendered by their
    chat template (g1 here, with tools), not by the World format; World stays World."""
    import hashlib
    from array import array

    from rwkv_engine.serve.ray import CHAT, routing_key
    from rwkv_engine.templates import builtin

    _, tok = ref
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SYSTEM}]
    body = json.dumps({"model": NAME, "messages": messages, "tools": tools}).encode()

    def key(prompt):
        return hashlib.sha1(array("q", tok.encode(prompt)[:CHUNK]).tobytes()).hexdigest()

    g1 = routing_key(CHAT, body, tok, CHUNK, builtin("g1"))
    assert g1 == key(builtin("g1").render(messages, tools, thinking=False, enable_thinking=False))
    world = routing_key(CHAT, body, tok, CHUNK)
    assert world == key(builtin("world").render(messages, tools)) != g1
    plain = json.dumps({"model": NAME, "messages": messages}).encode()
    assert routing_key(CHAT, plain, tok, CHUNK) == key(render_chat([("system", "Be brief."), ("user", SYSTEM)]))


@pytest.fixture(scope="module")
def cluster(model_path):
    from rwkv_engine.serve.ray import build_app, free_port

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=128 << 20,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(_config(model_path), replicas=2, replica_cpus=1), name="rwkv-engine", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    yield url
    serve.shutdown()
    ray.shutdown()


def _config(model_path, **engine) -> Config:
    return Config(ModelSpec(str(model_path)), EngineConfig(max_batch=4, prefill_chunk=CHUNK, **engine))


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0, timeout=120)


def _generate(ref, prompt, max_tokens, stop=(), **sampling):
    model, tok = ref
    params = SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=(0,), **sampling)
    gen = rwkv_engine.generate(model, tok, prompt, params)
    gen.read()
    return gen


SEEDED = dict(temperature=1.0, top_p=0.9, presence_penalty=0.2, frequency_penalty=0.2, seed=4)


def test_answers_equal_generate(ref, client):
    want = _generate(ref, "The capital of France is", 16, **SEEDED)
    got = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=16, **SEEDED)
    assert got.choices[0].text == want.text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=NAME, prompt="The capital of France is", max_tokens=16, stream=True, **SEEDED
        )
        if c.choices
    )
    assert streamed == want.text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    want = _generate(ref, render_chat([("system", "Be brief."), ("user", "Hello!")]), 12, stop=("\n\n",), **SEEDED)
    got = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, **SEEDED)
    assert got.choices[0].message.content == want.text.lstrip(" ")


def test_errors_and_endpoints_are_the_servers(cluster, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    r = httpx.post(cluster + "/v1/completions", json={"model": NAME, "prompt": "x", "temperature": -1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(cluster + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --- embeddings and rerank -----------------------------------------------------------------------

TEXTS = ["What marks the end of a sequence?", "An end token.", "Apples", "Machine learning needs data, " * 3]
DOCS = ["Apples are fruit.", "Engines run.", "Pears and plums", "Nothing", "Fruit grows on trees, " * 2]


@pytest.fixture(scope="module")
def emb_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("emb")
    embedder = testing.random_embedder_state_dict(n_layer=3, n_embd=64, seed=5)
    reranker = testing.random_reranker_state_dict(2, n_embd=64, seed=6, layers=[0, 2])
    return testing.save_pth(embedder, d / "emb.pth"), testing.save_pth(reranker, d / "rr.pth")


@pytest.fixture(scope="module")
def emb_app(cluster, emb_files):
    """An EmbeddingRWKV model and its reranker as a second application, under /emb (replicas that
    reserve no CPU, so that `batch --ray` still finds its workers' CPUs)."""
    from rwkv_engine.serve.ray import build_app

    config = _config(emb_files[0], reranker=str(emb_files[1]))
    serve.run(build_app(config, replicas=2, replica_cpus=0), name="rwkv-emb", route_prefix="/emb")
    yield cluster + "/emb"
    serve.delete("rwkv-emb")


class Local:
    """The single-process server of `config`, in this process (`serve.server.build`)."""

    def __init__(self, config: Config):
        from starlette.testclient import TestClient

        from rwkv_engine.serve.server import build

        engine, app = build(config, progress=False)
        self.engine = engine
        self.client = TestClient(app, base_url="http://127.0.0.1")  # (a loopback Host)

    def __enter__(self):
        self.client.__enter__()  # the app's lifespan: the engine runs
        return self

    def __exit__(self, *exc):
        self.client.__exit__(*exc)

    def post(self, path: str, body: dict):
        return self.client.post(path, json=body)


def test_embeddings_through_ray_equal_the_servers(cluster, client, ref, model_path):
    """The World model's embeddings (mean pooling) through the ingress: those of the single-process
    server and of `rwkv_engine.embed`; its 400s (rerank without a reranker included) the same."""
    model, tok = ref
    before = _metrics(cluster)
    want = rwkv_engine.embed(model, TEXTS, tok)
    got = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), want, rtol=0, atol=1e-6)
    raw = client.embeddings.create(model=NAME, input=TEXTS)  # (the client asks for base64, decodes it)
    torch.testing.assert_close(torch.tensor([d.embedding for d in raw.data]), want, rtol=0, atol=1e-6)
    bad = [
        ("/v1/embeddings", {"input": []}),
        ("/v1/embeddings", {"input": [[1, 70000]]}),
        ("/v1/embeddings", {"input": "a", "dimensions": 32}),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
        ("/rerank", {"query": "q", "documents": "not a list"}),
    ]
    with Local(_config(model_path)) as local:
        body = {"model": NAME, "input": TEXTS[:2]}
        here, there = local.post("/v1/embeddings", body), httpx.post(cluster + "/v1/embeddings", json=body, timeout=60)
        assert there.status_code == here.status_code == 200
        assert _close(there.json(), here.json())
        for path, body in bad:
            body = {"model": NAME, **body}
            here, there = local.post(path, body), httpx.post(cluster + path, json=body, timeout=60)
            assert there.status_code == here.status_code == 400, (path, there.text)
            assert there.json() == here.json()
    # Embeddings (and invalid bodies) have no routing key: the least-loaded replica answers them;
    # a valid rerank body is keyed by its documents.
    m = _metrics(cluster)
    routed = {
        r: sum(v - before.get(k, 0) for k, v in m.items() if f'route="{r}"' in k) for r in ("least_loaded", "affinity")
    }
    assert routed == {"least_loaded": 3 + len(bad) - 1, "affinity": 1}, routed


def test_rerank_through_ray_equals_the_servers_and_hits_the_cache(emb_app, emb_files):
    """A rerank through the ingress of the embedder application: the single-process server's
    answer and `Reranker.rerank`'s scores; the same documents under other queries, in another
    order, go to the replica that has their prefix states (every document token from its cache);
    embeddings with a task head equal `rwkv_engine.embed`'s."""
    from rwkv_engine.embedding import load_reranker

    model = rwkv_engine.load(emb_files[0], progress=False)
    tok = rwkv_engine.load_tokenizer(model)
    reranker = load_reranker(model, emb_files[1], progress=False)
    query = "which fruit?"
    want = reranker.rerank(tok, query, DOCS).tolist()
    body = {"model": "emb", "query": query, "documents": DOCS, "top_n": 3}
    with Local(_config(emb_files[0], reranker=str(emb_files[1]))) as local:
        here = local.post("/v1/rerank", body).json()
    there = httpx.post(emb_app + "/v1/rerank", json=body, timeout=60).json()
    here.pop("id"), there.pop("id")
    assert _close(there, here)
    assert [r["relevance_score"] for r in there["results"]] == pytest.approx(sorted(want, reverse=True)[:3], abs=1e-6)

    before = _metrics(emb_app)
    n_docs = sum(len(reranker.document_ids(tok, d)) for d in DOCS)
    shuffled = random.Random(0).sample(DOCS, len(DOCS))
    for i, path in enumerate(["/v1/rerank", "/rerank", "/v1/rerank"]):
        got = httpx.post(emb_app + path, json={"query": f"query {i}", "documents": shuffled}, timeout=60).json()
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == n_docs, got["usage"]
        scores = reranker.rerank(tok, f"query {i}", shuffled).tolist()
        assert {r["index"]: r["relevance_score"] for r in got["results"]} == pytest.approx(dict(enumerate(scores)))
    m = _metrics(emb_app)
    affinity = {k: v - before.get(k, 0) for k, v in m.items() if 'route="affinity"' in k}
    assert max(affinity.values()) == 3, affinity  # all three on one replica
    deadline = time.monotonic() + 30  # replicas publish their metrics every PUSH_SECONDS
    while m["rwkv_engine_replicas"] < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        m = _metrics(emb_app)
    assert m["rwkv_engine_replicas"] == 2  # this application's replicas only

    emb = openai.OpenAI(base_url=emb_app + "/v1", api_key="unused", max_retries=0, timeout=120)
    got = emb.embeddings.create(model="emb", input=TEXTS[:2], extra_body={"task": "sts"})
    want = rwkv_engine.embed(model, TEXTS[:2], tok, task="sts")
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), want, rtol=0, atol=1e-6)


def _close(a, b) -> bool:
    """JSON values equal, floats within 1e-6 (two processes may round a sum differently)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-6
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _metrics(url) -> dict[str, float]:
    """The endpoint's summed metrics, checked to be a well-formed Prometheus exposition."""
    return parse_prometheus(httpx.get(url + "/metrics", timeout=60).text)


def test_prefix_affinity_keeps_the_cache_hitting(cluster, client):
    before = _metrics(cluster)
    for i in range(6):
        client.chat.completions.create(
            model=NAME,
            max_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}],
        )
    deadline = time.monotonic() + 20
    while True:  # replicas publish their metrics every second
        m = _metrics(cluster)
        hits = {
            k: v - before.get(k, 0) for k, v in m.items() if k.startswith("rwkv_engine_replica_prompt_cache_hits_total")
        }
        if sum(hits.values()) >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    affinity = {k: v - before.get(k, 0) for k, v in m.items() if 'route="affinity"' in k}
    assert sum(affinity.values()) >= 6 and max(affinity.values()) >= 6, affinity  # all six on one replica
    assert max(hits.values()) >= 5, hits  # and its cache hit for all but the first
    assert m["rwkv_engine_replicas"] == 2
    assert m["rwkv_engine_prompt_cache_hits_total"] >= 5  # the summed series


def test_replicas_start_with_the_commands_openmp_spin(cluster):
    """A replica does not start through `rwkv-engine`, which sets libgomp's spin before torch
    loads (rwkv_engine/threads.py); its actor's environment carries it instead."""
    import os
    from pathlib import Path

    import httpx

    assert httpx.get(cluster + "/health", timeout=60).status_code == 200
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if b"EngineReplica" in (proc / "cmdline").read_bytes():
                found.append((proc / "environ").read_bytes().split(b"\0"))
        except (OSError, ValueError):
            continue
    assert found, "no replica process found"
    want = b"GOMP_SPINCOUNT=" + (os.environ.get("GOMP_SPINCOUNT", "10000")).encode()
    if "OMP_WAIT_POLICY" in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        pytest.skip("this environment sets OMP_WAIT_POLICY: the replicas inherit it")
    assert all(want in env for env in found), found[0][:5]


def test_killed_replica_is_replaced(cluster, client, ref):
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "rwkv-engine#EngineReplica" in a["name"]]
    assert len(names) == 2
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    want = _generate(ref, "Once upon a time", 8, temperature=0.0)
    for _ in range(4):  # the other replica answers; one sent to the dead one is retried
        got = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, temperature=0)
        assert got.choices[0].text == want.text
    deadline = time.monotonic() + 90
    while True:
        status = serve.status().applications["rwkv-engine"].deployments["EngineReplica"]
        running = status.replica_states.get("RUNNING", 0)
        if running == 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert running == 2, status


def test_batch_on_ray_equals_local(cluster, model_path, tmp_path):
    from rwkv_engine.cli import main

    lines = [json.dumps({"prompt": f"Item {i}:", "max_tokens": 6, **SEEDED, "seed": i}) for i in range(7)]
    lines.insert(3, "not json")
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    local = subprocess.run(
        [
            sys.executable,
            "-m",
            "rwkv_engine",
            "batch",
            str(model_path),
            str(inp),
            str(tmp_path / "local.jsonl"),
            "--max-batch",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert local.returncode == 0, local.stderr[-2000:]
    # On the module's Ray instance (already connected, so the command joins it and leaves it up).
    assert (
        main(
            [
                "batch",
                str(model_path),
                str(inp),
                str(tmp_path / "ray.jsonl"),
                "--max-batch",
                "2",
                "--ray",
                "--workers",
                "2",
            ]
        )
        == 0
    )

    def strip(path):
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for r in rows:
            r["response"]["body"].pop("id", None)
            r["response"]["body"].pop("created", None)
        return rows

    assert strip(tmp_path / "ray.jsonl") == strip(tmp_path / "local.jsonl")
    assert len(strip(tmp_path / "ray.jsonl")) == len(lines)
