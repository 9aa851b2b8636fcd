"""Embeddings and reranking served: /v1/embeddings through the official `openai` client and
LangChain's `OpenAIEmbeddings`, /v1/rerank and /rerank through httpx, each equal to the in-process
API (`rwkv_engine.embed`, `Reranker.rerank`) on one live server (an EmbeddingRWKV model with its
reranker, random weights); the 400s; and, on the engine's own turns, that a large embedding job
shares the prefill budget with a chat instead of stalling it.
"""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest
import torch

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.embedding import Reranking, embed_ids, load_reranker
from rwkv_engine.errors import InputError
from rwkv_engine.sampling import SamplingParams
from rwkv_engine.serve.engine import Engine, Finished, InputsRequest, Read, Request
from rwkv_engine.settings import EngineConfig
from rwkv_engine.tokenizer import WorldTokenizer

from .test_serve import Server

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

NAME = "emb"
TEXTS = ["What marks the end of a sequence?", "An end token.", "Apples", "Machine learning needs data, " * 3]
MAX_INPUTS = 8
MAX_PROMPT = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("embserve")
    return {
        "dir": d,
        "embedder": testing.save_pth(testing.random_embedder_state_dict(n_layer=3, n_embd=64, seed=5), d / "emb.pth"),
        "reranker": testing.save_pth(
            testing.random_reranker_state_dict(2, n_embd=64, seed=6, layers=[0, 2]), d / "rr.pth"
        ),
    }


@pytest.fixture(scope="module")
def local(files):
    model = rwkv_engine.load(files["embedder"], progress=False)
    tok = rwkv_engine.load_tokenizer(model)
    return model, tok, load_reranker(model, files["reranker"], progress=False)


@pytest.fixture(scope="module")
def server(files):
    s = Server(
        files["embedder"],
        files["dir"] / "server.log",
        "--reranker",
        str(files["reranker"]),
        "--max-embedding-inputs",
        str(MAX_INPUTS),
        "--max-prompt-tokens",
        str(MAX_PROMPT),
    )
    yield s
    s.stop()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_openai_client_embeddings(server, local):
    model, tok, _ = local
    want = rwkv_engine.embed(model, TEXTS, tok)
    client = _client(server)
    got = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), want, rtol=0, atol=1e-6)
    n_tokens = sum(len(tok.encode(t)) + 1 for t in TEXTS)  # (each with its end token)
    assert got.usage.prompt_tokens == got.usage.total_tokens == n_tokens
    raw = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="base64")
    vecs = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data]
    torch.testing.assert_close(torch.tensor(np.stack(vecs)), want, rtol=0, atol=1e-6)
    # The client's default (it asks for base64 and decodes it), one string, token ids, a task head.
    one = client.embeddings.create(model=NAME, input=TEXTS[2])
    torch.testing.assert_close(
        torch.tensor(one.data[0].embedding), rwkv_engine.embed(model, TEXTS[2], tok), rtol=0, atol=1e-6
    )
    ids = tok.encode(TEXTS[1])
    by_ids = client.embeddings.create(model=NAME, input=[ids], dimensions=64)
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), rwkv_engine.embed(model, ids), rtol=0, atol=1e-6)
    sts = client.embeddings.create(model=NAME, input=TEXTS[:2], extra_body={"task": "sts"})
    want_sts = rwkv_engine.embed(model, TEXTS[:2], tok, task="sts")
    torch.testing.assert_close(torch.tensor([d.embedding for d in sts.data]), want_sts, rtol=0, atol=1e-6)


def test_langchain_embeddings(server, local):
    lc = pytest.importorskip("langchain_openai")
    model, tok, _ = local
    emb = lc.OpenAIEmbeddings(
        model=NAME, base_url=server.url + "/v1", api_key="none", check_embedding_ctx_length=False, max_retries=0
    )
    want = rwkv_engine.embed(model, TEXTS, tok)
    torch.testing.assert_close(torch.tensor(emb.embed_documents(TEXTS)), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(emb.embed_query(TEXTS[0])), rwkv_engine.embed(model, TEXTS[0], tok), rtol=0, atol=1e-6
    )


