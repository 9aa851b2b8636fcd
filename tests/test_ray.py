"""Scale-out on Ray, on a local Ray instance (loopback only) with a tiny random-weight World model.

Two engine replicas behind one endpoint, driven by the official `openai` client: answers equal to
`rwkv_engine.generate` (streamed or not), prefix affinity shown by the per-replica cache hits and
routing counters in /metrics, a killed replica replaced while the other keeps answering, and
`rwkv-engine batch` on Ray Data writing the file the local run writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import rwkv_engine  # noqa: E402
from rwkv_engine import SamplingParams, testing  # noqa: E402
from rwkv_engine.chat_format import render_chat  # noqa: E402

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
    from rwkv_engine.settings import Config, EngineConfig, ModelSpec

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=128 << 20,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = Config(ModelSpec(str(model_path)), EngineConfig(max_batch=4, prefill_chunk=CHUNK))
    serve.run(build_app(config, replicas=2, replica_cpus=1), name="rwkv-engine", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    yield url
    serve.shutdown()
    ray.shutdown()


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


def test_killed_replica_is_replaced(cluster, client, ref):
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
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
