"""RWKV-6 and RWKV-7 against the official `rwkv` package, and their forward semantics.

Parity: relative RMS error below 1e-4 in fp32 for the logits of every prompt position, every
layer's state after the prompt, and 16 greedy decode steps after it. RWKV-7 runs in the
reference only with RWKV_V7_ON=1 set before `import rwkv.model`, which swaps its classes for
the whole process; it runs in a subprocess that writes its logits and states with torch.save.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rwkv_engine
from rwkv_engine import State, testing
from rwkv_engine.errors import CheckpointError, StateError
from rwkv_engine.models import model as model_module

from .conftest import SIZES, rel_rms

PROMPT = [3, 17, 255, 1, 0, 42, 99, 7, 7, 7, 123, 200, 5, 64, 31, 9, 250, 11, 2, 180] * 3  # 60 tokens
DECODE_STEPS = 16

# Ranks other than the defaults, to show that they are read from the shapes.
ODD_RANKS = {"6.0": {"mix": 8, "decay": 24}, "7": {"decay": 16, "iclr": 8, "value": 24, "gate": 40}}


def _random_pth(directory, version, odd_ranks=False, **kw):
    sd = testing.random_state_dict(
        version, **{**SIZES, "seed": 11, **kw}, lora=ODD_RANKS[version] if odd_ranks else None
    )
    return sd, testing.save_pth(sd, directory / f"v{version}{'-odd' if odd_ranks else ''}.pth")


def _compare_state(ours, ref_list, n_layer, transpose_kv=False):
    """ours: State; ref_list: the reference's per-layer [att_x_prev, att_kv, ffn_x_prev] list."""
    for i in range(n_layer):
        kv = ref_list[3 * i + 1]
        assert rel_rms(ours.att_x_prev[0, i], ref_list[3 * i]) < 1e-4, (i, "att_x_prev")
        assert rel_rms(ours.att_kv[0, i], kv.transpose(-1, -2) if transpose_kv else kv) < 1e-4, (i, "att_kv")
        assert rel_rms(ours.ffn_x_prev[0, i], ref_list[3 * i + 2]) < 1e-4, (i, "ffn_x_prev")


def _check_against_trace(model, trace, transpose_kv):
    """trace: the reference's prompt logits/state, then (token, logits) per decode step and the final state."""
    logits, state = model.forward(PROMPT, all_logits=True)
    assert logits.shape == trace["prompt_logits"].shape == (len(PROMPT), model.config.vocab_size)
    assert rel_rms(logits, trace["prompt_logits"]) < 1e-4
    _compare_state(state, trace["prompt_state"], model.config.n_layer, transpose_kv)
    for tok, ref_logits in zip(trace["tokens"], trace["step_logits"]):
        logits, state = model.forward([tok], state)
        assert rel_rms(logits, ref_logits) < 1e-4
    _compare_state(state, trace["final_state"], model.config.n_layer, transpose_kv)


def _trace(ref, prompt=PROMPT):
    """Run the reference: prompt, then greedy decode; states copied (it updates its list in place)."""
    logits, state = ref.forward(list(prompt), None, full_output=True)
    out = {"prompt_logits": logits.clone(), "prompt_state": [s.clone() for s in state], "tokens": [], "step_logits": []}
    tok = int(logits[-1].argmax())
    for _ in range(DECODE_STEPS):
        logits, state = ref.forward([tok], state)
        out["tokens"].append(tok)
        out["step_logits"].append(logits.clone())
        tok = int(logits.argmax())
    out["final_state"] = [s.clone() for s in state]
    return out


# --- RWKV-6 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("odd_ranks", [False, True], ids=["release-ranks", "odd-ranks"])
def test_v6_matches_rwkv_package(tmp_path, odd_ranks):
    from rwkv.model import RWKV as RefRWKV

    _, path = _random_pth(tmp_path, "6.0", odd_ranks)
    model = rwkv_engine.load(path)
    assert model.config.version == "6.0"
    assert (model.config.lora_mix, model.config.lora_decay) == ((8, 24) if odd_ranks else (32, 64))
    _check_against_trace(model, _trace(RefRWKV(str(path), "cpu fp32", verbose=False)), transpose_kv=False)


