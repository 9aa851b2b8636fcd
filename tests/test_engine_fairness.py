"""The engine's turn order (issue 28): a long prompt being prefilled must not hold back short
prompts that arrive after it, and a request that can never fit is refused before it queues.

These drive `Engine` directly on a tiny random model and count model calls, so they assert on
the order of work, not on wall-clock time.
"""

from __future__ import annotations

import threading
import time

import pytest

import rwkv_engine
from rwkv_engine import SamplingParams
from rwkv_engine.serve.engine import Delta, Engine, EngineConfig, Finished, Prompt, Request

CHUNK = 32


@pytest.fixture(scope="module")
def model_and_tokenizer(make_pth):
    model = rwkv_engine.load(make_pth("7", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=5))
    return model, rwkv_engine.load_tokenizer(model)


def wait_ready(engine: Engine, timeout: float = 600) -> None:
    """The warm-up may build the native kernels first (minutes on a fresh machine)."""
    import time

    deadline = time.monotonic() + timeout
    while not engine.ready:
        assert engine.alive and time.monotonic() < deadline
        time.sleep(0.05)


class CountingModel:
    """The model, counting prefill chunks of the long prompt (calls of exactly CHUNK tokens)."""

    def __init__(self, model):
        self._model, self.long_chunks, self.started = model, 0, threading.Event()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _count(self, tokens) -> None:
        if isinstance(tokens, list) and len(tokens) == CHUNK and tokens[0] == 7:
            self.long_chunks += 1
            if self.long_chunks >= 2:
                self.started.set()

    def forward(self, tokens, *args, **kw):
        self._count(tokens)
        return self._model.forward(tokens, *args, **kw)

    def prefill(self, tokens, *args, **kw):  # a piece before the last: no logits wanted
        self._count(tokens)
        return self._model.prefill(tokens, *args, **kw)


def shorts_wait(engine: Engine, tok, counting: CountingModel, timeout: float = 120) -> int:
    """Submit 4 short greedy prompts; how many pieces of the long prompt(s) the last of them
    waited for its first token."""
    greedy = SamplingParams(temperature=0, max_tokens=2, stop_token_ids=())
    first_token_at: dict[int, int] = {}
    done = threading.Event()

    def sink_for(i):
        def sink(e):
            if isinstance(e, Delta | Finished) and i not in first_token_at:
                first_token_at[i] = counting.long_chunks
                if len(first_token_at) == 4:
                    done.set()

        return sink

    submitted_at = counting.long_chunks
    for i in range(4):
        engine.submit(Request(tok.encode(f"Short {i}"), greedy), sink_for(i))
    assert done.wait(timeout)
    return max(first_token_at.values()) - submitted_at


def test_short_prompts_are_not_held_behind_a_long_prefill(model_and_tokenizer):
    """R1: a long prompt is prefilling; short prompts that arrive then get their first token
    within a few chunks of it, not after the whole long prompt."""
    model, tok = model_and_tokenizer
    counting = CountingModel(model)
    engine = Engine(counting, tok, EngineConfig(max_batch=8, prefill_chunk=CHUNK, state_cache_bytes=0))
    engine.start()
    wait_ready(engine)
    greedy = SamplingParams(temperature=0, max_tokens=2, stop_token_ids=())
    long_ids = [7] * (CHUNK * 80)
    try:
        long_handle = engine.submit(Request(long_ids, greedy), lambda e: None)
        assert counting.started.wait(60)
        waited = shorts_wait(engine, tok, counting)
        assert waited <= 3, f"short prompts waited {waited} chunks of the long prompt ({len(long_ids) // CHUNK} in all)"
        long_handle.cancel()
    finally:
        engine.stop()


