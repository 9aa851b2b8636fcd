"""`rwkv-engine eval` and the lm_eval model class, offline, on local task YAMLs.

Three tiny tasks of our own (JSON data, `dataset_path: json`): a multiple-choice one
(loglikelihood), a generate_until one and a rolling-perplexity one. The scores lm_eval receives are
compared with log-softmaxes of `model.forward` over the whole text, computed here by hand, and the
generations with `rwkv_engine.generate`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import rwkv_engine
from rwkv_engine import SamplingParams, generate, testing

pytest.importorskip("lm_eval")

from rwkv_engine.evaluation import RWKVEngineLM, evaluate  # noqa: E402

MC = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " a small town by the sea"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "天空的颜色是", "choices": ["蓝色", "绿色", "红色的，很少见"], "answer": 0},
]
GEN = [{"prompt": "Q: Say hi.\nA:", "target": " hi"}, {"prompt": "Once upon a time", "target": " there"}]
DOCS = [{"text": "The quick brown fox jumps over the lazy dog. " * 30}, {"text": "敏捷的棕色狐狸跳过了懒狗。"}]

TASKS = {
    "rwkvtest_mc": """task: rwkvtest_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "rwkvtest_gen": """task: rwkvtest_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "rwkvtest_ppl": """task: rwkvtest_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/docs.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    for name, rows in (("mc", MC), ("gen", GEN), ("docs", DOCS)):
        (d / f"{name}.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )
    for name, text in TASKS.items():
        (d / f"{name}.yaml").write_text(text.format(dir=d), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    sd = testing.random_state_dict("5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=5)
    return testing.save_pth(sd, tmp_path_factory.mktemp("m") / "tiny.pth")


@pytest.fixture(scope="module")
def lm(model_path):
    model = rwkv_engine.load(model_path)
    return RWKVEngineLM(model, rwkv_engine.load_tokenizer(model), batch_size=2)


@pytest.fixture(scope="module")
def results(lm, task_dir):
    return evaluate(lm, list(TASKS), include_path=str(task_dir), log_samples=True)


def _logp_sum(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """By hand: one forward over context + continuation, log-softmax in float64."""
    ids = context + continuation
    logits, _ = model.forward(ids[:-1], all_logits=True)
    logp = torch.log_softmax(logits.double(), -1)[len(context) - 1 :]
    target = torch.tensor(continuation)
    greedy = bool((logits[len(context) - 1 :].argmax(-1) == target).all())
    return logp[torch.arange(len(continuation)), target].sum().item(), greedy


def test_multiple_choice_scores_equal_forward(lm, results):
    samples = results["samples"]["rwkvtest_mc"]
    assert len(samples) == len(MC)
    for s in samples:
        assert len(s["arguments"]) == len(s["doc"]["choices"])
        for (ll, greedy), (context, continuation) in zip([r[0] for r in s["resps"]], s["arguments"]):
            ctx, cont = lm._encode_pair(context, continuation)
            want, want_greedy = _logp_sum(lm.model, ctx, cont)
            assert math.isclose(ll, want, rel_tol=1e-4, abs_tol=1e-4), (context, continuation, ll, want)
            assert greedy == want_greedy
    assert 0.0 <= results["results"]["rwkvtest_mc"]["acc,none"] <= 1.0


def test_rolling_scores_equal_forward(lm, results):
    samples = results["samples"]["rwkvtest_ppl"]
    assert len(samples) == len(DOCS)
    for s in samples:
        ids = lm.tok_encode(s["doc"]["text"])
        want, _ = _logp_sum(lm.model, [0], ids)
        got = s["resps"][0][0]
        assert math.isclose(got, want, rel_tol=1e-4), (got, want)
    assert results["results"]["rwkvtest_ppl"]["word_perplexity,none"] > 1


def test_generate_until_equals_generate(lm, results):
    samples = results["samples"]["rwkvtest_gen"]
    assert len(samples) == len(GEN)
    for s in samples:
        gen = generate(
            lm.model, lm.tokenizer, s["doc"]["prompt"], SamplingParams(temperature=0, max_tokens=6, stop=("\n",))
        )
        want = "".join(gen)
        assert s["resps"][0][0] == want


def test_chat_template(lm, task_dir):
    """With a chat template lm_eval renders each prompt as a chat (here the G1 one, thinking off,
    checked against rwkv-tl's template), and the answer is what follows "<think></think" and its ">"."""
    from rwkv_engine.templates import builtin

    from .test_templates import render_rwkv_tl

    chat = RWKVEngineLM(lm.model, lm.tokenizer, batch_size=2, chat_template=builtin("g1"))
    results = evaluate(chat, ["rwkvtest_gen"], include_path=str(task_dir), log_samples=True)
    for s in results["samples"]["rwkvtest_gen"]:
        context = s["arguments"][0][0]
        assert context == render_rwkv_tl([{"role": "user", "content": s["doc"]["prompt"]}])
        gen = generate(lm.model, lm.tokenizer, context, SamplingParams(temperature=0, max_tokens=6, stop=("\n",)))
        assert s["resps"][0][0] == "".join(gen).removeprefix(">").lstrip()
    assert chat.chat_template() == builtin("g1").text


def test_long_document_runs_in_pieces(lm):
    """A document longer than a scoring piece gives the one-forward sum (state carried across)."""
    from rwkv_engine import evaluation

    ids = lm.tok_encode("RWKV is an RNN with transformer-level performance. " * 60)
    assert len(ids) > evaluation.ROLLING_PIECE
    got = lm.loglikelihood_rolling([_Req((lm.tok_decode(ids),))], disable_tqdm=True)[0]
    want, _ = _logp_sum(lm.model, [0], ids)
    assert math.isclose(got, want, rel_tol=1e-4)


class _Req:
    def __init__(self, args):
        self.args = args


def test_cli_eval(model_path, task_dir, tmp_path):
    out_json = tmp_path / "r.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rwkv_engine",
            "eval",
            str(model_path),
            "--tasks",
            "rwkvtest_mc",
            "--include-path",
            str(task_dir),
            "--output-path",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rwkvtest_mc" in run.stdout and "acc" in run.stdout  # lm_eval's table
    saved = json.loads(out_json.read_text())
    assert "acc,none" in saved["results"]["rwkvtest_mc"] and "samples" not in saved


def test_cli_eval_errors(model_path, task_dir):
    for args, words in (
        (["--tasks", "no_such_task_xyz", "--include-path", str(task_dir)], "unknown lm_eval task"),
        (["--tasks", "rwkvtest_mc", "--include-path", str(task_dir / "nope")], "not a directory"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "rwkv_engine", "eval", str(model_path), *args],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode != 0 and words in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
