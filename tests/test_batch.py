"""`rwkv-engine batch`: a JSONL file of OpenAI requests answered in order, resumable, errors per line.

Answers are compared with `rwkv_engine.generate` run here on the same checkpoint (seeded and
greedy requests give the same tokens batched as alone), and an interrupted run (simulated by
cutting the output file, a partial line included) resumes to the very same file a run without
interruption writes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import rwkv_engine
from rwkv_engine import SamplingParams, testing
from rwkv_engine.chat_format import render_chat

from .conftest import read_body

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

NAME = "tiny-batch"
GREEDY = dict(temperature=0.0, top_p=1.0, presence_penalty=0.0, frequency_penalty=0.0)


def seeded(seed: int) -> dict:
    return dict(temperature=1.0, top_p=0.9, top_k=40, presence_penalty=0.3, frequency_penalty=0.3, seed=seed)


PROMPTS = ["The capital of France is", "Once upon a time", "敏捷的棕色狐狸", "def fib(n):", "1, 2, 3,"]


def request_lines() -> list[str]:
    lines = []
    for i, prompt in enumerate(PROMPTS):
        sampling = GREEDY if i % 2 else seeded(100 + i)
        lines.append(json.dumps({"model": NAME, "prompt": prompt, "max_tokens": 12, **sampling}))
    lines.append(json.dumps({"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 10, **seeded(7)}))
    lines.append(
        json.dumps(
            {
                "custom_id": "openai-batch-line",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": NAME, "prompt": "Hello", "max_tokens": 5, "stream": True, **GREEDY},
            }
        )
    )
    lines.append("{this is not json")
    lines.append(json.dumps({"model": NAME, "prompt": "x", "temperature": -1}))
    lines.append(json.dumps({"model": "another-model", "prompt": "x"}))
    lines.append(json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}))
    return lines


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    sd = testing.random_state_dict("5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=3)
    return testing.save_pth(sd, tmp_path_factory.mktemp("m") / f"{NAME}.pth")


@pytest.fixture(scope="module")
def ref(model_path):
    model = rwkv_engine.load(model_path)
    return model, rwkv_engine.load_tokenizer(model)


def _batch(model_path, inp, out, *flags):
    return subprocess.run(
        [sys.executable, "-m", "rwkv_engine", "batch", str(model_path), str(inp), str(out), "--max-batch", "3", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def first_run(model_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    inp, out = d / "in.jsonl", d / "out.jsonl"
    inp.write_text("\n".join(request_lines()) + "\n", encoding="utf-8")
    run = _batch(model_path, inp, out)
    assert run.returncode == 0, run.stderr[-3000:]
    # N6: batch's own messages (not "rwkv-engine serve: ready"), with its rate and error count
    assert "rwkv-engine serve" not in run.stderr and "rwkv-engine batch: ready" in run.stderr, run.stderr
    assert re.search(r"lines answered \(\d+ ok, \d+ errors, [\d.]+ lines/s\)", run.stderr), run.stderr
    return inp, out, [json.loads(x) for x in out.read_text().splitlines()]


def _generate(ref, prompt, max_tokens, sampling, stop=()):
    model, tok = ref
    params = SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=(0,), penalty_decay=0.996, **sampling)
    gen = rwkv_engine.generate(model, tok, prompt, params)
    gen.read()
    return gen


def test_answers_in_order_and_equal_generate(ref, first_run):
    _, _, answers = first_run
    lines = request_lines()
    assert [a["line"] for a in answers] == list(range(1, len(lines) + 1))
    for i, prompt in enumerate(PROMPTS):
        body = answers[i]["response"]["body"]
        assert answers[i]["error"] is None and answers[i]["response"]["status_code"] == 200
        want = _generate(ref, prompt, 12, GREEDY if i % 2 else seeded(100 + i))
        assert body["choices"][0]["text"] == want.text, prompt
        assert body["model"] == NAME and body["object"] == "text_completion"
    chat = answers[len(PROMPTS)]["response"]["body"]
    want = _generate(ref, render_chat([("user", "Hi there")]), 10, seeded(7), stop=("\n\n",))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == want.text.lstrip(" ")
    batch_line = answers[len(PROMPTS) + 1]
    assert batch_line["custom_id"] == "openai-batch-line"
    assert batch_line["response"]["body"]["choices"][0]["text"] == _generate(ref, "Hello", 5, GREEDY).text


def test_bad_lines_get_an_error_each(first_run):
    _, _, answers = first_run
    n = len(PROMPTS) + 2
    not_json, bad_value, wrong_model, bad_url = answers[n:]
    assert not_json["response"]["status_code"] == 400 and "not JSON" in not_json["error"]["message"]
    # N6: one numbering: the answer's "line" is the number its message names (an editor's, from 1)
    assert f"line {not_json['line']} is not JSON" in not_json["error"]["message"]
    assert bad_value["response"]["status_code"] == 400 and "temperature" in bad_value["error"]["message"]
    assert wrong_model["response"]["status_code"] == 404 and wrong_model["error"]["code"] == "model_not_found"
    assert bad_url["custom_id"] == "bad-url" and bad_url["response"]["status_code"] == 400


def _strip(answer: dict) -> dict:
    """An answer without what differs between two runs of the same requests (ids, timestamps)."""
    body = dict(answer["response"]["body"])
    body.pop("id", None)
    body.pop("created", None)
    return {**answer, "response": {**answer["response"], "body": body}}


def test_resume_after_interruption(model_path, first_run, tmp_path):
    inp, out, answers = first_run
    full = out.read_text().splitlines(keepends=True)
    cut = tmp_path / "out.jsonl"
    cut.write_text("".join(full[:3]) + full[3][: len(full[3]) // 2], encoding="utf-8")  # 3 lines + a partial one
    run = _batch(model_path, inp, cut)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resuming at line 4" in run.stderr
    resumed = [json.loads(x) for x in cut.read_text().splitlines()]
    assert resumed[:3] == answers[:3]  # kept, not redone
    assert [_strip(a) for a in resumed] == [_strip(a) for a in answers]

    again = _batch(model_path, inp, cut)  # all done: nothing to redo
    assert again.returncode == 0 and "nothing to do" in again.stderr
    assert len(cut.read_text().splitlines()) == len(answers)


def test_cli_errors(model_path, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"something": "else"}\n')
    for args, words in (
        ([tmp_path / "missing.jsonl", tmp_path / "o.jsonl"], "no such file"),
        ([inp, inp], "must not be the input"),
        ([inp, foreign], "not this command's answer"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "rwkv_engine", "batch", str(model_path), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode != 0 and words in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_lines_are_split_on_newlines_only(tmp_path):
    """JSON text may hold U+2028 or a form feed raw inside a string: only \\n (or \\r\\n) ends a line."""
    from rwkv_engine.batch import read_lines

    bodies = [{"prompt": "one\u2028two\x0cthree"}, {"prompt": "x"}]
    f = tmp_path / "in.jsonl"
    f.write_bytes(("\r\n".join(json.dumps(b, ensure_ascii=False) for b in bodies) + "\n").encode())
    lines = read_lines(f)
    assert [json.loads(line.text) for line in lines] == bodies and [line.number for line in lines] == [0, 1]


def test_a_line_busy_for_good_gets_an_error_line_not_endless_retries():
    """R2, batch half: a line the server answers 429 on every try was retried forever and held up
    every later line; after a bounded number of 429s it gets its error line and the run goes on."""
    import asyncio

    from rwkv_engine.batch import AppClient, Line

    tries = []

    async def app(scope, receive, send):  # a server always busy for the first prompt, fine for others
        busy = json.loads(await read_body(receive))["prompt"] == "busy"
        tries.append(busy)
        status, payload = (429, {"error": {"message": "busy", "code": "queue_full"}}) if busy else (200, {"ok": 1})
        headers = [(b"content-type", b"application/json"), (b"retry-after", b"0")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})

    lines = [Line(0, json.dumps({"prompt": "busy"})), Line(1, json.dumps({"prompt": "fine"}))]
    out = []
    asyncio.run(asyncio.wait_for(AppClient(app, NAME, busy_retries=5).answer_all(lines, out.append, 2), 30))
    assert [a["line"] for a in out] == [1, 2]
    assert out[0]["response"]["status_code"] == 429 and "gave up after 6 tries" in out[0]["error"]["message"]
    assert out[1]["error"] is None and tries.count(True) == 6