def test_rerank(server, local):
    model, tok, reranker = local
    query, docs = "which fruit?", ["Apples are fruit.", "Engines run.", "Pears and plums", "Nothing"]
    want = reranker.rerank(tok, query, docs).tolist()
    # In groups of two documents (pieces of a few tokens), as the engine cuts a job: the same scores.
    q = reranker.query_ids(tok, query)
    job = Reranking(reranker, [reranker.document_ids(tok, d) for d in docs], q, budget=2 * len(q))
    pieces = 0
    while not job.done:
        job.step()
        pieces += 1
    assert pieces > len(docs) and job.scores.tolist() == pytest.approx(want, abs=1e-6)
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    for path in ("/v1/rerank", "/rerank"):
        body = {"model": NAME, "query": query, "documents": docs, "top_n": 3}
        got = httpx.post(server.url + path, json=body, timeout=30).json()
        assert [r["index"] for r in got["results"]] == order[:3]
        for r in got["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-6)
            assert r["document"]["text"] == docs[r["index"]]
        assert got["usage"]["total_tokens"] > 0
    # Documents as {"text"}, without them in the answer; the second time from the prompt cache.
    body = {"query": query, "documents": [{"text": d} for d in docs], "return_documents": False}
    got = httpx.post(server.url + "/v1/rerank", json=body, timeout=30).json()
    assert [r["index"] for r in got["results"]] == order
    assert all("document" not in r for r in got["results"])
    n_docs = sum(len(reranker.document_ids(tok, d)) for d in docs)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == n_docs
    assert [r["relevance_score"] for r in got["results"]] == pytest.approx([want[i] for i in order], abs=1e-6)


def test_metrics_count_embeddings_and_reranks(server, local):
    """The embedding and rerank counters of /metrics move by what the answers report (usage) and
    what the requests held; a rerank of the same documents again counts them as cache hits."""
    _, tok, reranker = local
    texts = ["metrics one", "metrics two, a little longer", "three"]
    docs = ["Counted document A.", "Counted document B, longer than A.", "C"]
    before = server.metrics()
    got = httpx.post(server.url + "/v1/embeddings", json={"input": texts}, timeout=30).json()
    assert httpx.post(server.url + "/v1/embeddings", json={"input": []}, timeout=30).status_code == 400
    usages = []
    for query in ("first query", "another query"):
        r = httpx.post(server.url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=30).json()
        usages.append(r["usage"]["prompt_tokens"])
    assert httpx.post(server.url + "/rerank", json={"query": "q", "documents": []}, timeout=30).status_code == 400
    after = server.metrics()

    def moved(name):
        return after.get("rwkv_engine_" + name, 0) - before.get("rwkv_engine_" + name, 0)

    assert moved('embedding_requests_total{outcome="ok"}') == 1
    assert moved('embedding_requests_total{outcome="rejected"}') == 1
    assert moved("embedding_inputs_total") == len(texts)
    n_tokens = sum(len(tok.encode(t)) + 1 for t in texts)  # (each with its end token)
    assert moved("embedding_tokens_total") == got["usage"]["prompt_tokens"] == n_tokens
    assert moved('rerank_requests_total{outcome="ok"}') == 2
    assert moved('rerank_requests_total{outcome="rejected"}') == 1
    assert moved("rerank_documents_total") == 2 * len(docs)
    assert moved("rerank_tokens_total") == sum(usages)
    n_query = len(reranker.query_ids(tok, "first query")) + len(reranker.query_ids(tok, "another query"))
    assert sum(usages) == 2 * sum(len(reranker.document_ids(tok, d)) for d in docs) + len(docs) * n_query
    assert moved("rerank_cache_misses_total") == len(docs)  # read by the first query
    assert moved("rerank_cache_hits_total") == len(docs)  # and cached for the second
    assert moved("embedding_seconds_total") > 0


def test_request_outcomes():
    """What `_counted` files a request under: its answer, or what it raised (re-raised)."""
    import asyncio
    from types import SimpleNamespace

    from fastapi.responses import Response
    from starlette.requests import ClientDisconnect

    from rwkv_engine.serve.errors import APIError
    from rwkv_engine.serve.metrics import Metrics
    from rwkv_engine.serve.serving_embedding import _counted

    ctx = SimpleNamespace(metrics=Metrics())

    async def answer(result):
        if isinstance(result, BaseException):
            raise result
        return result

    cases = [
        (Response(status_code=200), "ok"),
        (Response(status_code=499), "cancelled"),
        (APIError(400, "bad"), "rejected"),
        (APIError(429, "busy"), "rejected"),
        (APIError(503, "stopped"), "error"),
        (ClientDisconnect(), "cancelled"),
        (RuntimeError("bug"), "error"),
    ]
    for result, outcome in cases:
        before = ctx.metrics.get("rerank_requests_total", outcome=outcome)
        try:
            asyncio.run(_counted(ctx, "rerank_requests_total", answer(result)))
        except Exception as e:
            assert e is result
        assert ctx.metrics.get("rerank_requests_total", outcome=outcome) == before + 1, outcome


@pytest.mark.parametrize(
    "path, body, says",
    [
        ("/v1/embeddings", {"input": []}, "input is empty"),
        ("/v1/embeddings", {"input": ["a"] * (MAX_INPUTS + 1)}, f"at most {MAX_INPUTS}"),
        ("/v1/embeddings", {"input": "word " * 100}, f"at most {MAX_PROMPT}"),
        ("/v1/embeddings", {"input": [[1, 70000]]}, "outside the vocabulary"),
        ("/v1/embeddings", {"input": [[]]}, "is empty"),
        ("/v1/embeddings", {"input": "a", "dimensions": 32}, "have 64"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents is empty"),
        ("/v1/rerank", {"query": "q", "documents": ["d"] * (MAX_INPUTS + 1)}, f"at most {MAX_INPUTS}"),
        ("/v1/rerank", {"query": "q", "documents": ["word " * 100]}, f"at most {MAX_PROMPT}"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "embeds; it does not generate"),
        ("/v1/completions", {"prompt": "hi"}, "embeds; it does not generate"),
    ],
)
def test_bad_requests(server, path, body, says):
    r = httpx.post(server.url + path, json={"model": NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def _manual(engine: Engine) -> None:
    """Drive `engine` turn by turn on this thread (`_turns`) instead of its own loop."""
    engine._thread = threading.current_thread()


def _turns(engine: Engine, n: int = 1) -> None:
    for _ in range(n):
        with engine._cond:
            engine._drop_cancelled()
            engine._admit()
        engine._turn()


def test_rerank_needs_a_reranker(local):
    model, tok, _ = local
    engine = Engine(model, tok)
    _manual(engine)
    with pytest.raises(InputError, match="no reranker"):
        engine.submit_inputs(InputsRequest([[1, 2]], query=[3, 65535]), print)


def test_embedding_job_shares_the_prefill_budget(tmp_path):
    """500 texts embedded while a chat arrives: the chat has its first token within two turns
    (the job's piece of the turn it arrived in, then its prompt) and a token every turn after, the job still running; the job's vectors are those of
    `embed_ids` with the same budget (the same pieces), bit for bit, on an LM (mean pooling)."""
    sd = testing.random_state_dict("7", 2, 64, 1000, 16, seed=1)
    model = rwkv_engine.load(testing.save_pth(sd, tmp_path / "lm.pth"), progress=False)
    chunk = 64
    engine = Engine(model, WorldTokenizer(), EngineConfig(prefill_chunk=chunk, state_cache_bytes=0))
    _manual(engine)
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(1, 1000, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (500,), generator=g)]
    got = []
    engine.submit_inputs(InputsRequest(texts), got.append)
    _turns(engine, 3)
    chat = []
    prompt = torch.randint(1, 1000, (40,), generator=g).tolist()
    handle = engine.submit(Request(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=())), chat.append)
    stream = handle._group.rows[0].stream  # (its tokens: a token's text may be empty, a part of a character)
    turns = 0
    while not stream.tokens:
        _turns(engine)
        turns += 1
    assert turns <= 2  # the job's piece of this turn, then the prompt and its first token
    for _ in range(6):  # then one token per turn
        before = len(stream.tokens)
        _turns(engine)
        assert len(stream.tokens) == before + 1
    assert not got, "the job should still be running"
    while not got:
        _turns(engine)
    (read,) = got
    assert isinstance(read, Read) and read.tokens == sum(map(len, texts))
    assert torch.equal(read.values, embed_ids(model, texts, batch_tokens=chunk))
    assert isinstance(chat[-1], Finished) and chat[-1].reason == "length"