def test_more_prompts_than_can_ever_fit_are_refused_before_queueing(model_and_tokenizer):
    """R2: 80 prompts at once with --max-batch 8 --max-queue 64 can never all be taken: an
    InputError naming the limit (not QueueFull "64 requests are already waiting", which a client
    retries forever), and nothing of them is queued; a set that fits later is QueueFull, all or none."""
    from rwkv_engine.errors import InputError
    from rwkv_engine.serve.engine import QueueFull

    model, tok = model_and_tokenizer
    engine = Engine(model, tok, EngineConfig(max_batch=8, max_queue=64, state_cache_bytes=0))
    engine.start()
    wait_ready(engine)
    endless = SamplingParams(temperature=0, max_tokens=100000, stop_token_ids=())
    try:
        with pytest.raises(InputError, match=r"80 prompts .* at most 72 .*max batch 8.*max queue 64"):
            engine.submit_all([(Request([1, 2], endless), lambda e: None) for _ in range(80)])
        assert engine.gauges()["requests_waiting"] == 0 and engine.gauges()["requests_running"] == 0
        # 72 fit on an idle server: taken.
        handles = engine.submit_all([(Request([1, 2], endless), lambda e: None) for _ in range(72)])
        # Full now: two more are refused together, and neither is queued.
        with pytest.raises(QueueFull):
            engine.submit_all([(Request([1, 2], endless), lambda e: None) for _ in range(2)])
        for h in handles:
            h.cancel()
        assert engine.gauges()["requests_waiting"] == 0
    finally:
        engine.stop()


def test_a_request_with_more_choices_than_rows_takes_turns(model_and_tokenizer):
    """R2: n=8 with logprobs=20 on a default CPU server (max batch 8) was a 400 "n must be an
    integer from 1 to 4 (half of the server's max batch 8)"; OpenAI accepts n up to 128. Now the
    choices a request may not hold at once (more than half the batch: one request never takes
    every row) take turns: each is answered as it would be alone (choice i with seed + i), while
    another request decodes beside them."""
    from rwkv_engine.errors import InputError

    model, tok = model_and_tokenizer
    config = EngineConfig(max_batch=4, state_cache_bytes=0)
    assert config.rows_per_request == 2 and EngineConfig(max_batch=1).rows_per_request == 1
    engine = Engine(model, tok, config)
    engine.start()
    wait_ready(engine)
    n, prompt = 5, "Once upon a time"  # more choices than the batch has rows
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=4, stop_token_ids=())
    other = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=())
    texts, logprobs, finished, active, most = [""] * n, [[] for _ in range(n)], {}, set(), [0]
    order, done = [], threading.Event()

    def sink(e):
        if isinstance(e, Delta):
            texts[e.index] += e.text
            logprobs[e.index] += e.logprobs
            active.add(e.index)
            most[0] = max(most[0], len(active))
        elif isinstance(e, Finished):
            finished[e.index] = e
            active.discard(e.index)
            if len(finished) == n:
                order.append("many")
                done.set()

    def other_sink(e):
        if isinstance(e, Finished):
            order.append("other")

    try:
        with pytest.raises(InputError, match=r"n must be an integer from 1 to 128"):
            engine.submit(Request(tok.encode(prompt), params, n=129), lambda e: None)
        engine.submit_all(
            [(Request(tok.encode(prompt), params, n=n, logprobs=20), sink), (Request([1, 2], other), other_sink)]
        )
        assert done.wait(120)
    finally:
        engine.stop()
    assert most[0] <= config.rows_per_request  # its choices took turns in at most half the batch
    assert order[0] == "other"  # the other request was not held behind the five choices
    for i in range(n):
        assert finished[i].reason == "length" and finished[i].completion_tokens == 4
        assert len(logprobs[i]) == 4 and all(len(lp.top) == 20 for lp in logprobs[i])
        alone = rwkv_engine.generate(model, tok, prompt, params.replace(seed=7 + i))
        assert texts[i] == alone.read(), i


