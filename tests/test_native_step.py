"""The fused native decode step (models/native_step.py, kernels/native/step.cpp) against the
PyTorch modules it replaces, for every version, dtype and weight format; and when it is rebuilt.

Skipped where the native kernels cannot be built (the PyTorch path then serves every call).
"""

from __future__ import annotations

import pytest
import torch

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.kernels import native
from rwkv_engine.kernels.native import GEMV_MAX_ROWS
from rwkv_engine.models import native_step
from rwkv_engine.quant.schemes import quantize_model

from .conftest import rel_rms

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable here")

VOCAB = 300
# (dtype, quantization) -> tolerance of native vs PyTorch on logits and state. Both paths round
# at the same places; fp32 differs only in summation order, 16-bit by an occasional rounding flip.
FORMATS = {("fp32", None): 1e-5, ("bf16", None): 2e-2, ("fp16", None): 5e-3, ("fp32", "q8"): 1e-4, ("bf16", "q4"): 2e-2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("native_step")
    paths = {}
    for i, version in enumerate(testing.SUPPORTED_RANDOM_VERSIONS):
        torch.manual_seed(100 + i)
        sd = testing.random_state_dict(version, n_layer=3, n_embd=128, vocab_size=VOCAB, head_size=32)
        paths[version] = testing.save_pth(sd, d / f"v{version}.pth")
    return paths


def _decode_both(model, tokens, state, steps=3, one_pass=False):
    """(native, pytorch) results of `steps` one-token forwards from the same state, or with
    one_pass of one forward of the tokens [B, T] (all logits)."""
    out = {}
    for native_decode in (True, False):
        model.native_decode = native_decode
        if one_pass:
            out[native_decode] = model.forward(tokens, state, all_logits=True)
            continue
        st, logits_all = state, []
        for t in range(steps):
            logits, st = model.forward(tokens[:, t : t + 1], st)
            logits_all.append(logits)
        out[native_decode] = (torch.stack(logits_all), st)
    model.native_decode = True
    return out[True], out[False]


@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: f"{f[0]}-{f[1] or 'dense'}")
@pytest.mark.parametrize("version", testing.SUPPORTED_RANDOM_VERSIONS)
def test_native_step_matches_pytorch_modules(checkpoints, version, fmt):
    dtype, quantization = fmt
    model = rwkv_engine.load(checkpoints[version], dtype=dtype, quantization=quantization, progress=False)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, VOCAB, (3, 6), generator=g)
    _, state = model.forward(prompt)  # a non-trivial state to start from
    before = {k: v.clone() for k, v in state.items()}
    tokens = torch.randint(0, VOCAB, (3, 3), generator=g)
    (ln, sn), (lt, stt) = _decode_both(model, tokens, state)
    assert model._native_step[1] is not None, "the native step was not used"
    # The same tokens as one pass (the step's several-tokens mode against the modules' multi-token forward)
    (pn, psn), (pt, pst) = _decode_both(model, tokens, state, one_pass=True)
    tol = FORMATS[fmt]
    for (logits, st), (ref, ref_st) in (((ln, sn), (lt, stt)), ((pn, psn), (pt, pst))):
        assert rel_rms(logits, ref) < tol
        for name in state.fields:
            assert rel_rms(getattr(st, name), getattr(ref_st, name)) < tol, name
    for name, t in state.items():  # the state given in is never modified
        assert torch.equal(t, before[name]), name


def test_native_step_one_dimensional_input_and_all_logits(checkpoints):
    model = rwkv_engine.load(checkpoints["5.2"], progress=False)
    _, state = model.forward([1, 2, 3])
    logits, _ = model.forward([4], state)
    assert logits.shape == (VOCAB,)
    logits, _ = model.forward(torch.tensor([[4], [5]]), rwkv_engine.State.cat([state, state]), all_logits=True)
    assert logits.shape == (2, 1, VOCAB)
    assert model._native_step[1] is not None


def test_rows_are_independent_in_the_native_step(checkpoints):
    # Row i of a batch decodes exactly as it does alone (int8 GEMVs are exact per 64 columns).
    model = rwkv_engine.load(checkpoints["7"], quantization="q8", progress=False)
    g = torch.Generator().manual_seed(3)
    states = [model.forward(torch.randint(0, VOCAB, (4,), generator=g))[1] for _ in range(3)]
    toks = torch.randint(0, VOCAB, (3, 1), generator=g)
    batched, bst = model.forward(toks, rwkv_engine.State.cat(states))
    for i, st in enumerate(states):
        alone, ast = model.forward(toks[i], st)
        assert torch.equal(batched[i], alone)
        assert torch.equal(bst.att_kv[i], ast.att_kv[0])