def test_v6_time_state_is_the_initial_state(tmp_path):
    """A state-tuned file: the reference starts from time_state.transpose(1, 2); so does new_state."""
    from rwkv.model import RWKV as RefRWKV

    sd = testing.random_state_dict("6.0", **SIZES, seed=12, time_state=True)
    path = testing.save_pth(sd, tmp_path / "tuned.pth")
    model = rwkv_engine.load(path)
    fresh = model.new_state(2)
    for i in range(model.config.n_layer):
        want = sd[f"blocks.{i}.att.time_state"].transpose(1, 2)
        assert torch.equal(fresh.att_kv[0, i], want) and torch.equal(fresh.att_kv[1, i], want)
    assert not fresh.att_x_prev.any() and not fresh.ffn_x_prev.any()
    _check_against_trace(model, _trace(RefRWKV(str(path), "cpu fp32", verbose=False)), transpose_kv=False)
    # the tuned start matters: a zero state gives other logits
    zero = State({k: torch.zeros_like(v) for k, v in model.new_state().items()}, fresh.signature)
    assert rel_rms(model.forward(PROMPT[:5], zero)[0], model.forward(PROMPT[:5])[0]) > 1e-2


def test_v6_time_state_in_some_blocks_only(tmp_path):
    sd = testing.random_state_dict("6.0", **SIZES, time_state=True)
    del sd["blocks.1.att.time_state"]
    with pytest.raises(CheckpointError, match=r"time_state is missing in blocks \[1\]"):
        rwkv_engine.load(testing.save_pth(sd, tmp_path / "partial.pth"))


# --- RWKV-7 (reference in a subprocess) ---------------------------------------------------------

_V7_REFERENCE = textwrap.dedent(
    """
    import os, sys
    os.environ["RWKV_V7_ON"] = "1"
    os.environ["RWKV_CUDA_ON"] = "0"
    import torch
    torch.set_num_threads(1)
    from rwkv.model import RWKV
    sys.path.insert(0, sys.argv[1])
    from tests.test_parity_v6_v7 import _trace

    out = {}
    for path in sys.argv[3:]:
        ref = RWKV(path[: -len(".pth")], "cpu fp32")  # it appends .pth itself
        out[path] = _trace(ref)
    torch.save(out, sys.argv[2])
    """
)


@pytest.fixture(scope="module")
def v7_traces(tmp_path_factory):
    """Both RWKV-7 checkpoints run through the reference in one subprocess: {path: trace}."""
    d = tmp_path_factory.mktemp("v7ref")
    paths = [_random_pth(d, "7", odd)[1] for odd in (False, True)]
    out = d / "traces.pt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _V7_REFERENCE, root, str(out), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RWKV_V7_ON": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = torch.load(out)
    return {p: traces[str(p)] for p in paths}


@pytest.mark.parametrize("odd_ranks", [False, True], ids=["release-ranks", "odd-ranks"])
def test_v7_matches_rwkv_package(v7_traces, odd_ranks):
    path = list(v7_traces)[odd_ranks]
    model = rwkv_engine.load(path)
    assert model.config.version == "7"
    want = (16, 8, 24, 40) if odd_ranks else (32, 32, 32, 32)
    assert (model.config.lora_decay, model.config.lora_iclr, model.config.lora_value, model.config.lora_gate) == want
    # the pip state is [value][key]; ours is [key][value] (state.py)
    _check_against_trace(model, v7_traces[path], transpose_kv=True)


# --- formats -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["6.0", "7"])
def test_hf_directory_gives_the_pth_logits(version, tmp_path):
    """HF Rwkv6ForCausalLM (B.3) / fla RWKV7ForCausalLM (B.4) directories, also sharded and bf16."""
    sd, path = _random_pth(tmp_path, version, odd_ranks=True)
    ref, ref_state = rwkv_engine.load(path).forward(PROMPT, all_logits=True)
    for d in (
        testing.save_hf_dir(sd, tmp_path / "hf", version),
        testing.save_hf_dir(sd, tmp_path / "hf-sharded", version, weights="bin", shards=3),
    ):
        model = rwkv_engine.load(d)
        assert model.config.version == version
        logits, state = model.forward(PROMPT, all_logits=True)
        assert rel_rms(logits, ref) < 1e-6 and state.allclose(ref_state, rtol=1e-5, atol=1e-6)
    bf16 = testing.save_hf_dir(testing.cast(sd, torch.bfloat16), tmp_path / "hf-bf16", version)
    assert rel_rms(rwkv_engine.load(bf16, dtype="fp32").forward(PROMPT, all_logits=True)[0], ref) < 0.05


