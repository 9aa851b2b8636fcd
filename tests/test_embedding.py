"""Embeddings and reranking against `rwkv_emb`'s own reference code, and their bad inputs.

rwkv_emb 0.2.6 (PyPI `rwkv-emb`, the EmbeddingRWKV authors' package) runs on CUDA only: at import
it compiles an fp16 WKV kernel, scripts its functions with TorchScript and puts every tensor on
"cuda" in fp16. `reference` imports it here with the compile skipped, TorchScript off (so its
functions look up the WKV op at call time), the WKV op replaced by a naive fp32 recurrence
written below, and, while it runs, "cuda" read as the CPU and fp16 as fp32 (a torch function
mode); the process-wide settings its import changes are put back. Everything else (the weight
layout, ln0 folding, the blocks, the end-token pooling, the task heads, the reranker) is its
code, unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import rwkv_engine
from rwkv_engine import ModelConfig, testing
from rwkv_engine.embedding import END_TOKEN, embed_ids, encode
from rwkv_engine.errors import CheckpointError, InputError

from .conftest import rel_rms

TEXTS = [
    "What represents the end of a sequence?",
    "The EOS token is used to mark the end of a sentence.",
    "Apples",
    "Machine learning requires large datasets, and " * 3,
]


def _naive_wkv(state, r, w, k, v, a, b):
    """rwkv_emb's WKV op, one step at a time in fp32: state [..., H, N(value), N(key)] updated in
    place; r, w, k, v, a, b [C] (one token), [T, C] or [B, T, C]; w is the sigmoid that the op
    turns into the decay exp(-e^-0.5 w)."""
    H, N = state.shape[-3], state.shape[-1]
    one = r.dim() == 1
    lead = r.shape[:-1]
    r, w, k, v, a, b = (t.float().reshape(*lead, H, N) for t in (r, w, k, v, a, b))
    decay = torch.exp(-math.exp(-0.5) * w)
    s = state.float().clone()
    steps = (
        [(r, decay, k, v, a, b)]
        if one
        else [tuple(t.select(-3, i) for t in (r, decay, k, v, a, b)) for i in range(r.shape[-3])]
    )
    ys = []
    for rt, wt, kt, vt, at, bt in steps:
        sa = (s * at.unsqueeze(-2)).sum(-1, keepdim=True)
        s = s * wt.unsqueeze(-2) + sa * bt.unsqueeze(-2) + vt.unsqueeze(-1) * kt.unsqueeze(-2)
        ys.append((s * rt.unsqueeze(-2)).sum(-1))
    state.copy_(s)
    y = ys[0] if one else torch.stack(ys, dim=-3)
    return y.reshape(*lead, H * N)


class _OnCpu(TorchFunctionMode):
    """ "cuda" as the CPU and fp16 as fp32 in every torch call made while active."""

    @staticmethod
    def _fix(x):
        if isinstance(x, str) and x == "cuda" or isinstance(x, torch.device) and x.type == "cuda":
            return torch.device("cpu")
        return torch.float32 if x is torch.float16 else x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = tuple(self._fix(a) for a in args)
        kwargs = {k: self._fix(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def reference():
    """rwkv_emb.model on the CPU (module docstring)."""
    pytest.importorskip("rwkv_emb", reason="rwkv-emb (the test extra) is not installed")
    import torch.utils.cpp_extension

    jit_autocast = torch._C._jit_set_autocast_mode(True)  # (returns the setting it replaces)
    with pytest.MonkeyPatch.context() as mp:
        # Its import sets these process-wide (TF32 matmuls on CUDA): put back afterwards.
        mp.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
        mp.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
        mp.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
        mp.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: None)
        mp.setattr(torch.jit, "ScriptModule", nn.Module)
        mp.setattr(torch.jit, "script_method", lambda f: f)
        mp.setattr(torch.jit, "script", lambda f: f)
        # Its image tower's classes, never used for text: not worth importing transformers for.
        mp.setitem(sys.modules, "transformers", types.SimpleNamespace(SiglipVisionModel=None, SiglipVisionConfig=None))
        for name in [n for n in sys.modules if n.startswith("rwkv_emb")]:
            mp.delitem(sys.modules, name)
        ref7 = importlib.import_module("rwkv_emb.reference.rwkv7")
        model = importlib.import_module("rwkv_emb.model")
    torch._C._jit_set_autocast_mode(jit_autocast)
    ref7.RWKV7_OP = ref7.RWKV7_ONE_OP = ref7.RWKV7_BATCH_OP = _naive_wkv
    ref7.DTYPE = model.DTYPE = torch.float32
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("emb")
    return {
        "embedder": testing.save_pth(testing.random_embedder_state_dict(n_layer=3, seed=5), d / "emb.pth"),
        "reranker": testing.save_pth(testing.random_reranker_state_dict(2, seed=6, layers=[0, 2]), d / "rr.pth"),
        "reranker-plain": testing.save_pth(testing.random_reranker_state_dict(2, seed=7), d / "rr2.pth"),
    }


@pytest.fixture(scope="module")
def embedder(files):
    model = rwkv_engine.load(files["embedder"])
    return model, rwkv_engine.load_tokenizer(model)


def _ref_embed(ref, ids, task):
    with _OnCpu():
        vec, _ = ref.forward(ids, None, task_type=f"[{task.upper()}]")
    return vec


def test_embeddings_match_reference(reference, files, embedder):
    model, tok = embedder
    with _OnCpu():
        ref = reference.EmbeddingRWKV(str(files["embedder"]))
    ours = rwkv_engine.embed(model, TEXTS, tok)  # the retrieval head, its default
    assert ours.shape == (len(TEXTS), 128)
    for i, text in enumerate(TEXTS):
        assert rel_rms(ours[i], _ref_embed(ref, tok.encode(text) + [END_TOKEN], "retr")[0]) < 1e-5, i
    for task in ("cls", "sts"):
        ours = rwkv_engine.embed(model, TEXTS[1], tok, task=task)
        assert rel_rms(ours, _ref_embed(ref, tok.encode(TEXTS[1]) + [END_TOKEN], task)[0]) < 1e-5, task
    # its batch path (rows of one length)
    same = [(tok.encode(t) * 5)[:5] + [END_TOKEN] for t in TEXTS]
    with _OnCpu():
        want, _ = ref.forward(same, None)
    assert rel_rms(rwkv_engine.embed(model, same), want) < 1e-5


def test_rerank_scores_match_reference(reference, files, embedder):
    """Our scores read the document prefix's state, then the query: the reference reads the
    whole sequence at once (its online mode); the same logits either way."""
    model, tok = embedder
    for name in ("reranker", "reranker-plain"):
        reranker = rwkv_engine.load_reranker(model, files[name])
        assert reranker.layers == ([0, 2] if name == "reranker" else [0, 1])
        with _OnCpu():
            ref = reference.EmbeddingRWKV(str(files["embedder"]))
            ref_rr = reference.RWKVReRanker(str(files[name]))
        query, docs = TEXTS[0], TEXTS[1:]
        q = reranker.query_ids(tok, query)
        states = rwkv_engine.State.cat([model.prefill(reranker.document_ids(tok, d)) for d in docs])
        ours = reranker.score_ids(states, q)
        for i, d in enumerate(docs):
            with _OnCpu():
                _, st = ref.forward([reranker.document_ids(tok, d) + q], None)
                want = ref_rr.forward(st[1])
            assert abs(float(ours[i]) - float(want)) < 1e-4 * max(1.0, abs(float(want))), (name, i)
        assert torch.allclose(reranker.rerank(tok, query, docs), torch.sigmoid(ours), atol=1e-6)


def test_rerank_reads_documents_together_as_alone(files, embedder):
    """Documents of equal and of different lengths (one twice, one longer than the budget) in
    one rerank: each state and score is the one its document gives read alone, the pieces read
    exactly the documents' and queries' tokens (no padding) within the budget, a document found
    in the cache, or met twice, is not read again, and documents of one length share their
    pieces."""
    model, tok = embedder
    reranker = rwkv_engine.load_reranker(model, files["reranker"])
    docs = [reranker.document_ids(tok, d) for d in ("Apples", "Pears", "Apples", *TEXTS)]
    docs.append(reranker.document_ids(tok, " ".join(TEXTS * 3)))
    query = reranker.query_ids(tok, "which fruit?")
    budget = 8 * len(query)
    assert len(docs[-1]) > budget and len(docs[0]) == len(docs[1])

    class Cache(dict):
        def get(self, ids):
            return super().get(tuple(ids))

        def put(self, ids, state):
            self[tuple(ids)] = state

    cache = Cache()
    job = rwkv_engine.embedding.Reranking(reranker, docs, query, budget=budget, cache=cache)
    pieces = []
    while not job.done:
        pieces.append(job.step())
    distinct = {tuple(d) for d in docs}
    assert sum(pieces) == sum(map(len, distinct)) + len(docs) * len(query) and max(pieces) <= budget
    for d in distinct:
        assert rel_rms(cache[d].att_kv, model.prefill(list(d)).att_kv) < 1e-5
    alone = torch.cat([reranker.score_ids(model.prefill(d), query) for d in docs])
    torch.testing.assert_close(job.scores, torch.sigmoid(alone), rtol=0, atol=1e-6)
    again = rwkv_engine.embedding.Reranking(reranker, docs, reranker.query_ids(tok, "q"), budget=budget, cache=cache)
    while not again.done:
        again.step()
    assert again.cached == sum(map(len, docs))
    # Documents of one length: one piece reads them all, one scores them.
    same = [_long_ids(30, seed) for seed in range(4)]
    job = rwkv_engine.embedding.Reranking(reranker, same, query, budget=4 * 30)
    pieces = []
    while not job.done:
        pieces.append(job.step())
    assert pieces == [4 * 30, 4 * len(query)]
    alone = torch.cat([reranker.score_ids(model.prefill(d), query) for d in same])
    torch.testing.assert_close(job.scores, torch.sigmoid(alone), rtol=0, atol=1e-6)


def _long_ids(n, seed=0):
    return torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_alone_equals_batched(embedder, make_pth):
    """An input embedded alone equals the same input among others (right padding, sorting,
    pieces of the prefill), for the end-token pooling and for the mean pooling."""
    model, tok = embedder
    seqs = encode(model, tok, TEXTS) + [_long_ids(700) + [END_TOKEN]]
    together = embed_ids(model, seqs, batch_tokens=100_000)
    small = embed_ids(model, seqs, batch_tokens=64)  # other batches, other padding
    for i, s in enumerate(seqs):
        alone = embed_ids(model, [s])[0]
        assert rel_rms(together[i], alone) < 1e-5 and rel_rms(small[i], alone) < 1e-5, i
    lm = rwkv_engine.load(make_pth("7"))
    ids = [_long_ids(n, n) for n in (3, 40, 600, 17)]
    together = rwkv_engine.embed(lm, ids)
    for i, s in enumerate(ids):
        assert rel_rms(together[i], rwkv_engine.embed(lm, s)) < 1e-5, i


@pytest.mark.parametrize("version", ["5.2", "7"])
def test_mean_pooling_of_any_model(make_pth, version):
    """Any RWKV model embeds: the unit-length mean of its final hidden states, which are what
    its LM head reads (checked against its own logits)."""
    lm = rwkv_engine.load(make_pth(version))
    ids = _long_ids(30)
    hidden, state = lm.hidden(ids)
    logits, state2 = lm.forward(ids, all_logits=True)
    assert rel_rms(lm.head(hidden.to(lm.dtype)).float(), logits) < 1e-5
    assert rel_rms(state.att_kv, state2.att_kv) < 1e-6
    vec = rwkv_engine.embed(lm, ids)
    assert torch.allclose(vec, F.normalize(hidden.mean(0), dim=-1), atol=1e-6)
    assert abs(float(vec.norm()) - 1) < 1e-5
    assert rwkv_engine.embed(lm, ids, normalize=False).norm() > 1.5  # (the raw mean)


def test_quantized_and_converted_embedders(files, embedder, make_pth, tmp_path):
    """A converted directory embeds as its checkpoint; q8 stays close (the task heads stay fp32)."""
    from rwkv_engine.loading import converted, prepare

    model, tok = embedder
    want = rwkv_engine.embed(model, TEXTS, tok)
    out = converted.convert(prepare(files["embedder"]), tmp_path / "conv", progress=False)
    again = rwkv_engine.load(out)
    assert again.config == model.config
    assert torch.equal(rwkv_engine.embed(again, TEXTS, tok), want)
    # configs written before the head fields existed (sessions, directories) read as language models;
    # JSON's lists read back as the tuples they were
    lm = rwkv_engine.load(make_pth("7")).config
    heads = ("lm_head", "task_heads", "task_dim", "score_head")
    assert ModelConfig(**{k: v for k, v in dataclasses.asdict(lm).items() if k not in heads}) == lm
    assert ModelConfig(**json.loads(json.dumps(dataclasses.asdict(model.config)))) == model.config
    q8 = rwkv_engine.load(files["embedder"], quantization="q8")
    assert q8.task_heads["retr"].fc1.dtype == torch.float32
    assert rel_rms(rwkv_engine.embed(q8, TEXTS, tok), want) < 0.05


def _expect(exc, pattern, fn, *args, **kw):
    with pytest.raises(exc, match=pattern):
        fn(*args, **kw)


def test_checkpoint_errors(files, embedder, make_pth, tmp_path):
    model, _ = embedder
    sd = testing.random_embedder_state_dict(n_layer=2, n_embd=64, head_size=16, vocab_size=300)
    bare = {k: v for k, v in sd.items() if not k.startswith("head.")}
    _expect(CheckpointError, r"no head.*task heads", rwkv_engine.load, testing.save_pth(bare, tmp_path / "bare.pth"))
    half = {k: v for k, v in sd.items() if k != "head.sts_head.fc2.weight"}
    _expect(
        CheckpointError,
        "missing.*head.sts_head.fc2.weight",
        rwkv_engine.load,
        testing.save_pth(half, tmp_path / "h.pth"),
    )
    odd = dict(sd, **{"head.foo_head.fc1.weight": torch.zeros(64, 64)})
    _expect(
        CheckpointError, "unknown task head head.foo_head", rwkv_engine.load, testing.save_pth(odd, tmp_path / "o.pth")
    )
    # a reranker alone, on a language model, on an embedder of another width or depth
    _expect(CheckpointError, "reranker.*cannot run alone", rwkv_engine.load, files["reranker"])
    _expect(CheckpointError, "not a reranker", rwkv_engine.load_reranker, model, files["embedder"])
    _expect(CheckpointError, "not one", rwkv_engine.load_reranker, rwkv_engine.load(make_pth("7")), files["reranker"])
    small = rwkv_engine.load(testing.save_pth(sd, tmp_path / "small.pth"))
    _expect(CheckpointError, "does not fit.*not its embedder", rwkv_engine.load_reranker, small, files["reranker"])
    shallow = testing.save_pth(testing.random_embedder_state_dict(n_layer=1, vocab_size=300), tmp_path / "s.pth")
    shallow = rwkv_engine.load(shallow)
    _expect(
        CheckpointError, "has 1 layers: not its embedder", rwkv_engine.load_reranker, shallow, files["reranker-plain"]
    )
    deep_idx = testing.save_pth(testing.random_reranker_state_dict(2, layers=[0, 5]), tmp_path / "rr5.pth")
    _expect(CheckpointError, "names embedder layer 5", rwkv_engine.load_reranker, model, deep_idx)
    # one file holding both loads as an embedder, and as its own reranker
    both = {**testing.random_embedder_state_dict(n_layer=3, vocab_size=300), **testing.random_reranker_state_dict(2)}
    both = testing.save_pth(both, tmp_path / "both.pth")
    pair = rwkv_engine.load(both)
    assert pair.config.task_heads and rwkv_engine.load_reranker(pair, both).layers == [0, 1]


def test_input_errors(embedder, files, make_pth):
    model, tok = embedder
    _expect(InputError, "no language-model head", model.forward, [1, 2, 3])
    _expect(InputError, "inputs must be", rwkv_engine.embed, model, [], tok)
    _expect(InputError, "input 1 is empty", rwkv_engine.embed, model, ["a", []], tok)
    _expect(InputError, "token id 70000 is outside the vocabulary", rwkv_engine.embed, model, [5, 70000])
    _expect(InputError, "input 1 must be a string or a list of token ids", rwkv_engine.embed, model, ["a", 3.5], tok)
    _expect(InputError, "task heads are cls, retr, sts", rwkv_engine.embed, model, "a", tok, task="nope")
    lm = rwkv_engine.load(make_pth("7"))
    _expect(InputError, "no task heads", rwkv_engine.embed, lm, [1, 2], task="retr")
    _expect(InputError, "the input is empty", rwkv_engine.embed, lm, [[]])
    _expect(InputError, "documents is empty", rwkv_engine.Reranker(model, None, []).rerank, tok, "q", [])
    # ids that end with the end token already are taken as they are: the same vector
    assert torch.equal(rwkv_engine.embed(model, [5, 6]), rwkv_engine.embed(model, [5, 6, END_TOKEN]))


def test_cli_embeds_files(files, embedder, tmp_path, capsys, monkeypatch):
    """Text lines and JSONL in, JSONL and .npy out, in the input's order; bad input: one line.
    (In this process: cli.main is what the console script runs; test_cli checks the script.)"""
    import io

    import numpy as np

    from rwkv_engine.cli import main

    def run(*args, stdin=""):
        data = stdin if isinstance(stdin, bytes) else stdin.encode()
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        rc = main(["embed", str(files["embedder"]), *map(str, args)])
        return rc, *capsys.readouterr()

    model, tok = embedder
    want = rwkv_engine.embed(model, TEXTS, tok, task="sts")
    lines = tmp_path / "in.jsonl"
    lines.write_text(
        "".join(json.dumps(t if i % 2 else {"text": t, "id": f"d{i}"}) + "\n" for i, t in enumerate(TEXTS))
    )
    rc, out, err = run(lines, "-o", tmp_path / "out.npy", "--task", "sts", "--batch-tokens", "16")
    assert rc == 0 and "4 texts" in err, err
    assert rel_rms(torch.from_numpy(np.load(tmp_path / "out.npy")), want) < 1e-5
    rc, out, err = run(lines, "--task", "sts")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(row["index"], row.get("id")) for row in rows] == [(0, "d0"), (1, None), (2, "d2"), (3, None)]
    assert rel_rms(torch.tensor([row["embedding"] for row in rows]), want) < 1e-5
    rc, out, err = run("-", "--task", "sts", stdin="\n".join(TEXTS) + "\n")
    assert rc == 0 and rel_rms(torch.tensor([json.loads(line)["embedding"] for line in out.splitlines()]), want) < 1e-5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n{"text": 3}\n')
    for args, stdin, message in [
        ((bad,), "", "bad.jsonl line 2: expected a JSON string or an object"),
        ((tmp_path / "none.txt",), "", "none.txt: no such file"),
        (("-", "--input-format", "jsonl"), "{oops\n", "- line 1: not valid JSON"),
        (("-",), "one\n\nthree\n", "- line 2: the text is empty"),
        (("-",), "", "-: no texts"),
        (("-",), b"ok\n\xff\n", "-: not UTF-8 text (invalid start byte at byte 3)"),
    ]:
        rc, out, err = run(*args, stdin=stdin)
        assert rc == 1 and err.count("\n") == 1 and message in err and not out, err
