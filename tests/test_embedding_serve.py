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
from rwkv_engine.embedding import Embedding, Reranking, embed_ids, load_reranker
from rwkv_engine.errors import InputError
from rwkv_engine.sampling import SamplingParams
from rwkv_engine.serve.engine import Engine, InputsRequest, Read, Request
from rwkv_engine.settings import EngineConfig
from rwkv_engine.tokenizer import WorldTokenizer

from .conftest import rel_rms
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


class LogModel:
    """The model, logging each turn's work: ("prompt", tokens) for a prompt piece (a list of ids),
    ("embed", rows x positions) for an embedding piece (`prefill` of [B, T])."""

    def __init__(self, model):
        self._model, self.log = model, []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, tokens, *args, **kw):
        if isinstance(tokens, list):
            self.log.append(("prompt", len(tokens)))
        return self._model.forward(tokens, *args, **kw)

    def prefill(self, ids, *args, **kw):  # a list of ids: a prompt piece whose logits nobody reads
        self.log.append(("prompt", len(ids)) if isinstance(ids, list) else ("embed", ids.numel()))
        return self._model.prefill(ids, *args, **kw)


@pytest.fixture
def one_thread():
    """One torch thread: this tiny model's passes cost more in OpenMP barriers than in work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_embedding_job_shares_the_prefill_budget(tmp_path, one_thread):
    """Issue 37: 500 texts embedded while chats arrive. A chat's prompt goes before the job's
    piece: its first token comes in the turn after it arrives (it came a turn later, after the
    job's whole piece), and a token every turn after, the job still running. The job's pieces
    are cut to what the prompts leave (fewer texts in a batch): a turn reads at most the chunk,
    the job reads in every turn where the prompts left it a 32-token piece, and never misses
    two turns running. Its vectors equal `embed_ids` with the whole chunk per piece (other
    batches) within the rel-RMS 1e-5 of an input alone against one in a batch; an LM (mean
    pooling). (prefill_share 0: the whole chunk every turn, whatever the clock.)"""
    sd = testing.random_state_dict("7", 2, 64, 1000, 16, seed=1)
    model = rwkv_engine.load(testing.save_pth(sd, tmp_path / "lm.pth"), progress=False)
    chunk, log = 64, LogModel(model)
    engine = Engine(log, WorldTokenizer(), EngineConfig(prefill_chunk=chunk, state_cache_bytes=0, prefill_share=0))
    _manual(engine)
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(1, 1000, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (500,), generator=g)]
    got = []
    engine.submit_inputs(InputsRequest(texts), got.append)
    turns = []  # per turn: (prompt tokens, embedding tokens)

    def turn():
        before = len(log.log)
        _turns(engine)
        work = log.log[before:]
        turns.append(tuple(sum(n for kind, n in work if kind == k) for k in ("prompt", "embed")))

    for _ in range(3):
        turn()
    assert all(p == 0 and 32 < e <= chunk for p, e in turns)  # alone: about the whole chunk
    greedy = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=())
    streams = []
    for length in (40, 20):  # one leaves the job less than a piece, one more
        prompt = torch.randint(1, 1000, (length,), generator=g).tolist()
        handle = engine.submit(Request(prompt, greedy), lambda e: log.log.append(("delta", e)))
        streams.append(handle._group.rows[0].stream)  # (its tokens: a token's text may be empty)
        before = len(log.log)
        turn()
        assert streams[-1].tokens  # its prompt first, then its first token (and a decode step), in one turn
        prompt_read, embedded = turns[-1]
        assert prompt_read == length and embedded <= chunk - length
        assert (embedded == 0) if chunk - length < 32 else (embedded > 0)
        kinds = [kind for kind, _ in log.log[before:]]
        assert kinds[:2] == ["prompt", "delta"]  # its first token went out before the job's piece
        for _ in range(3):  # then one token per turn
            before = [len(s.tokens) for s in streams]
            turn()
            assert [len(s.tokens) for s in streams] == [min(8, n + 1) for n in before]
    assert not got, "the job should still be running"
    while not got:
        turn()
    assert all(p + e <= chunk for p, e in turns), turns
    assert not any(e == 0 and f == 0 for (_, e), (_, f) in zip(turns, turns[1:])), turns  # never stalled
    assert any(p and e for p, e in turns)  # pieces cut to what the prompts left
    (read,) = got
    assert isinstance(read, Read) and read.tokens == sum(map(len, texts))
    want = embed_ids(model, texts, batch_tokens=chunk)
    for i in range(len(texts)):
        assert rel_rms(read.values[i], want[i]) < 1e-5, i
    assert all(len(s.tokens) == 8 for s in streams)


def test_jobs_read_pieces_cut_to_the_budget(local, one_thread):
    """An embedding and a rerank job stepped with a budget that changes every piece (as the
    engine's turns leave them): each piece reads at most its budget (a rerank's scoring of one
    document: its query, when the budget is smaller than that), and the results are those of the
    whole budget every piece within rel-RMS 1e-5 (the vectors) and 1e-6 (the scores)."""
    model, tok, reranker = local
    g = torch.Generator().manual_seed(3)
    seqs = [
        torch.randint(1, 1000, (int(n),), generator=g).tolist() + [65535]
        for n in torch.randint(1, 40, (40,), generator=g)
    ]
    seqs.append(torch.randint(1, 1000, (300,), generator=g).tolist() + [65535])  # longer than the chunk
    budgets = torch.randint(1, 80, (10_000,), generator=g).tolist()
    job, pieces = Embedding(model, seqs, budget=64), 0
    while not job.done:
        n = job.step(budgets[pieces])
        assert 0 < n <= budgets[pieces], (pieces, budgets[pieces], n)
        pieces += 1
    want = embed_ids(model, seqs, batch_tokens=64)
    for i in range(len(seqs)):
        assert rel_rms(job.vectors[i], want[i]) < 1e-5, i
    assert pieces > len(embed_pieces(model, seqs, 64))
    query = reranker.query_ids(tok, "which fruit?")
    docs = [reranker.document_ids(tok, d) for d in ["Apples are fruit.", "Engines run.", "Pears and plums", "No"]]
    want = Reranking(reranker, docs, query, budget=64)
    while not want.done:
        want.step()
    job, pieces = Reranking(reranker, docs, query, budget=64), 0
    while not job.done:
        n = job.step(budgets[pieces])
        assert n <= max(budgets[pieces], len(query)), (pieces, budgets[pieces], n)
        pieces += 1
    assert job.scores.tolist() == pytest.approx(want.scores.tolist(), abs=1e-6)


def embed_pieces(model, seqs, budget: int) -> list[int]:
    """The tokens of each piece `Embedding` reads with the whole budget every piece."""
    job, out = Embedding(model, seqs, budget=budget), []
    while not job.done:
        out.append(job.step())
    return out
