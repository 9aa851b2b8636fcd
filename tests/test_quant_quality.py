"""Quantization error at model level, on random weights with realistic outliers (heavy-tailed rows/columns).

The logits of a quantized model against fp32 over a prompt and 64 decode steps, both fed the same
tokens. Every matrix is large enough to be quantized (n_embd 512), as in real models.

These bounds guard what the quantizers reach today on this generator's 4-layer model, where bf16
weights alone already move the logits by ~2% (measured, RWKV-5.2 / RWKV-7; the full table comes
from `python benchmarks/bench_quant_quality.py`): q8 (group 32, the default) 0.018 / 0.020
(group 64: 0.020 / 0.022), q4 group 32 0.133 / 0.116, q4 group 128 0.164 / 0.141 (both with the
default policy's 8-bit head and blocks 0-1, which are half of this model's blocks; block 0 only:
0.21 / 0.17; all-int4 blocks: 0.40 / 0.32). The quantization issue's targets, q8 <= 0.03 and
q4/32 <= 0.15, are the bounds (on a 24-layer model the same q4 policy measures 0.39 / 0.25: see
rwkv_engine.quant.schemes).
"""

import pytest
import torch

import rwkv_engine
from rwkv_engine import testing

LIMITS = {("q0bf16", None): 0.03, ("q8", None): 0.03, ("q4", 32): 0.15, ("q4", 128): 0.2}


@pytest.fixture(scope="module", params=["5.2", "7"])
def checkpoint(request, tmp_path_factory):
    sd = testing.random_state_dict(
        request.param, n_layer=4, n_embd=512, vocab_size=4096, head_size=64, seed=3, outliers=True
    )
    return testing.save_pth(sd, tmp_path_factory.mktemp("q") / "m.pth")


@pytest.mark.parametrize("scheme,group", sorted(LIMITS, key=str))
def test_quantized_logits_close_to_fp32(checkpoint, scheme, group):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 4096, (64,), generator=g).tolist()
    ref_model = rwkv_engine.load(checkpoint)
    steps = testing.greedy_tokens(ref_model, prompt, 64)  # the fp32 model's own continuation
    ref = testing.logits_along(ref_model, prompt, steps)
    q = testing.logits_along(rwkv_engine.load(checkpoint, quantization=scheme, group_size=group), prompt, steps)
    err = testing.rel_rms(q, ref)
    assert err <= LIMITS[(scheme, group)], err
    if scheme in ("q0bf16", "q8"):  # greedy tokens over the decode steps (bf16 computes in bf16 too)
        agree = (q[-65:].argmax(-1) == ref[-65:].argmax(-1)).float().mean().item()
        assert agree >= (0.95 if scheme == "q8" else 0.9), agree