def test_short_prompts_are_not_held_behind_large_echo_answers(model_and_tokenizer):
    """R3 (the slow-reader soak, --max-batch 4): two echo + logprobs requests (n=2, max_tokens
    0, 6000-token prompts: 5.8 MB answers) held all four batch rows while their prompts were
    read, and four ordinary streams waited about 83 s for their first token. A prompt is now
    read without holding batch rows (a request takes them for its first tokens; an echo with
    max_tokens 0 never does), so the short prompts are read between the long ones' pieces."""
    model, tok = model_and_tokenizer
    counting = CountingModel(model)
    engine = Engine(counting, tok, EngineConfig(max_batch=4, prefill_chunk=CHUNK, state_cache_bytes=0))
    engine.start()
    wait_ready(engine)
    long_ids = [7] * (CHUNK * 24)
    scoring = SamplingParams(temperature=0, max_tokens=0, stop_token_ids=())
    prompts = []

    def echo_sink(e):
        if isinstance(e, Prompt):
            prompts.append(e)

    try:
        for _ in range(2):
            engine.submit(Request(long_ids, scoring, n=2, logprobs=5, echo=True), echo_sink)
        assert counting.started.wait(60)
        waited = shorts_wait(engine, tok, counting, timeout=300)
        assert waited <= 8, f"short prompts waited {waited} pieces of the long prompts (48 in all)"
        deadline = time.monotonic() + 300
        while len(prompts) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.stop()
    assert len(prompts) == 4 and all(len(p.logprobs) == len(long_ids) - 1 for p in prompts)


class SteppedEngine(Engine):
    """The engine with no thread: the test runs its turns itself (`turn`), so what a turn does
    is the same on every run, whatever the machine's load."""

    alive = True

    def turn(self) -> None:
        with self._cond:
            self._drop_cancelled()
            self._admit()
        self._turn()


class PassLog:
    """The model, logging each pass: ("prefill", tokens) for a prompt piece (a list of ids, to
    `forward`, or to `prefill` where its logits are not wanted), ("decode", rows) for a decode
    pass (a tensor [B, 1]); `heads`: the prompt pieces that computed logits (`forward`)."""

    def __init__(self, model):
        self._model, self.log, self.heads = model, [], []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, tokens, *args, **kw):
        if isinstance(tokens, list):
            self.log.append(("prefill", len(tokens)))
            self.heads.append(len(tokens))
        else:
            self.log.append(("decode", tokens.shape[0]))
        return self._model.forward(tokens, *args, **kw)

    def prefill(self, tokens, *args, **kw):
        self.log.append(("prefill", len(tokens)))
        return self._model.prefill(tokens, *args, **kw)

    def forward_into(self, tokens, *args, **kw):  # a decode pass of every row (serve/decode.py)
        self.log.append(("decode", tokens.shape[0]))
        return self._model.forward_into(tokens, *args, **kw)


