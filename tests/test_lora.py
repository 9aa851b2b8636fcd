"""RWKV-6/7's small LoRA matrices keep the checkpoint's 16-bit type (issues 12 and 13).

Loading (every dtype, quantized or not), converted directories (new ones hold the 16-bit type,
older ones with fp32 LoRA still load), the PyTorch modules (the same bits as on an fp32 copy of
the same values) and the fused native step (16-bit LoRA products in SIMD on all threads: the
same bits as on the fp32 copy, within tolerance of the modules, batched = alone bit for bit).
The width 320 and the odd ranks cut the native step's LoRA tiles unevenly (kLoraRows /
kLoraCols = 256, ranks that are no multiple of a vector).
"""

from __future__ import annotations

import pytest
import torch

import rwkv_engine
from rwkv_engine import loading, testing
from rwkv_engine.export.program import exportable_copy
from rwkv_engine.kernels import native
from rwkv_engine.loading import converted

from .conftest import rel_rms

VERSIONS = ("6.0", "7")
RANKS = {"6.0": {"mix": 12, "decay": 20}, "7": {"decay": 24, "iclr": 20, "value": 8, "gate": 40}}
TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VOCAB = 300
PROMPT = [1, 2, 3, 250, 17, 9, 0, 44, 5, 6]

needs_native = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable here")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    paths = {}
    for version in VERSIONS:
        sd = testing.random_state_dict(
            version, n_layer=3, n_embd=320, vocab_size=VOCAB, head_size=32, seed=11, lora=RANKS[version]
        )
        for name, dt in TYPES.items():
            paths[version, name] = testing.save_pth(testing.cast(sd, dt), d / f"v{version}-{name}.pth")
        if version == "7":  # flash-linear-attention's layout: transposed LoRA, other names
            paths[version, "fla-bf16"] = testing.save_hf_dir(testing.cast(sd, torch.bfloat16), d / "fla", version)
    return paths


def _lora_types(model) -> set[torch.dtype]:
    return {model.get_parameter(n).dtype for n in model.lora_names()}


def _load(path, **opts):
    return rwkv_engine.load(path, progress=False, **opts)


def _fp32_copy(path, **opts):
    """The model with its LoRA matrices upcast by hand (their storage before they kept the checkpoint's type)."""
    model = _load(path, **opts)
    model.set_lora_dtype(torch.float32)
    return model


def _run(model, native_decode: bool, steps: int = 3):
    """Prefill logits of every position, then `steps` one-token decodes: (logits, final state)."""
    model.native_decode = native_decode
    logits, state = model.forward(PROMPT, all_logits=True)
    out = [logits]
    for t in range(steps):
        step, state = model.forward([PROMPT[t]], state)
        out.append(step[None])
    model.native_decode = True
    return torch.cat(out), state


@pytest.mark.parametrize("version", VERSIONS)
def test_lora_keeps_the_checkpoint_type(ckpts, version):
    n_lora = {"6.0": 4 * 3, "7": 8 * 3 - 2}[version]  # (RWKV-7's layer 0 has no value LoRA)
    sources = ["bf16", "fp16", "fp32"] + (["fla-bf16"] if version == "7" else [])
    for src in sources:
        want = TYPES[src.removeprefix("fla-")]
        for opts in (dict(dtype="fp32"), dict(dtype="bf16"), dict(dtype="fp16"), {}, dict(quantization="q4")):
            model = _load(ckpts[version, src], **opts)
            assert len(model.lora_names()) == n_lora
            assert _lora_types(model) == {want}, (src, opts)  # (quantized: never picked, they are no linears)
            assert all(type(model.get_parameter(n)) is torch.nn.Parameter for n in model.lora_names())
    model = _load(ckpts[version, "bf16"], dtype="fp32")
    w = "w1" if version == "7" else "decay_w1"
    C, D = 320, RANKS[version]["decay"]
    assert model.blocks[1].att.get_parameter(w).shape == (C, D)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pytorch_modules_give_the_bits_of_an_fp32_copy(ckpts, version, dtype):
    model = _load(ckpts[version, "bf16"], dtype=dtype)
    ref = _fp32_copy(ckpts[version, "bf16"], dtype=dtype)
    assert _lora_types(model) == {torch.bfloat16} and _lora_types(ref) == {torch.float32}
    (a, sa), (b, sb) = _run(model, False), _run(ref, False)
    assert torch.equal(a, b)
    for name in sa.fields:
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name