def test_fla_layout_details(tmp_path):
    """The fla names really differ from BlinkDL's: transposed LoRA, no v_lora in layer 0; config checked."""
    import json

    sd, _ = _random_pth(tmp_path, "7", odd_ranks=True)
    fla = testing.to_fla(sd)
    assert fla["model.layers.1.attn.w_lora.lora.0.weight"].shape == (16, 64)  # w1^T
    assert fla["model.layers.1.attn.v_lora.lora.2.bias"].shape == (64,)  # v0
    assert not any(k.startswith("model.layers.0.attn.v_lora") for k in fla)
    d = testing.save_hf_dir(sd, tmp_path / "fla", "7")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, decay_low_rank_dim=64)))
    with pytest.raises(CheckpointError, match="decay_low_rank_dim=64 but the weights have 16"):
        rwkv_engine.load(d)
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="rwkv6")))
    with pytest.raises(CheckpointError, match="model_type 'rwkv6' but the weights are RWKV-7"):
        rwkv_engine.load(d)


def test_safetensors_and_bf16_files(tmp_path):
    for version in ("6.0", "7"):
        sd, path = _random_pth(tmp_path, version)
        ref, _ = rwkv_engine.load(path).forward(PROMPT[:20])
        st = testing.save_safetensors(sd, tmp_path / f"{version}.safetensors")
        assert rel_rms(rwkv_engine.load(st).forward(PROMPT[:20])[0], ref) < 1e-6
        bf = testing.save_pth(testing.cast(sd, torch.bfloat16), tmp_path / f"{version}-bf16.pth")
        assert rwkv_engine.load(bf).config.version == version


# --- forward semantics -------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["6.0", "7"])
def model(request, tmp_path_factory):
    return rwkv_engine.load(_random_pth(tmp_path_factory.mktemp("m"), request.param)[1])


def _tokens(n, seed=0):
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_equals_token_by_token_and_chunks(model, monkeypatch):
    ids = _tokens(45)
    full_logits, full_state = model.forward(ids, all_logits=True)
    state, step_logits = None, []
    for t in ids:
        lg, state = model.forward([t], state)
        step_logits.append(lg)
    assert rel_rms(torch.stack(step_logits), full_logits) < 1e-5
    assert full_state.allclose(state, rtol=1e-4, atol=1e-5)
    state = None
    for a, b in ((0, 5), (5, 6), (6, 30), (30, 45)):
        lg, state = model.forward(ids[a:b], state)
    assert rel_rms(lg, full_logits[-1]) < 1e-5 and full_state.allclose(state, rtol=1e-4, atol=1e-5)
    # the model's own prefill chunking (v_first is per chunk, not state) changes nothing
    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 16)
    logits, state = model.forward(ids, all_logits=True)
    assert rel_rms(logits, full_logits) < 1e-5 and full_state.allclose(state, rtol=1e-4, atol=1e-5)


def test_batched_rows_equal_separate_runs(model):
    rows = [_tokens(33, seed=s) for s in range(3)]
    starts = [model.forward(_tokens(5, seed=10 + s))[1] for s in range(3)]
    logits, state = model.forward(torch.tensor(rows), State.cat(starts), all_logits=True)
    for i in range(3):
        lg, st = model.forward(rows[i], starts[i], all_logits=True)
        assert rel_rms(logits[i], lg) < 1e-5 and state[i].allclose(st, rtol=1e-4, atol=1e-5)
    step, _ = model.forward(torch.tensor([[1], [2], [3]]), state)
    for i in range(3):
        assert rel_rms(step[i], model.forward([i + 1], state[i])[0]) < 1e-5


def test_16bit_close_to_fp32(model):
    """Stated tolerance, as for RWKV-4/5: bf16 / fp16 weights within 3% / 1% relative RMS of fp32."""
    ids = _tokens(64, seed=4)
    ref, _ = model.forward(ids, all_logits=True)
    for dtype, tol in (("bf16", 0.03), ("fp16", 0.01)):
        low = rwkv_engine.load(model.path, dtype=dtype)
        assert low.blocks[1].att.key.weight.dtype == getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
        logits, state = low.forward(ids, all_logits=True)
        assert rel_rms(logits, ref) < tol, dtype
        assert all(t.dtype == torch.float32 for _, t in state.items())


def test_state_from_another_version(model, tmp_path):
    other = "7" if model.config.version == "6.0" else "6.0"
    m2 = rwkv_engine.load(_random_pth(tmp_path, other)[1])
    with pytest.raises(StateError, match="another model"):
        model.forward([1], m2.new_state())