@pytest.fixture
def one_thread():
    """One torch thread: this tiny model's passes cost more in OpenMP barriers than in work."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_prefill_turns_stay_in_budget_and_decode_runs_between_them(model_and_tokenizer, one_thread):
    """Issue 38 item 2, counted (not timed), on a mixed load: 2 prompts of 20-200 tokens arrive
    every turn while earlier ones decode. Every turn reads at most --prefill-chunk prompt tokens
    (a turn that had spent part of its budget used to start a whole further piece: up to
    2 x chunk + 16 tokens), and every turn that begins with streams decoding ends with their
    decode pass, so a stream waits for at most one chunk of prefill between two of its tokens.
    Cutting pieces to the budget changes no answer: each request gets the text `generate` gives
    it alone."""
    import random

    model, tok = model_and_tokenizer
    chunk, rng = 64, random.Random(38)
    prompts = [[rng.randrange(1, 2000) for _ in range(rng.randint(20, 200))] for _ in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=())
    log = PassLog(model)
    engine = SteppedEngine(log, tok, EngineConfig(max_batch=4, prefill_chunk=chunk, state_cache_bytes=0))
    texts: dict[int, list[str]] = {}
    finished: set[int] = set()

    def sink_for(i):
        def sink(event):
            if isinstance(event, Delta):
                texts.setdefault(i, []).append(event.text)
            elif isinstance(event, Finished):
                finished.add(i)

        return sink

    turns = []  # per turn: (prompt tokens read, streams decoding at its start, its decode passes)
    for t in range(200):
        for i in (2 * t, 2 * t + 1):
            if i < len(prompts):
                engine.submit(Request(list(prompts[i]), greedy), sink_for(i))
        before, decoding = len(log.log), len(engine._batch.rows)
        engine.turn()
        passes = log.log[before:]
        read = sum(n for kind, n in passes if kind == "prefill")
        turns.append((read, decoding, sum(kind == "decode" for kind, _ in passes)))
        if decoding:  # the streams' tokens come after the turn's prefill, not after more turns
            assert passes[-1][0] == "decode", f"turn {t}: {passes}"
        if len(finished) == len(prompts):
            break
    assert len(finished) == len(prompts)
    assert max(read for read, _, _ in turns) <= chunk, f"per turn (read, decoding, passes): {turns}"
    assert sum(read for read, _, _ in turns) == sum(map(len, prompts))
    assert sum(1 for read, decoding, _ in turns if read and decoding) >= 5  # the load was mixed
    for i, ids in enumerate(prompts):
        alone = "".join(rwkv_engine.generate(model, tok, ids, greedy))
        assert "".join(texts.get(i, [])) == alone, f"request {i} ({len(ids)} prompt tokens)"


def test_only_a_prompts_last_piece_computes_logits(model_and_tokenizer, one_thread):
    """A prompt read in pieces computes the output head once, for its last piece: the pieces
    before it go through `prefill` (their logits were computed and thrown away: on a 0.1B model
    6 of a 32-token piece's 48 ms). The answers are unchanged, cold and resumed from the prompt
    cache; an echo request with log-probabilities still reads every piece's logits."""
    model, tok = model_and_tokenizer
    chunk = 64
    ids = [(37 * i) % 2000 + 1 for i in range(5 * chunk + 7)]
    greedy = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=())
    alone = "".join(rwkv_engine.generate(model, tok, ids, greedy))

    def run(request, cache_bytes):
        log = PassLog(model)
        engine = SteppedEngine(log, tok, EngineConfig(max_batch=2, prefill_chunk=chunk, state_cache_bytes=cache_bytes))
        events = []
        engine.submit(request, events.append)
        for _ in range(100):
            engine.turn()
            if any(isinstance(e, Finished) for e in events):
                break
        return log, events, engine

    log, events, engine = run(Request(list(ids), greedy), 1 << 26)
    assert "".join(e.text for e in events if isinstance(e, Delta)) == alone
    pieces = [n for kind, n in log.log if kind == "prefill"]
    assert sum(pieces) == len(ids) and len(pieces) > 1
    assert log.heads == [pieces[-1]], f"pieces {pieces}, with logits {log.heads}"

    # resumed from the cache (the same engine, the same prompt plus a few tokens)
    log2 = PassLog(model)
    engine.model = log2
    more = ids + [5, 6, 7]
    events2 = []
    engine.submit(Request(list(more), greedy), events2.append)
    for _ in range(100):
        engine.turn()
        if any(isinstance(e, Finished) for e in events2):
            break
    assert "".join(e.text for e in events2 if isinstance(e, Delta)) == "".join(
        rwkv_engine.generate(model, tok, more, greedy)
    )
    assert sum(n for kind, n in log2.log if kind == "prefill") < len(more)  # resumed

    echo = Request(list(ids), SamplingParams(temperature=0, max_tokens=1, stop_token_ids=()), logprobs=1, echo=True)
    log3, events3, _ = run(echo, 0)
    pieces3 = [n for kind, n in log3.log if kind == "prefill"]
    assert log3.heads == pieces3 and len(pieces3) > 1


def test_prefill_piece_end_cuts_to_the_budget_on_the_cache_grid():
    """`prefill_piece_end`, every start a prefill reaches, every budget: a piece reads at most the
    budget (or nothing), never crosses a cut of the chunk grid (where the prompt cache keeps
    states), and is longer than GEMV_MAX_ROWS unless it is the whole rest; with the whole chunk
    as the budget it is `prefill_end`'s piece whenever that fits."""
    from rwkv_engine.kernels.native import GEMV_MAX_ROWS
    from rwkv_engine.models.model import prefill_cuts, prefill_end, prefill_piece_end

    chunk = 64
    for total in range(1, 300, 7):
        cuts = set(prefill_cuts(total, chunk))
        for budget in range(1, 100, 5):
            start = 0
            while start < total:
                end = prefill_piece_end(start, total, chunk, budget)
                if end == start:  # nothing fits: the engine's next turn gives a whole chunk
                    end = prefill_piece_end(start, total, chunk, chunk + GEMV_MAX_ROWS)
                else:
                    assert end - start <= budget
                assert end > start and not any(start < c < end for c in cuts), (total, budget, start, end)
                assert end == total or (end - start > GEMV_MAX_ROWS and total - end > GEMV_MAX_ROWS)
                if start % chunk == 0 and prefill_end(start, total, chunk) - start <= budget:
                    assert end == prefill_end(start, total, chunk)
                start = end


