"""State-tuned RWKV-7 checkpoints: blocks.{i}.att.time_state becomes the model's initial state.

The file tensor [H, N, N] is [value][key] (the `rwkv` pip package's RWKV-7 state layout, the one
RWKV-PEFT trains and web-rwkv reads; sources in loading.transforms.initial_state); our att_kv is
[key][value], so the model starts from time_state.transpose(1, 2). Random time_state tensors are
not symmetric, so every check below fails if the transpose is dropped.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rwkv_engine
from rwkv_engine import State, testing
from rwkv_engine.errors import CheckpointError
from rwkv_engine.kernels import native
from rwkv_engine.loading import converted

from .conftest import rel_rms

SIZES = dict(n_layer=2, n_embd=64, vocab_size=300, head_size=16)  # H = 4, N = 16
PROMPT = [3, 17, 255, 1, 0, 42, 99, 7, 123, 200, 5, 64, 31, 9, 250, 11, 2, 180]
STEPS = 8


def _names(n_layer=SIZES["n_layer"]):
    return [f"blocks.{i}.att.time_state" for i in range(n_layer)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(tuned state dict, tuned .pth, the same weights without time_state as .pth)."""
    d = tmp_path_factory.mktemp("ts7")
    sd = testing.random_state_dict("7", **SIZES, seed=21, time_state=True)
    for n in _names():
        assert not torch.allclose(sd[n], sd[n].transpose(1, 2))  # the layout is observable
    plain = {k: v for k, v in sd.items() if not k.endswith(".att.time_state")}
    return sd, testing.save_pth(sd, d / "tuned.pth"), testing.save_pth(plain, d / "plain.pth")


def _kv(sd, transpose=True):
    """[L, H, N, N] of the file's time_state tensors, in our [key][value] layout unless transpose=False."""
    return torch.stack([sd[n].transpose(1, 2) if transpose else sd[n] for n in _names()])


def _state(model, att_kv, batch_size=1):
    """A State of `model` holding att_kv [L, H, N, N] in every row and zero token-shift fields."""
    fresh = model.new_state(batch_size)
    tensors = {k: torch.zeros_like(v) for k, v in fresh.items()}
    tensors["att_kv"] = att_kv.expand_as(tensors["att_kv"]).clone()
    return State(tensors, fresh.signature)


def _run(model, state=None):
    """Logits of the whole prompt, then STEPS one-token forwards (greedy), and the final state."""
    logits, state = model.forward(PROMPT, state, all_logits=True)
    out = [logits]
    tok = int(logits[-1].argmax())
    for _ in range(STEPS):
        logits, state = model.forward([tok], state)
        out.append(logits[None])
        tok = int(logits.argmax())
    return torch.cat(out), state


def test_initial_state_is_the_transposed_time_state(files):
    sd, tuned, _ = files
    for path in (tuned, testing.save_safetensors(sd, tuned.with_suffix(".safetensors"))):
        model = rwkv_engine.load(path)
        assert model.config.version == "7"
        fresh = model.new_state(3)
        for row in range(3):
            assert torch.equal(fresh.att_kv[row], _kv(sd))
        assert not fresh.att_x_prev.any() and not fresh.ffn_x_prev.any()
    # bf16 files: the tensor is read exactly, as fp32
    bf = testing.cast(sd, torch.bfloat16)
    model = rwkv_engine.load(testing.save_pth(bf, tuned.with_name("bf16.pth")))
    assert torch.equal(model.new_state().att_kv[0], _kv(bf).float())


def test_tuned_model_is_the_plain_model_started_from_the_state(files):
    sd, tuned, plain = files
    t, p = rwkv_engine.load(tuned), rwkv_engine.load(plain)
    assert p.initial_state == {}
    got, got_state = _run(t)
    want, want_state = _run(p, _state(p, _kv(sd)))
    assert torch.equal(got, want) and got_state.allclose(want_state, 0, 0)
    # the layout matters: the untransposed tensor, or a zero state, give other logits
    wrong, _ = _run(p, _state(p, _kv(sd, transpose=False)))
    zero, _ = _run(p)
    assert rel_rms(wrong, got) > 1e-2 and rel_rms(zero, got) > 1e-2