@needs_native
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("src,quantization", [("bf16", None), ("fp16", None), ("bf16", "q4"), ("fp32", None)])
def test_native_step_with_16_bit_lora(ckpts, version, src, quantization):
    """The step reads the stored type: the bits of the fp32 copy, and the modules' results within
    the tolerance of test_native_step."""
    model = _load(ckpts[version, src], quantization=quantization)
    assert _lora_types(model) == {TYPES[src]}
    ln, sn = _run(model, True)
    assert model._native_step[1] is not None, "the native step was not used"
    lt, st = _run(model, False)
    # The default dtype follows the CPU (fp32 without AVX-512 BF16); the native q4 GEMV rounds its
    # input to int8 where the modules do not, so q4 takes test_native_step's q4 tolerance on any dtype.
    tol = (
        2e-2 if quantization == "q4" else {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}[model.dtype]
    )
    assert rel_rms(ln, lt) < tol
    for name in sn.fields:
        assert rel_rms(getattr(sn, name), getattr(st, name)) < tol, name
    ln32, sn32 = _run(_fp32_copy(ckpts[version, src], quantization=quantization), True)
    assert torch.equal(ln, ln32)
    for name in sn.fields:
        assert torch.equal(getattr(sn, name), getattr(sn32, name)), name


@needs_native
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("quantization", [None, "q8"])
def test_native_rows_are_independent_with_16_bit_lora(ckpts, version, quantization):
    """Row i of a batch of 3 gives the bits it gives alone, on one thread or several."""
    model = _load(ckpts[version, "bf16"], quantization=quantization)
    assert _lora_types(model) == {torch.bfloat16}
    g = torch.Generator().manual_seed(3)
    states = [model.forward(torch.randint(0, VOCAB, (5,), generator=g))[1] for _ in range(3)]
    toks = torch.randint(0, VOCAB, (3, 1), generator=g)
    threads = torch.get_num_threads()
    batched, bst = model.forward(toks, rwkv_engine.State.cat(states))
    try:
        torch.set_num_threads(1)
        for i, st in enumerate(states):
            alone, ast = model.forward(toks[i], st)
            assert torch.equal(batched[i], alone), i
            for name in bst.fields:
                assert torch.equal(getattr(bst, name)[i], getattr(ast, name)[0]), (i, name)
    finally:
        torch.set_num_threads(threads)
    assert model._native_step[1] is not None


@pytest.mark.parametrize("version", VERSIONS)
def test_converted_directory_keeps_16_bit_lora_and_older_ones_load(ckpts, version, tmp_path):
    from safetensors.torch import load_file, save_file

    src = ckpts[version, "bf16"]
    out = converted.convert(loading.prepare(src, quantization="q8"), tmp_path / "q8", progress=False)
    live = _load(src, quantization="q8")
    conv = rwkv_engine.load(out)
    assert _lora_types(conv) == {torch.bfloat16}
    tensors = load_file(str(out / "model.safetensors"))
    assert {tensors[n].dtype for n in conv.lora_names()} == {torch.bfloat16}
    a, b = _run(live, True), _run(conv, True)
    assert torch.equal(a[0], b[0])
    # A directory converted before LoRA matrices kept their type holds them in fp32: it loads so.
    lora = set(conv.lora_names())
    save_file(
        {k: t.float() if k in lora else t for k, t in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    old = rwkv_engine.load(out)
    assert _lora_types(old) == {torch.float32}
    for native_decode in (False, True):
        assert torch.equal(_run(old, native_decode)[0], _run(conv, native_decode)[0])


def test_export_copy_holds_fp32_lora(ckpts):
    model = _load(ckpts["7", "bf16"], dtype="fp32")
    copy = exportable_copy(model)
    assert _lora_types(copy) == {torch.float32} and _lora_types(model) == {torch.bfloat16}
    model.native_decode = False
    assert rel_rms(copy.forward(PROMPT)[0], model.forward(PROMPT)[0]) < 1e-6