class TimedLog(PassLog):
    """PassLog on a fake clock (`now`, seconds) that only the model's work moves: TOKEN seconds
    per prompt token prefilled, STEP seconds per decode pass. (Powers of two: the engine's
    estimates of both are then exact.)"""

    TOKEN, STEP = 2.0**-10, 12 * 2.0**-10

    def __init__(self, model):
        super().__init__(model)
        self.now = 0.0

    def forward(self, tokens, *args, **kw):
        self.now += self.TOKEN * len(tokens) if isinstance(tokens, list) else self.STEP
        return super().forward(tokens, *args, **kw)

    def prefill(self, tokens, *args, **kw):
        self.now += self.TOKEN * len(tokens)
        return super().prefill(tokens, *args, **kw)

    def forward_into(self, tokens, *args, **kw):
        self.now += self.STEP
        return super().forward_into(tokens, *args, **kw)


def mixed_turns(model, tok, config: EngineConfig, prompts, params, log_class=None):
    """Drive a SteppedEngine on a `log_class` (default TimedLog) of `model` through `prompts` (2
    arriving per turn). Returns (per turn: (prompt tokens read, streams decoding at its start, the
    budget gauge after it, prompts waiting for their first token at its start)), texts by
    request, per turn: (its prefill pieces' lengths, the length classes of the pace's cost curve
    measured at its start))."""
    from rwkv_engine.serve.work import InputsPrefill

    log = (log_class or TimedLog)(model)
    engine = SteppedEngine(log, tok, config)
    engine.clock = lambda: log.now
    texts: dict[int, list[str]] = {}
    finished: set[int] = set()

    def sink_for(i):
        def sink(event):
            if isinstance(event, Delta):
                texts.setdefault(i, []).append(event.text)
            elif isinstance(event, Finished):
                finished.add(i)

        return sink

    turns, details = [], []
    for t in range(400):
        measured = len(engine.pace.costs)
        for i in (2 * t, 2 * t + 1):
            if i < len(prompts):
                engine.submit(Request(list(prompts[i]), params), sink_for(i))
        before, decoding = len(log.log), len(engine._batch.rows)
        waiting = sum(not isinstance(w, InputsPrefill) for w in engine._prefilling) + len(engine._waiting)
        engine.turn()
        pieces = [n for kind, n in log.log[before:] if kind == "prefill"]
        turns.append((sum(pieces), decoding, engine.gauges()["prefill_budget_tokens"], waiting))
        details.append((pieces, measured))
        if len(finished) == len(prompts):
            break
    assert len(finished) == len(prompts)
    return turns, {i: "".join(t) for i, t in texts.items()}, details


