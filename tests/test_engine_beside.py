"""Prompt pieces read beside the decode steps (serve/beside.py, `--prefill-threads`): the
streams keep decoding while a prompt is read on the prefill thread, the answers stay those of
each request alone, and a cancel or a failure of the piece in flight ends only its request.

These drive `Engine` on a tiny random model; a piece on the prefill thread can be held until the
engine thread has run decode steps, so the tests assert on the order of work, not on time."""

from __future__ import annotations

import threading

import pytest
import torch

import rwkv_engine
from rwkv_engine import SamplingParams
from rwkv_engine.errors import InputError
from rwkv_engine.serve.engine import Delta, Engine, EngineConfig, Finished, Request

CHUNK = 32
MARK = 9  # the first token of the prompts whose pieces the tests hold

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2, reason="a prefill thread needs two threads")


@pytest.fixture(scope="module")
def model_and_tokenizer(make_pth):
    model = rwkv_engine.load(make_pth("7", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=11))
    return model, rwkv_engine.load_tokenizer(model)


class HeldModel:
    """The model; a piece of a MARK prompt on the prefill thread waits for `release` (or, with
    `steps`, for that many decode steps of the engine thread), and may raise `fail`."""

    def __init__(self, model, steps: int = 0):
        self._model, self.steps, self.decodes = model, steps, 0
        self.release, self.held, self.timed_out = threading.Event(), threading.Event(), False
        self.fail: Exception | None = None
        self.threads: set[str] = set()
        self._cond = threading.Condition()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _piece(self, tokens) -> None:
        if not (isinstance(tokens, list) and tokens and tokens[0] == MARK):
            return
        name = threading.current_thread().name
        self.threads.add(name)
        if not name.endswith(" prefill"):
            return
        self.held.set()
        with self._cond:
            start = self.decodes
            ok = self._cond.wait_for(lambda: self.decodes >= start + self.steps, timeout=30) if self.steps else True
        self.timed_out |= not ok or not self.release.wait(30)
        if self.fail is not None:
            raise self.fail

    def forward(self, tokens, *args, **kw):
        self._piece(tokens)
        return self._model.forward(tokens, *args, **kw)

    def prefill(self, tokens, *args, **kw):
        self._piece(tokens)
        return self._model.prefill(tokens, *args, **kw)

    def forward_into(self, *args, **kw):  # a decode step's forward
        out = self._model.forward_into(*args, **kw)
        with self._cond:
            self.decodes += 1
            self._cond.notify_all()
        return out


def started(model, **config) -> Engine:
    engine = Engine(model, rwkv_engine.load_tokenizer(model._model), EngineConfig(prefill_chunk=CHUNK, **config))
    engine.start()
    import time

    deadline = time.monotonic() + 600  # the warm-up may build the native kernels first
    while not engine.ready:
        assert engine.alive and time.monotonic() < deadline
        time.sleep(0.05)
    return engine


class Collect:
    """Each request's text and Finished event, by index."""

    def __init__(self):
        self.texts: dict[int, list[str]] = {}
        self.finished: dict[int, Finished] = {}
        self.done, self.decoding = threading.Event(), threading.Event()  # (decoding: request 0's first token)
        self.expect = 0

    def sink(self, i: int):
        def sink(event):
            if isinstance(event, Delta):
                self.texts.setdefault(i, []).append(event.text)
                if i == 0:
                    self.decoding.set()
            elif isinstance(event, Finished):
                self.finished[i] = event
                if len(self.finished) == self.expect:
                    self.done.set()

        return sink


def stream_decodes(engine: Engine, out: Collect, tokens: int) -> None:
    """Request 0: a stream of `tokens` greedy tokens, decoding when this returns (its first token
    is out), so that a prompt submitted next is read beside its decode steps."""
    engine.submit(Request([5, 6, 7], SamplingParams(temperature=0, max_tokens=tokens, stop_token_ids=())), out.sink(0))
    assert out.decoding.wait(60)


