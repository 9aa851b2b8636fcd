"""`rwkv-engine bench` and `rwkv-engine perplexity` as a user runs them (subprocesses)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.kernels import native


def _run(*args):
    return subprocess.run([sys.executable, "-m", "rwkv_engine", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def world_model(tmp_path_factory):
    sd = testing.random_state_dict("5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=11)
    return testing.save_pth(sd, tmp_path_factory.mktemp("w") / "tiny.pth")


def test_bench_json(world_model):
    out = _run(
        "bench",
        str(world_model),
        "--prompt-len",
        "40",
        "--decode-tokens",
        "4",
        "--batch",
        "2",
        "--json",
        "-q",
        "q8",
        "--group-size",
        "32",
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for key in (
        "load_s",
        "prefill_tok_s",
        "decode_tok_s",
        "peak_rss_mb",
        "weight_bytes_per_token",
        "bandwidth_gb_s",
        "memory_read_gb_s",
        "decode_bound_tok_s",
    ):
        assert r[key] > 0, key
    assert r["quantization"] == "q8" and r["batch"] == 2 and r["version"] == "5.2"
    assert r["isa"] == native.isa()  # the ISA level of the native kernels (None: PyTorch paths)
    # the level forced by RWKV_ENGINE_ISA, in the text report too
    lowest = native.supported_levels()[0][0].name if native.isa() else "none"
    env = dict(os.environ, RWKV_ENGINE_ISA=lowest)
    out = subprocess.run(
        [sys.executable, "-m", "rwkv_engine", "bench", str(world_model), "--prompt-len", "8", "--decode-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("native kernels"))
    assert line.split()[2] == (lowest if lowest != "none" else "off"), line


def test_bench_says_when_nothing_was_quantized(tmp_path):
    """R10: bench of q4 on a model whose matrices are all below the policy's size."""
    from rwkv_engine.quant.schemes import NOTHING_QUANTIZED

    small = testing.save_pth(testing.random_state_dict("7", n_layer=1, n_embd=64, vocab_size=256), tmp_path / "s.pth")
    args = ("bench", str(small), "--prompt-len", "8", "--decode-tokens", "2", "-q", "q4")
    out = _run(*args, "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    dense = {"float32": "q0f32", "bfloat16": "q0bf16", "float16": "q0f16"}[r["dtype"]]
    assert r["quantization"] == dense and r["quantization_note"] == NOTHING_QUANTIZED
    assert NOTHING_QUANTIZED in out.stderr
    out = _run(*args)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("model"))
    assert f"quantization {dense} (q4 asked: {NOTHING_QUANTIZED})" in line, line


def test_bench_rejects_bad_values(world_model):
    for args in (("--batch", "0"), ("--prompt-len", "-1"), ("-q", "q3")):
        out = _run("bench", str(world_model), *args)
        assert out.returncode != 0 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, args


def test_perplexity_matches_library(world_model, tmp_path):
    text = "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。\n" * 20
    f = tmp_path / "t.txt"
    f.write_text(text, encoding="utf-8")
    out = _run("perplexity", str(world_model), str(f), "--chunk", "37", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    # independent computation: one forward over everything, log-softmax by hand
    model = rwkv_engine.load(world_model)
    ids = [0] + rwkv_engine.WorldTokenizer().encode(text)
    logits, _ = model.forward(ids[:-1], all_logits=True)
    logp = torch.log_softmax(logits.double(), -1)
    nll = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item()
    assert r["tokens"] == len(ids) - 1
    assert math.isclose(r["perplexity"], math.exp(nll), rel_tol=1e-4)


def test_perplexity_errors(world_model, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00abc")
    out = _run("perplexity", str(world_model), str(bad))
    assert out.returncode != 0 and "not UTF-8" in out.stderr and "Traceback" not in out.stderr
    out = _run("perplexity", str(world_model), str(tmp_path / "missing.txt"))
    assert out.returncode != 0 and "missing.txt" in out.stderr and "Traceback" not in out.stderr
