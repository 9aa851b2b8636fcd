"""Server-sent events when a client reads slower than tokens come (issue 38 item 3): the Deltas
waiting together go out as one event per choice, and what the client reads, joined, is what
the one-event-per-token stream gives (text, log-probabilities in order, usage)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from rwkv_engine.serve import protocol as p
from rwkv_engine.serve.jobs import Burst, Job, coalesce, stream_events
from rwkv_engine.serve.logprobs import TokenLogprob, TokenText
from rwkv_engine.serve.messages import Delta, Finished
from rwkv_engine.serve.serving_chat import ChatOutput
from rwkv_engine.serve.serving_completion import CompletionOutput
from rwkv_engine.tokenizer import WorldTokenizer

TOKENIZER = WorldTokenizer()


def _ctx():
    return SimpleNamespace(tokenizer=TOKENIZER, token_text=TokenText(TOKENIZER), model_name="m", template=None)


def _deltas(text: str, index: int = 0) -> list[Delta]:
    """One Delta per token of `text`, each with its (made-up) log-probability and one alternative."""
    ids = TOKENIZER.encode(text)
    return [
        Delta(TOKENIZER.decode([t]), index, (TokenLogprob(t, -0.1 * (k + 1), ((t, -0.1 * (k + 1)),)),), k + 1)
        for k, t in enumerate(ids)
    ]


async def _stream(make_output, events: list, slow: bool) -> list[dict]:
    """The SSE data objects a client reads. slow: every event is queued before the first is read
    (a client that fell behind); else each is read before the next arrives."""
    job = Job(asyncio.get_running_loop())
    job.choices = 1 + max(e.index for e in events)
    out = make_output()
    gen = stream_events(job, out.on_event, usage_chunk=out.usage_chunk)
    if slow:
        for e in events:
            job.queue.put_nowait(e)
        chunks = [c async for c in gen]
    else:

        async def read() -> list[str]:
            return [c async for c in gen]

        reader = asyncio.create_task(read())
        for e in events:
            job.queue.put_nowait(e)
            for _ in range(5):  # the reader takes it (and waits for the next) before the next comes
                await asyncio.sleep(0)
            assert job.queue.empty()
        chunks = await reader
    data = [part[len("data: ") :] for c in chunks for part in c.split("\n\n") if part]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _finished(n: int, index: int = 0) -> Finished:
    return Finished("length", 3, n, 0, index=index)


def test_coalesce_joins_each_choices_deltas_and_keeps_their_order():
    a, b = _deltas("one two three", 0), _deltas("four five", 1)
    events = [a[0], b[0], a[1], _finished(2, 1), b[1], a[2]]
    got = coalesce(events)
    assert [type(e).__name__ for e in got] == ["Burst", "Delta", "Finished", "Delta"]
    assert got[0].deltas == (a[0], a[1], a[2]) and got[0].text == "".join(d.text for d in a[:3])
    assert got[0].logprobs == a[0].logprobs + a[1].logprobs + a[2].logprobs and got[0].generated == 3
    assert got[1] is b[0] and got[3] is b[1]  # choice 1's Delta after its Finished is not joined to it


def test_a_slow_completion_client_gets_the_tokens_in_one_event():
    deltas = _deltas("The quick brown fox jumps over the lazy dog")
    events = [*deltas, _finished(len(deltas))]
    req = p.CompletionRequest(prompt=["x"], stream=True, logprobs=1)

    def output():
        return CompletionOutput(_ctx(), req, [[1, 2, 3]], 1, 1)

    fast = asyncio.run(_stream(output, events, slow=False))
    slow = asyncio.run(_stream(output, events, slow=True))
    # one event for all the text; then the finish and the usage
    assert len(fast) == len(deltas) + 2 and len(slow) == 3
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        joined = [v for c in fast[:-2] for v in c["choices"][0]["logprobs"][key]]
        assert slow[0]["choices"][0]["logprobs"][key] == joined
    assert slow[0]["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in fast[:-2])
    assert slow[0]["choices"][0]["logprobs"]["tokens"] == [
        TOKENIZER.decode([t]) for t in TOKENIZER.encode("The quick brown fox jumps over the lazy dog")
    ]
    assert slow[-2]["choices"][0]["finish_reason"] == fast[-2]["choices"][0]["finish_reason"] == "length"
    assert slow[-1]["usage"] == fast[-1]["usage"]


def _chat(fast: list[dict]) -> tuple[str, str, list]:
    delta = [c["choices"][0]["delta"] for c in fast if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in delta)
    content = "".join(d.get("content") or "" for d in delta)
    logprobs = [
        lp
        for c in fast
        if c["choices"] and c["choices"][0].get("logprobs")
        for lp in c["choices"][0]["logprobs"]["content"]
    ]
    return reasoning, content, logprobs


def test_a_slow_chat_client_gets_thought_and_answer_joined_with_the_same_usage():
    text = "<think>Let me see, two and two.</think> It is four, of course."
    deltas = _deltas(text)
    events = [*deltas, _finished(len(deltas))]
    req = p.ChatCompletionRequest(
        messages=[{"role": "user", "content": "2+2?"}],
        stream=True,
        logprobs=True,
        top_logprobs=1,
        stream_options={"include_usage": True},
    )

    def output():
        return ChatOutput(_ctx(), req, 1, "detect")

    fast = asyncio.run(_stream(output, events, slow=False))
    slow = asyncio.run(_stream(output, events, slow=True))
    assert len(fast) > 15 and len(slow) == 5
    kinds = [next(iter(c["choices"][0]["delta"])) for c in slow if c["choices"] and c["choices"][0]["delta"]]
    # the log-probabilities of the opening tag (no text), one event for the thought, one for the answer
    assert kinds == ["content", "reasoning_content", "content"]
    assert _chat(slow) == _chat(fast)
    reasoning, content, logprobs = _chat(fast)
    assert reasoning == "Let me see, two and two." and content.strip() == "It is four, of course."
    assert len(logprobs) > 5
    assert slow[-1]["usage"] == fast[-1]["usage"]  # reasoning tokens counted Delta by Delta as before
    assert slow[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 5


def test_bursts_of_two_choices_stay_apart():
    a, b = _deltas("alpha beta gamma", 0), _deltas("delta epsilon", 1)
    events = [x for pair in zip(a, b) for x in pair] + a[len(b) :] + [_finished(len(a), 0), _finished(len(b), 1)]
    req = p.CompletionRequest(prompt=["x"], stream=True, n=2)

    def output():
        return CompletionOutput(_ctx(), req, [[1, 2, 3]], 2, 2)

    slow = asyncio.run(_stream(output, events, slow=True))
    texts = {
        c["choices"][0]["index"]: c["choices"][0]["text"] for c in slow if c["choices"] and c["choices"][0]["text"]
    }
    assert texts == {0: "alpha beta gamma", 1: "delta epsilon"}
    assert isinstance(coalesce(events)[0], Burst)