def serves_again(engine: Engine) -> None:
    """The engine answers a new request to its end."""
    again = Collect()
    again.expect = 1
    engine.submit(Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3)), again.sink(0))
    assert again.done.wait(60) and again.finished[0].reason == "length"


def test_streams_decode_while_the_prefill_thread_reads_a_prompt(model_and_tokenizer):
    """A stream decodes; a 3-chunk prompt arrives. Its pieces go to the prefill thread, and each
    waits there until the engine thread has run 3 more decode steps: with prefill and decode
    taking turns the piece would wait for steps that never come (30 s, then the test fails)."""
    model, tok = model_and_tokenizer
    held = HeldModel(model, steps=3)
    held.release.set()
    engine = started(held)
    out = Collect()
    out.expect = 2
    try:
        assert engine._worker is not None
        stream_decodes(engine, out, 400)
        long_ids = [MARK] + [(13 * i) % 3000 + 1 for i in range(3 * CHUNK)]
        engine.submit(Request(long_ids, SamplingParams(temperature=0, max_tokens=4, stop_token_ids=())), out.sink(1))
        assert out.done.wait(120)
    finally:
        engine.stop()
    assert not held.timed_out
    assert held.threads == {"rwkv-engine serve prefill"}, held.threads  # every piece on the prefill thread
    assert out.finished[1].reason == "length" and out.finished[0].reason == "length"
    assert engine.metrics.get("prefill_beside_seconds_total") > 0


def test_answers_with_a_prefill_thread_are_each_requests_alone(model_and_tokenizer):
    """Prompts of 5-300 tokens arriving while others decode, greedy: each answer is what
    `rwkv_engine.generate` gives the same prompt alone (pieces read on one thread of two, the
    decode rows on the other), and pieces did go to the prefill thread."""
    model, tok = model_and_tokenizer
    engine = Engine(model, tok, EngineConfig(prefill_chunk=CHUNK, max_batch=8))
    engine.start()
    import time

    while not engine.ready:
        assert engine.alive
        time.sleep(0.05)
    greedy = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=())
    prompts = [[(7 * i + 3 * n) % 5000 + 1 for i in range(n)] for n in (5, 300, 40, 170, 64, 33, 250, 12)]
    out = Collect()
    out.expect = len(prompts)
    try:
        assert engine._worker is not None
        for i, ids in enumerate(prompts):
            engine.submit(Request(list(ids), greedy), out.sink(i))
            time.sleep(0.02)
        assert out.done.wait(300)
    finally:
        engine.stop()
    assert engine.metrics.get("prefill_beside_seconds_total") > 0
    for i, ids in enumerate(prompts):
        alone = "".join(rwkv_engine.generate(model, tok, ids, greedy))
        assert "".join(out.texts.get(i, [])) == alone, f"request {i} ({len(ids)} prompt tokens)"


def test_a_request_cancelled_while_its_piece_is_read_ends_alone(model_and_tokenizer):
    """The request whose piece is on the prefill thread is cancelled: once the piece is back it
    finishes "cancelled", the stream that was decoding goes on to its end, and the engine serves
    the next request."""
    model, tok = model_and_tokenizer
    held = HeldModel(model)
    engine = started(held)
    out = Collect()
    out.expect = 2
    try:
        stream_decodes(engine, out, 60)
        ids = [MARK] + [3] * (4 * CHUNK)
        handle = engine.submit(Request(ids, SamplingParams(temperature=0, max_tokens=4)), out.sink(1))
        assert held.held.wait(60)
        handle.cancel()
        held.release.set()
        assert out.done.wait(120)
        assert out.finished[1].reason == "cancelled" and out.finished[0].reason == "length"
        assert out.finished[0].completion_tokens == 60
        serves_again(engine)
    finally:
        engine.stop()


