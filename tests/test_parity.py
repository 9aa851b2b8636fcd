"""Our numbers against independent implementations: the official `rwkv` package and transformers.

Relative RMS error below 1e-4 in fp32 for the logits of every prompt position, every layer's
state after the prompt, and 16 decode steps after it.
"""

import pytest
import torch

import rwkv_engine

from .conftest import rel_rms

PROMPT = [3, 17, 255, 1, 0, 42, 99, 7, 7, 7, 123, 200, 5, 64, 31, 9, 250, 11, 2, 180] * 3  # 60 tokens

# Our state fields in the reference's per-layer list order (docs/formats.md A.9).
PIP_LAYOUT = {
    4: ["att_x_prev", "att_num", "att_den", "att_max", "ffn_x_prev"],
    5: ["att_x_prev", "att_kv", "ffn_x_prev"],
}


@pytest.fixture(scope="module")
def RefRWKV():
    from rwkv.model import RWKV

    return RWKV


def _compare_state(ours, ref_list, family, n_layer):
    fields = PIP_LAYOUT[family]
    for i in range(n_layer):
        for j, name in enumerate(fields):
            a, b = getattr(ours, name)[0, i], ref_list[i * len(fields) + j]
            if name == "att_max":  # a log-scale offset: compare absolutely
                assert (a - b).abs().max() < 1e-4, (i, name)
            else:
                assert rel_rms(a, b) < 1e-4, (i, name)


@pytest.mark.parametrize("version", ["4", "5.0", "5.1", "5.2"])
def test_matches_rwkv_package(version, make_pth, RefRWKV):
    path = make_pth(version)
    ref = RefRWKV(str(path), "cpu fp32", verbose=False)
    model = rwkv_engine.load(path)
    assert model.config.version == version

    ref_logits, ref_state = ref.forward(PROMPT, None, full_output=True)
    logits, state = model.forward(PROMPT, all_logits=True)
    assert logits.shape == ref_logits.shape == (len(PROMPT), model.config.vocab_size)
    assert rel_rms(logits, ref_logits) < 1e-4
    _compare_state(state, ref_state, model.config.family, model.config.n_layer)

    tok = int(ref_logits[-1].argmax())
    for _ in range(16):
        ref_logits, ref_state = ref.forward([tok], ref_state)
        logits, state = model.forward([tok], state)
        assert rel_rms(logits, ref_logits) < 1e-4
        tok = int(ref_logits.argmax())
    _compare_state(state, ref_state, model.config.family, model.config.n_layer)


def test_matches_transformers_rwkv4(tmp_path):
    """A transformers RwkvForCausalLM saved with save_pretrained loads here and gives its logits and state."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.RwkvConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=3,
        context_length=256,
        intermediate_size=256,
        attention_hidden_size=64,
        rescale_every=0,
    )
    torch.manual_seed(0)
    hf = transformers.RwkvForCausalLM(cfg).eval()
    with torch.no_grad():  # its init leaves some tensors constant; give every parameter real values
        for name, p in hf.named_parameters():
            if "time_mix" in name:
                p.uniform_(0, 1)
            elif "time_decay" in name:
                p.uniform_(-5, 1)
            elif p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            else:
                p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    model = rwkv_engine.load(tmp_path)
    assert model.config.version == "4" and model.config.n_layer == 3

    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = hf(ids, use_cache=True)
    logits, state = model.forward(ids, all_logits=True)
    assert rel_rms(logits, out.logits) < 1e-4
    # transformers' state: [ffn x, att x, num, den, max], each [B, hidden, L]
    hf_state = out.state
    for ours, theirs in (("ffn_x_prev", 0), ("att_x_prev", 1), ("att_num", 2), ("att_den", 3)):
        assert rel_rms(getattr(state, ours)[0], hf_state[theirs][0].T) < 1e-4, ours
    assert (state.att_max[0] - hf_state[4][0].T).abs().max() < 1e-4
