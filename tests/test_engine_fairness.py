"""The engine's turn order (issue 28): a long prompt being prefilled must not hold back short
prompts that arrive after it, and a request that can never fit is refused before it queues.

These drive `Engine` directly on a tiny random model and count model calls, so they assert on
the order of work, not on wall-clock time.
"""

from __future__ import annotations

import threading

import pytest

import rwkv_engine
from rwkv_engine import SamplingParams
from rwkv_engine.serve.engine import Delta, Engine, EngineConfig, Finished, Request
from rwkv_engine.testing import random_state_dict, save_pth

CHUNK = 32


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("fair")
    path = save_pth(
        random_state_dict(version="7", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=5), d / "m.pth"
    )
    model = rwkv_engine.load(path)
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

    def forward(self, tokens, *args, **kw):
        if isinstance(tokens, list) and len(tokens) == CHUNK and tokens[0] == 7:
            self.long_chunks += 1
            if self.long_chunks >= 2:
                self.started.set()
        return self._model.forward(tokens, *args, **kw)


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
    first_token_at: dict[int, int] = {}
    done = threading.Event()
    try:
        long_handle = engine.submit(Request(long_ids, greedy), lambda e: None)
        assert counting.started.wait(60)

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
        assert done.wait(120)
        waited = max(first_token_at.values()) - submitted_at
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


def test_one_request_takes_at_most_half_the_batch(model_and_tokenizer):
    """Smaller item: with n equal to --max-batch one request held every slot; n is capped at half."""
    from rwkv_engine.errors import InputError

    model, tok = model_and_tokenizer
    engine = Engine(model, tok, EngineConfig(max_batch=8, state_cache_bytes=0))
    engine.start()
    wait_ready(engine)
    params = SamplingParams(temperature=0, max_tokens=1, stop_token_ids=())
    try:
        with pytest.raises(InputError, match=r"n must be an integer from 1 to 4 \(half of the server's max batch 8\)"):
            engine.submit(Request([1, 2], params, n=8), lambda e: None)
        done = threading.Event()
        engine.submit(Request([1, 2], params, n=4), lambda e: done.set() if isinstance(e, Finished) else None)
        assert done.wait(60)
    finally:
        engine.stop()
    assert Engine(model, tok, EngineConfig(max_batch=1)).max_choices == 1
