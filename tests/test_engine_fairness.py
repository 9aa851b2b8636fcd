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