def test_step_is_rebuilt_when_the_model_changes(checkpoints):
    model = rwkv_engine.load(checkpoints["5.2"], progress=False)
    _, state = model.forward([1, 2, 3])
    model.forward([4], state)
    first = model._native_step[1]
    assert first is not None
    # An in-place change of a parameter is seen at once (the step points into the model's tensors).
    model.native_decode = False
    ref_before, _ = model.forward([4], state)
    with torch.no_grad():
        model.blocks[1].att.bonus.mul_(3.0)  # (log_decay would first show a step later)
    ref_after, _ = model.forward([4], state)
    model.native_decode = True
    assert rel_rms(model.forward([4], state)[0], ref_after) < 1e-5
    assert rel_rms(ref_before, ref_after) > 1e-4
    # .to() may convert tensors: the step is rebuilt.
    model.to(torch.float32)
    model.forward([4], state)
    assert model._native_step[1] is not first
    # Swapping the linears for quantized ones rebuilds the step.
    before = model._native_step[1]
    quantize_model(model, "q8", group_size=64, policy={"blocks.*": "q8"})  # (small ones are kept by default)
    model.native_decode = False
    ref_q8, _ = model.forward([4], state)
    model.native_decode = True
    assert rel_rms(model.forward([4], state)[0], ref_q8) < 1e-4
    assert model._native_step[1] is not before


# --- several tokens per row (speculative verify passes, short prompts) ----------------------

# (dtype, scheme forced on every block matrix): the step's weight formats, each actually used.
PASS_FORMATS = [("fp32", None), ("bf16", None), ("fp16", None), ("bf16", "q8"), ("fp32", "q8"), ("bf16", "q4")]


def _pass_model(path, dtype, scheme):
    model = rwkv_engine.load(path, dtype=dtype, progress=False)
    if scheme is not None:
        report = quantize_model(model, scheme, policy={"blocks.*": scheme})
        assert report, "nothing was quantized"
    return model


def _one_token_steps(model, tokens, state):
    """Logits [B, T, V] and the final state of T one-token forwards (the fused step's T = 1)."""
    out = []
    for t in range(tokens.shape[1]):
        logits, state = model.forward(tokens[:, t : t + 1], state)
        out.append(logits)
    return torch.stack(out, 1), state


@pytest.mark.parametrize("fmt", PASS_FORMATS, ids=lambda f: f"{f[0]}-{f[1] or 'dense'}")
@pytest.mark.parametrize("version", testing.SUPPORTED_RANDOM_VERSIONS)
def test_a_token_pass_gives_the_bits_of_one_token_steps(checkpoints, version, fmt):
    """A forward of T tokens per row (one read of the weights) gives every position the logits,
    and the end the state, of T one-token steps, bit for bit: what speculative exactness rests on."""
    model = _pass_model(checkpoints[version], *fmt)
    g = torch.Generator().manual_seed(11)
    _, state = model.forward(torch.randint(0, VOCAB, (2, 20), generator=g))
    before = {k: v.clone() for k, v in state.items()}
    tokens = torch.randint(0, VOCAB, (2, 6), generator=g)
    calls = []
    step = model._decode_step()
    model._native_step = (model._native_step[0], _Spy(step, calls))
    logits, after = model.forward(tokens, state, all_logits=True)
    assert calls == [(2, 6)], "the pass did not run the fused step"
    ref_logits, ref_after = _one_token_steps(model, tokens, state)
    assert torch.equal(logits, ref_logits)
    for name in state.fields:
        assert torch.equal(getattr(after, name), getattr(ref_after, name)), name
    last, _ = model.forward(tokens, state)  # without all_logits: each row's last position
    assert torch.equal(last, ref_logits[:, -1])
    for name, t in state.items():  # the state given in is never modified
        assert torch.equal(t, before[name]), name


class _Spy:
    """A DecodeStep stand-in that records (B, T) of each call and runs the real one."""

    def __init__(self, step, calls):
        self.step, self.calls = step, calls

    def __call__(self, x, state_in, state_out, all_logits=False):
        self.calls.append((x.shape[0], x.shape[1] if x.dim() == 3 else 1))
        return self.step(x, state_in, state_out, all_logits)