def test_while_streams_decode_a_turn_prefills_its_share_of_a_decode_step(model_and_tokenizer, one_thread):
    """Issue 38 item 2, the time-aware budget, on a fake clock (so counted, not timed): prompts
    cost TOKEN a token, a decode step STEP. While streams decode, a turn reads at most
    prefill_share x STEP / TOKEN = 48 tokens (a stream waits about 1 + 4 decode steps between
    two tokens, not a whole chunk), times prompts waiting / rows decoding where more prompts
    wait than rows decode; while none decodes, up to the whole chunk of 128. With the share 0
    (the budget off) turns with streams decoding read whole chunks again. Either way every
    request gets the text `generate` gives it alone."""
    import random

    model, tok = model_and_tokenizer
    chunk, share, rng = 128, 4.0, random.Random(39)
    prompts = [[rng.randrange(1, 2000) for _ in range(rng.randint(40, 400))] for _ in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=())
    budget = int(share * TimedLog.STEP / TimedLog.TOKEN)
    assert budget == 48
    config = EngineConfig(max_batch=4, prefill_chunk=chunk, state_cache_bytes=0, prefill_share=share)
    turns, texts, _ = mixed_turns(model, tok, config, prompts, greedy)

    def turn_budget(decoding, waiting):
        return min(chunk, int(budget * max(1.0, waiting / decoding)))

    assert all(read <= turn_budget(d, w) for read, d, _, w in turns if d), turns
    assert sum(1 for read, d, _, w in turns if read and d and w <= d) >= 5  # the load was mixed
    assert sum(1 for read, d, _, w in turns if read and d and w > d) >= 5  # and prompts queued
    assert all(gauge == turn_budget(d, w) for read, d, gauge, w in turns if read and d)
    assert max(read for read, d, _, w in turns if d and w <= d) <= budget
    assert max(read for read, d, _, _ in turns if not d) > budget  # the whole chunk when free
    assert max(read for read, _, _, _ in turns) <= chunk
    assert sum(read for read, _, _, _ in turns) == sum(map(len, prompts))
    off = EngineConfig(max_batch=4, prefill_chunk=chunk, state_cache_bytes=0, prefill_share=0)
    off_turns, off_texts, _ = mixed_turns(model, tok, off, prompts, greedy)
    assert max(read for read, decoding, _, _ in off_turns if decoding) > budget
    assert off_texts == texts
    for i, ids in enumerate(prompts):
        alone = "".join(rwkv_engine.generate(model, tok, ids, greedy))
        assert texts.get(i, "") == alone, f"request {i} ({len(ids)} prompt tokens)"


def test_prefill_pace_budget():
    """`PrefillPace.budget`: the whole chunk while no stream decodes, with the share 0, or before
    both times are measured; else the tokens of share x step seconds (the share times prompts
    waiting / rows decoding where more prompts wait; with one piece length measured, at its
    seconds per token), at least 32 (one WKV chunk, or the chunk if smaller), at most the chunk;
    the estimates follow what is measured."""
    from rwkv_engine.serve.pace import PrefillPace

    pace = PrefillPace(chunk=256, share=1.0, smoothing=0.5)
    assert pace.budget(decoding=True) == 256
    pace.prefilled(100, 0.5)  # 5 ms a token
    assert pace.budget(decoding=True) == 256  # no decode step measured yet
    pace.decoded(0.4)
    assert pace.budget(decoding=True) == 80 and pace.budget(decoding=False) == 256
    pace.decoded(0.2)  # the step estimate moves half way: 0.3 s
    assert pace.budget(decoding=True) == 60
    # prompts waiting weigh as much as rows decoding: 8 prompts, 4 rows: twice the share
    assert pace.budget(decoding=4, prompts=8) == 120 and pace.budget(decoding=4, prompts=3) == 60
    assert pace.budget(decoding=1, prompts=64) == 256  # still at most the chunk
    pace.prefilled(0, 1.0)  # a turn that read nothing measures nothing
    assert pace.budget(decoding=True) == 60
    pace.decoded(0.01)
    pace.decoded(0.01)
    assert pace.budget(decoding=True) == 32  # the floor: one WKV chunk
    pace.decoded(100.0)
    assert pace.budget(decoding=True) == 256  # the ceiling: the chunk
    small = PrefillPace(chunk=16, share=1.0)
    small.prefilled(16, 1.0)
    small.decoded(1e-3)
    assert small.budget(decoding=True) == 16
    off = PrefillPace(chunk=256, share=0.0)
    off.prefilled(100, 0.5)
    off.decoded(1e-3)
    assert off.budget(decoding=True) == 256
    # embedding / rerank jobs alone, nothing decoding: half a chunk a turn (a chat arriving waits
    # for less), at least the floor; with the budget off, the chunk
    assert pace.budget(decoding=False, jobs_only=True) == 128
    assert small.budget(decoding=False, jobs_only=True) == 16
    assert off.budget(decoding=False, jobs_only=True) == 256


