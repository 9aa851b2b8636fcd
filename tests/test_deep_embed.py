"""RWKV-7a (DeepEmbed) against the `rwkv` package (0.8.32, RWKV_DE_VERSION=1), as a .pth and
through `convert`; RWKV-7b (DEA) refused."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.errors import UnsupportedModelError

PROMPT = [5, 17, 200, 3, 99, 41, 7]
NEXT = [12, 250]

_REFERENCE = textwrap.dedent(
    """
    import os, sys
    os.environ["RWKV_V7_ON"] = "1"
    os.environ["RWKV_DE_VERSION"] = "1"
    os.environ["RWKV_CUDA_ON"] = "0"
    import torch
    torch.set_num_threads(1)
    from rwkv.model import RWKV
    prompt, nxt = eval(sys.argv[3]), eval(sys.argv[4])
    ref = RWKV(sys.argv[1][: -len(".pth")], "cpu fp32")
    out = []
    logits, state = ref.forward(prompt, None)
    out.append(logits.clone())
    for t in nxt:  # one token at a time: its forward_one
        logits, state = ref.forward([t], state)
        out.append(logits.clone())
    torch.save(torch.stack(out), sys.argv[2])
    """
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("de")
    sd = testing.random_state_dict("7", n_layer=2, n_embd=64, vocab_size=256, head_size=16, seed=8, deep_embed=True)
    path = testing.save_pth(sd, d / "rwkv7a.pth")
    out = d / "ref.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _REFERENCE, str(path), str(out), repr(PROMPT), repr(NEXT)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RWKV_V7_ON": "1", "RWKV_DE_VERSION": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path, torch.load(out), d


def _ours(model):
    logits, state = model.forward(PROMPT)
    out = [logits]
    for t in NEXT:
        logits, state = model.forward([t], state)
        out.append(logits)
    return torch.stack(out)


def test_deep_embed_matches_rwkv_package(checkpoint, capsys):
    path, want, _ = checkpoint
    model = rwkv_engine.load(path, dtype="fp32")
    assert model.config.deep_embed
    assert model.config.state_signature().startswith("rwkv-7a:")
    got = _ours(model)
    assert testing.rel_rms(got, want) < 1e-4
    # without the tables it is another model: the test can fail
    plain = {k: v for k, v in torch.load(path).items() if ".ffn.s" not in k}
    other = rwkv_engine.load(testing.save_pth(plain, checkpoint[2] / "plain.pth"), dtype="fp32")
    assert testing.rel_rms(_ours(other), want) > 1e-2
    assert "no fused native decode step" in capsys.readouterr().err or not model.native_decode


def test_deep_embed_decode_paths(checkpoint):
    """The one-token step through the decode-graph runner (CUDA's, run eagerly here) and through
    the PyTorch modules give the reference's logits too."""
    path, want, _ = checkpoint
    model = rwkv_engine.load(path, dtype="fp32")
    model.graph_decode = True
    assert testing.rel_rms(_ours(model), want) < 1e-4
    model.graph_decode, model.native_decode = False, False
    assert testing.rel_rms(_ours(model), want) < 1e-4


def test_deep_embed_through_convert_and_quantized(checkpoint, tmp_path):
    path, want, _ = checkpoint
    r = subprocess.run(
        [sys.executable, "-m", "rwkv_engine", "convert", str(path), str(tmp_path / "out"), "-q", "q0f32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    conv = rwkv_engine.load(tmp_path / "out")
    assert conv.config.deep_embed
    assert testing.rel_rms(_ours(conv), want) < 1e-4
    q8 = rwkv_engine.load(path, quantization="q8", dtype="bf16", policy={"*": "q8"})
    table = q8.get_submodule("blocks.1.ffn.s_emb").weight
    assert table.dtype == torch.bfloat16  # the per-token tables stay 16-bit
    assert testing.rel_rms(_ours(q8), want) < 0.1


def test_rwkv7b_refused(tmp_path):
    sd = testing.random_state_dict("7", n_layer=2, n_embd=64, vocab_size=256, head_size=16, deep_embed=True)
    sd["blocks.0.qkv.k_emb.weight"] = torch.zeros(256, 256)
    with pytest.raises(UnsupportedModelError, match="RWKV-7b.*DEA"):
        rwkv_engine.load(testing.save_pth(sd, tmp_path / "rwkv7b.pth"))