def test_a_piece_that_fails_on_the_prefill_thread_fails_only_its_request(model_and_tokenizer):
    """The piece in flight raises: its request finishes "error" with the message, the decoding
    stream finishes normally, and the engine keeps serving."""
    model, tok = model_and_tokenizer
    held = HeldModel(model)
    held.fail = RuntimeError("the piece broke")
    engine = started(held)
    out = Collect()
    out.expect = 2
    try:
        stream_decodes(engine, out, 40)
        engine.submit(Request([MARK] + [4] * (2 * CHUNK), SamplingParams(temperature=0, max_tokens=4)), out.sink(1))
        assert held.held.wait(60)
        held.release.set()
        assert out.done.wait(120)
        assert out.finished[1].reason == "error" and "RuntimeError" in (out.finished[1].message or "")
        assert out.finished[0].reason == "length" and out.finished[0].completion_tokens == 40
        held.fail = None
        serves_again(engine)
    finally:
        engine.stop()


class ThreadBoundModel(HeldModel):
    """The model, with a prompt piece's logits moved by its thread count (as oneDNN's AMX GEMMs
    move their bits, a little), and the thread count of every piece recorded once `watch` is set."""

    def __init__(self, model):
        super().__init__(model)
        self.watch, self.counts = False, []

    def forward(self, tokens, *args, **kw):
        logits, state = super().forward(tokens, *args, **kw)
        if isinstance(tokens, list) and len(tokens) > 1:
            if self.watch:
                self.counts.append(torch.get_num_threads())
            logits = logits + 1e-3 * torch.get_num_threads()  # (the same greedy token)
        return logits, state

    def prefill(self, tokens, *args, **kw):
        if self.watch and len(tokens) > 1:
            self.counts.append(torch.get_num_threads())
        return super().prefill(tokens, *args, **kw)


def test_where_bits_depend_on_the_thread_count_every_prompt_is_read_on_the_prefill_threads(model_and_tokenizer, capfd):
    """The warm-up finds a piece's logits differ between the prefill thread's count and all
    threads: the worker still runs, and every prompt piece, beside the decode steps or in turns
    with nothing decoding, is read on the prefill thread's count, so no answer depends on the
    load; the answers are each request's alone."""
    model, tok = model_and_tokenizer
    bound = ThreadBoundModel(model)
    engine = started(bound)
    greedy = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=())
    prompts = [[(5 * i + n) % 4000 + 1 for i in range(n)] for n in (90, 7, 150, 40)]
    out = Collect()
    out.expect = len(prompts)
    try:
        threads = torch.get_num_threads() // 2
        assert f"every prompt is read on {threads}" in capfd.readouterr().err
        assert engine._worker is not None
        bound.watch = True
        engine.submit(Request(list(prompts[0]), greedy), out.sink(0))  # alone: read in turns
        assert out.decoding.wait(60)
        for i, ids in enumerate(prompts[1:], 1):  # beside request 0's decode steps
            engine.submit(Request(list(ids), greedy), out.sink(i))
        assert out.done.wait(120)
    finally:
        engine.stop()
    assert bound.counts and set(bound.counts) == {threads}, bound.counts
    for i, ids in enumerate(prompts):
        alone = "".join(rwkv_engine.generate(model, tok, ids, greedy))
        assert "".join(out.texts.get(i, [])) == alone, f"request {i} ({len(ids)} prompt tokens)"


@pytest.mark.parametrize("threads", [0, 2, 5])
def test_no_prefill_thread_when_asked_for_none_or_none_is_left_to_decode(model_and_tokenizer, threads, capfd):
    """--prefill-threads 0: prefill and decode take turns; a count that leaves the decode steps no
    thread (the test process runs two) says so and takes turns too."""
    model, _ = model_and_tokenizer
    engine = started(HeldModel(model), prefill_threads=threads)
    try:
        assert engine._worker is None
    finally:
        engine.stop()
    if threads and torch.get_num_threads() <= threads:
        assert "leaves no thread to decode on" in capfd.readouterr().err


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_prefill_threads_must_be_a_count(bad):
    with pytest.raises(InputError, match="prefill_threads"):
        EngineConfig(prefill_threads=bad)