def test_piece_costs_are_read_between_the_lengths_measured():
    """`PieceCosts`: a point per length class (WKV chunks) at the averages of its pieces, straight
    lines between the points, the first one going on down to its fixed part, proportional past
    the last (and from (0, 0) while one class is measured); `tokens` inverts it: the longest
    piece that fits, at most `most`."""
    from rwkv_engine.serve.pace import PieceCosts

    costs = PieceCosts(smoothing=0.5)
    assert len(costs) == 0 and costs.tokens(1.0, 256) == 0
    costs.add(32, 0.080)
    assert costs.seconds(16) == pytest.approx(0.040) and costs.tokens(0.1, 256) == 40  # one point: proportional
    costs.add(128, 0.128)  # a fixed part: 0.5 ms a token on 64 ms
    assert len(costs) == 2
    assert costs.seconds(32) == pytest.approx(0.080) and costs.seconds(16) == pytest.approx(0.072)
    assert costs.seconds(0) == pytest.approx(0.064) and costs.seconds(80) == pytest.approx(0.104)
    assert costs.seconds(256) == pytest.approx(0.256)  # past the last: its seconds per token
    assert costs.tokens(0.104, 256) == 80 and costs.tokens(0.2, 256) == 200 and costs.tokens(1.0, 256) == 256
    assert costs.tokens(0.0, 256) == 0 and costs.tokens(0.06, 256) == 0  # less than the fixed part
    costs.add(120, 0.160)  # the same class as 128: its point moves half way, to (124, 0.144)
    assert costs.seconds(124) == pytest.approx(0.144) and len(costs) == 2
    costs.add(0, 1.0)  # nothing read: nothing measured
    assert costs.seconds(124) == pytest.approx(0.144)
    # a class measured cheaper than a shorter one (each point is its own average): the longest
    # length that fits is taken; shorter pieces than the first cost as much as it
    odd = PieceCosts(smoothing=0.5)
    odd.add(64, 0.2)
    odd.add(128, 0.1)
    assert odd.tokens(0.1, 256) == 128 and odd.tokens(0.15, 256) == 192 and odd.seconds(10) == pytest.approx(0.2)


def test_a_queue_of_prompts_is_read_in_pieces_that_are_not_mostly_fixed_cost():
    """While more prompts wait than rows decode, a turn reads at least `PieceCosts.efficient`
    tokens (the shortest length within 1.5x the best seconds a token), and has the time for it,
    however short the decode steps are; with no queue, the step's time decides."""
    from rwkv_engine.serve.pace import PrefillPace

    pace = PrefillPace(chunk=256, share=1.0, smoothing=0.5)
    for n, ms in ((32, 36), (64, 49), (128, 74), (256, 119)):  # the 0.1B shape on a Zen 5
        pace.prefilled(n, ms / 1000)
    assert pace.costs.efficient(256) == 96  # 0.64 ms a token; the best, 0.46 at 256
    pace.decoded(0.010)
    assert pace.budget(decoding=20, prompts=10) == 32  # no queue: a 10 ms step buys the floor
    assert pace.budget(decoding=20, prompts=44) == 96 and pace.turn_seconds == pytest.approx(0.0615)
    assert pace.left(96 - 96, spent=0.06) == 0


def test_the_engine_measures_piece_lengths_up_to_the_chunk_before_serving(model_and_tokenizer):
    """The warm-up times pieces of 32, 64, ... tokens up to --prefill-chunk for the pace's curve,
    so that a server started under a queue of short prompts knows what longer pieces cost."""
    model, tok = model_and_tokenizer
    engine = Engine(model, tok, EngineConfig(max_batch=2, prefill_chunk=128))
    engine.start()
    try:
        wait_ready(engine)
        assert sorted(round(n) for n, _ in engine.pace.costs._points.values()) == [32, 64, 128]
    finally:
        engine.stop()
    off = Engine(model, tok, EngineConfig(max_batch=2, prefill_chunk=128, prefill_share=0))
    off.start()
    try:
        wait_ready(off)
        assert len(off.pace.costs) == 0  # the budget is off: nothing to measure
    finally:
        off.stop()