_PIP_V7 = textwrap.dedent(
    """
    import os, sys
    os.environ["RWKV_V7_ON"] = "1"
    os.environ["RWKV_CUDA_ON"] = "0"
    import torch
    torch.set_num_threads(1)
    from rwkv.model import RWKV
    path, out, n_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompt = [int(t) for t in sys.argv[4:]]
    ref = RWKV(path[: -len(".pth")], "cpu fp32")  # it appends .pth; it ignores time_state tensors
    raw = torch.load(path)
    state = ref.generate_zero_state()
    for i in range(ref.n_layer):  # the file tensor as is: the pip's RWKV-7 state is [value][key] too
        state[i * 3 + 1] = raw[f"blocks.{i}.att.time_state"].float().clone()
    logits, state = ref.forward(prompt, state, full_output=True)
    res = [logits.clone()]
    tok = int(logits[-1].argmax())
    for _ in range(n_steps):
        logits, state = ref.forward([tok], state)
        res.append(logits[None].clone())
        tok = int(logits.argmax())
    torch.save({"logits": torch.cat(res), "att_kv": [state[i * 3 + 1].clone() for i in range(ref.n_layer)]}, out)
    """
)


def test_rwkv_package_started_from_the_file_tensor(files, tmp_path):
    """The pip package's RWKV-7, its [value][key] state seeded with the raw time_state, gives our logits."""
    sd, tuned, _ = files
    out = tmp_path / "ref.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _PIP_V7, str(tuned), str(out), str(STEPS), *map(str, PROMPT)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RWKV_V7_ON": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = torch.load(out)
    got, state = _run(rwkv_engine.load(tuned))
    assert rel_rms(got, ref["logits"]) < 1e-4
    for i, kv in enumerate(ref["att_kv"]):
        assert rel_rms(state.att_kv[0, i], kv.transpose(-1, -2)) < 1e-4, i


@pytest.mark.parametrize("quantization", [None, "q8"], ids=["fp32", "q8"])
def test_quantized_and_native_decode(files, quantization):
    """The tuned start survives quantized loading, and one-token steps (the fused native step
    where it builds) from the default state equal the plain model's from the explicit state."""
    sd, tuned, plain = files
    t = rwkv_engine.load(tuned, quantization=quantization)
    p = rwkv_engine.load(plain, quantization=quantization)
    assert torch.equal(t.new_state().att_kv[0], _kv(sd))
    for model in (t, p):
        assert model.native_decode
    tok, st_t, st_p = 42, t.new_state(2), _state(p, _kv(sd), 2)
    for _ in range(STEPS):
        ids = torch.tensor([[tok], [tok]])
        a, st_t = t.forward(ids, st_t)
        b, st_p = p.forward(ids, st_p)
        assert torch.equal(a, b) and st_t.allclose(st_p, 0, 0)
        tok = int(a[0].argmax())
    if native.load() is not None:
        assert t._native_step[1] is not None and p._native_step[1] is not None, "the native step was not used"
    # the native step and the PyTorch modules agree from the tuned start
    t.native_decode = False
    c, _ = t.forward([7], t.new_state())
    t.native_decode = True
    d, _ = t.forward([7], t.new_state())
    assert rel_rms(c, d) < (1e-5 if quantization is None else 1e-3)


def test_converted_directory_keeps_the_initial_state(files, tmp_path):
    sd, tuned, _ = files
    model = rwkv_engine.load(tuned, quantization="q8")
    back = rwkv_engine.load(converted.save(model, tmp_path / "conv"))
    assert torch.equal(back.new_state().att_kv[0], _kv(sd))
    assert torch.equal(back.forward(PROMPT)[0], model.forward(PROMPT)[0])


def test_bad_time_state(files, tmp_path):
    sd, _, _ = files

    def load(d, name):
        return rwkv_engine.load(testing.save_pth(d, tmp_path / name))

    partial = dict(sd)
    del partial["blocks.1.att.time_state"]
    with pytest.raises(CheckpointError, match=r"time_state is missing in blocks \[1\]"):
        load(partial, "partial.pth")
    H, N = 4, 16
    for shape in ((H, N, N + 1), (N, H, N), (H * N, N), (2, H, N, N)):
        bad = dict(sd, **{"blocks.0.att.time_state": torch.zeros(shape)})
        with pytest.raises(CheckpointError, match=r"blocks\.0\.att\.time_state has shape .*expected \(4, 16, 16\)"):
            load(bad, "shape.pth")
    # a leading unit axis is only a batch of one
    one = dict(sd, **{n: sd[n][None] for n in _names()})
    assert torch.equal(load(one, "one.pth").new_state().att_kv[0], _kv(sd))
    # a state-only file (what state tuning saves) is not a model
    only = {n: sd[n] for n in _names()}
    with pytest.raises(CheckpointError, match="state-only file"):
        load(only, "state-only.pth")


def test_random_state_dict_time_state_versions():
    sd = testing.random_state_dict("7", **SIZES, time_state=True)
    assert [sd[n].shape for n in _names()] == [(4, 16, 16)] * 2
    with pytest.raises(ValueError, match="RWKV-6 and RWKV-7 only"):
        testing.random_state_dict("5.2", **SIZES, time_state=True)