def test_rows_of_a_token_pass_are_independent(checkpoints):
    # Row i of a [B, T] pass gets the bits of its own [1, T] pass, and of its one-token steps.
    model = _pass_model(checkpoints["7"], "bf16", "q4")
    g = torch.Generator().manual_seed(17)
    states = [model.forward(torch.randint(0, VOCAB, (5,), generator=g))[1] for _ in range(3)]
    tokens = torch.randint(0, VOCAB, (3, 4), generator=g)
    batched, bst = model.forward(tokens, rwkv_engine.State.cat(states), all_logits=True)
    for i, st in enumerate(states):
        alone, ast = model.forward(tokens[i : i + 1], st, all_logits=True)
        assert torch.equal(batched[i], alone[0])
        assert torch.equal(bst.att_kv[i], ast.att_kv[0])


def test_a_nan_state_gives_nan_logits_at_every_position_of_a_pass(checkpoints):
    model = rwkv_engine.load(checkpoints["6.0"], dtype="bf16", progress=False)
    _, state = model.forward(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    state = state.clone()
    state.att_kv[0] = float("nan")
    logits, _ = model.forward(torch.tensor([[7, 8, 9], [7, 8, 9]]), state, all_logits=True)
    assert torch.isnan(logits[0]).any(dim=-1).all() and torch.isfinite(logits[1]).all()


def test_wider_passes_use_the_pytorch_path(checkpoints):
    """More than GEMV_MAX_ROWS rows x tokens take the block loop (the batched GEMM)."""
    model = rwkv_engine.load(checkpoints["5.2"], progress=False)
    calls = []
    model._native_step = (native_step.generation(), _Spy(model._decode_step(), calls))
    state = model.new_state(3)
    model.forward(torch.ones(3, GEMV_MAX_ROWS // 3, dtype=torch.long), state)
    assert calls == [(3, GEMV_MAX_ROWS // 3)]
    model.forward(torch.ones(3, GEMV_MAX_ROWS // 3 + 1, dtype=torch.long), state)
    assert len(calls) == 1


def test_wide_batches_use_the_pytorch_path(checkpoints):
    model = rwkv_engine.load(checkpoints["6.0"], progress=False)
    B = GEMV_MAX_ROWS + 1
    g = torch.Generator().manual_seed(5)
    state = model.new_state(B)
    logits, new = model.forward(torch.randint(0, VOCAB, (B, 1), generator=g), state)
    assert logits.shape == (B, VOCAB) and new.batch_size == B
    model.native_decode = False
    ref, _ = model.forward(torch.randint(0, VOCAB, (B, 1), generator=torch.Generator().manual_seed(5)), state)
    assert rel_rms(logits, ref) < 1e-6


def test_plan_rejects_malformed_parameters():
    ops = native.load()
    with pytest.raises(RuntimeError, match="missing"):
        ops.DecodePlan(
            family=5,
            gated=True,
            C=8,
            A=8,
            H=2,
            N=4,
            F=16,
            V=10,
            dtype=torch.float32,
            rescale_every=0,
            blocks=[{"ln1_w": torch.ones(8)}],
            out={},
        )
    with pytest.raises(RuntimeError, match="has 4 values"):
        ops.DecodePlan(
            family=5,
            gated=True,
            C=8,
            A=8,
            H=2,
            N=4,
            F=16,
            V=10,
            dtype=torch.float32,
            rescale_every=0,
            blocks=[{"ln1_w": torch.ones(4)}],
            out={},
        )


def test_step_checks_the_state_it_is_given(checkpoints):
    model = rwkv_engine.load(checkpoints["4"], progress=False)
    step = model._decode_step()
    state = model.new_state(2)
    fields = [t for _, t in state.items()]
    with pytest.raises(RuntimeError, match="state field"):
        step(torch.zeros(1, 128), fields, [torch.empty_like(t) for t in fields])  # 1 row of x, 2 of state


@pytest.mark.parametrize("fmt", list(FORMATS), ids=lambda f: f"{f[0]}-{f[1] or 'dense'}")
def test_a_nan_state_gives_nan_logits(checkpoints, fmt):
    """R9: a NaN state came out of the int8 decode as finite (all-zero) logits. The row whose
    state holds a NaN gives NaN logits, native step and PyTorch modules alike; the other row not."""
    dtype, quantization = fmt
    model = rwkv_engine.load(checkpoints["7"], dtype=dtype, quantization=quantization, progress=False)
    _, state = model.forward(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    state = state.clone()
    for name in state.fields:
        t = getattr(state, name)
        if t.is_floating_point():
            t[0] = float("nan")
    (ln, _), (lt, _) = _decode_both(model, torch.tensor([[7], [8]]), state, steps=1)
    for logits in (ln, lt):
        assert torch.isnan(logits[:, 0]).all() and torch.isfinite(logits[:, 1]).all()
