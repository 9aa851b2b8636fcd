"""Quantization error at model level, on random weights with realistic outliers (heavy-tailed rows/columns).

The logits of a quantized model against fp32 over a prompt and 64 decode steps, both fed the same
tokens. Every matrix is large enough to be quantized (n_embd 512), as in real models.

These bounds guard what the quantizers reach today on this generator's model, where bf16 weights
alone already move the logits by ~2% (measured, RWKV-5.2 / RWKV-7): q8 (group 64) 0.032 / 0.030
(group 128: 0.039 / 0.034), q4 group 32 0.40 / 0.32, q4 group 128 0.49 / 0.38 (without the
per-column scales: q8/128 0.11, q4/32 0.55). The quantization issue's targets are q8 <= 0.03
(met for RWKV-7, 0.032 for RWKV-5.2) and q4/32 <= 0.15 (not met).
"""

import pytest
import torch

import rwkv_engine
from rwkv_engine import testing

from .conftest import rel_rms

LIMITS = {("q0bf16", None): 0.03, ("q8", None): 0.04, ("q4", 32): 0.5, ("q4", 128): 0.6}


@pytest.fixture(scope="module", params=["5.2", "7"])
def checkpoint(request, tmp_path_factory):
    sd = testing.random_state_dict(request.param, n_layer=4, n_embd=512, vocab_size=4096, head_size=64,
                                   seed=3, outliers=True)
    return testing.save_pth(sd, tmp_path_factory.mktemp("q") / "m.pth")


def _run(model, prompt, steps):
    logits, state = model.forward(prompt, all_logits=True)
    out = [logits]
    for t in steps:
        lg, state = model.forward([t], state)
        out.append(lg[None])
    return torch.cat(out)


@pytest.mark.parametrize("scheme,group", sorted(LIMITS, key=str))
def test_quantized_logits_close_to_fp32(checkpoint, scheme, group):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 4096, (64,), generator=g).tolist()
    ref_model = rwkv_engine.load(checkpoint)
    # decode tokens: the fp32 model's own greedy continuation
    _, state = ref_model.forward(prompt)
    steps, lg = [], ref_model.forward(prompt)[0]
    for _ in range(64):
        t = int(lg.argmax())
        steps.append(t)
        lg, state = ref_model.forward([t], state)
    ref = _run(ref_model, prompt, steps)
    q = _run(rwkv_engine.load(checkpoint, quantization=scheme, group_size=group), prompt, steps)
    err = rel_rms(q, ref)
    assert err <= LIMITS[(scheme, group)], err
    if scheme in ("q0bf16", "q8"):
        agree = (q[-65:].argmax(-1) == ref[-65:].argmax(-1)).float().mean().item()
        assert agree >= 0.9, agree