def test_a_turns_time_buys_longer_pieces_when_a_piece_has_a_fixed_cost():
    """Issue 38: with a fixed cost per piece, 32 tokens a turn is the model's least efficient
    prefill. Pieces measured at 32 tokens (80 ms) and 128 (128 ms), decode steps of 120 ms: the
    turn buys 112 tokens (one seconds-per-token figure from the 32-token pieces bought 48); and a
    turn's later pieces get only the time left (`left`), each paying its fixed part again."""
    from rwkv_engine.serve.pace import PrefillPace

    pace = PrefillPace(chunk=256, share=1.0, smoothing=0.5)
    pace.prefilled(128, 0.128)  # a whole chunk of a prompt read while nothing decoded
    pace.prefilled(32, 0.080)
    pace.decoded(0.120)
    assert pace.budget(decoding=4) == 112
    assert pace.left(112 - 32, spent=0.080) == 0  # 40 ms left: less than a piece's fixed 64 ms
    assert pace.left(112 - 32, spent=0.010) == 80 and pace.left(112 - 32, spent=0.050) == 12
    assert pace.budget(decoding=0) == 256 and pace.left(200, spent=10.0) == 200  # no time limit


class FixedCostLog(TimedLog):
    """TimedLog whose prefill pieces each cost FIXED seconds more (as a forward's many small
    operations do whatever its length)."""

    FIXED = 32 * TimedLog.TOKEN

    def forward(self, tokens, *args, **kw):
        if isinstance(tokens, list):
            self.now += self.FIXED
        return super().forward(tokens, *args, **kw)

    def prefill(self, tokens, *args, **kw):
        self.now += self.FIXED
        return super().prefill(tokens, *args, **kw)


def test_a_turn_with_fixed_piece_costs_keeps_to_its_time(model_and_tokenizer, one_thread, monkeypatch):
    """On a fake clock where a piece costs FIXED + TOKEN a token and a decode step STEP: while
    streams decode (and no more prompts wait than rows decode), a turn's prefill takes at most
    share x STEP, or its one first piece where that alone is longer; some turn reads a piece
    longer than one seconds-per-token figure from 32-token pieces would allow; every request gets
    the text `generate` gives it alone."""
    import random

    monkeypatch.setattr(TimedLog, "STEP", 128 * TimedLog.TOKEN)
    model, tok = model_and_tokenizer
    chunk, share, rng = 128, 1.0, random.Random(41)
    prompts = [[rng.randrange(1, 2000) for _ in range(rng.randint(40, 400))] for _ in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=())
    config = EngineConfig(max_batch=4, prefill_chunk=chunk, state_cache_bytes=0, prefill_share=share)
    turns, texts, details = mixed_turns(model, tok, config, prompts, greedy, log_class=FixedCostLog)
    T, F, step = TimedLog.TOKEN, FixedCostLog.FIXED, TimedLog.STEP
    longest = 0
    for (_, decoding, _, waiting), (pieces, measured) in zip(turns, details):
        # (with one length measured the curve is proportional)
        if decoding and pieces and waiting <= decoding and measured >= 2:
            seconds = sum(F + T * n for n in pieces)
            assert seconds <= max(share * step, F + T * pieces[0]) + 1e-12, (pieces, decoding)
            longest = max(longest, max(pieces))
    # 32-token pieces cost 2 TOKEN a token: share x STEP bought 64 tokens; the curve buys 96
    assert longest > share * step / ((F + 32 * T) / 32), longest
    for i, ids in enumerate(prompts):
        alone = "".join(rwkv_engine.generate(model, tok, ids, greedy))
        assert texts.get(i, "") == alone, f"request {i} ({len(ids)} prompt tokens)"


@pytest.mark.parametrize("share", [-1, float("nan"), float("inf"), "1", True])
def test_prefill_share_must_be_a_number_at_least_0(share):
    from rwkv_engine.errors import InputError

    with pytest.raises(InputError, match="prefill_share"):
        EngineConfig(prefill_share=share)
