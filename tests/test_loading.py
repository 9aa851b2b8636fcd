"""Every supported file format gives the same model; every bad file gives one clear error."""

import json
import shutil

import pytest
import torch

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.errors import CheckpointError, InputError, RWKVEngineError, UnsupportedModelError
from rwkv_engine.testing.ggml_writers import write_gguf, write_rwkvcpp

from .conftest import SIZES, rel_rms

PROMPT = [1, 2, 3, 250, 17, 9, 0, 44]


@pytest.fixture(scope="module", params=["4", "5.2"])
def base(request, tmp_path_factory):
    version = request.param
    sd = testing.random_state_dict(version, **SIZES, seed=3)
    d = tmp_path_factory.mktemp(f"fmt{version}")
    path = testing.save_pth(sd, d / "model.pth")
    logits, _ = rwkv_engine.load(path).forward(PROMPT)
    return version, sd, d, logits


WRITERS = {
    "pth-bf16": lambda sd, d, v: testing.save_pth(testing.cast(sd, torch.bfloat16), d / "bf16.pth"),
    "pth-fp16": lambda sd, d, v: testing.save_pth(testing.cast(sd, torch.float16), d / "fp16.pth"),
    "pth-legacy": lambda sd, d, v: (
        torch.save(sd, d / "legacy.pth", _use_new_zipfile_serialization=False),
        d / "legacy.pth",
    )[1],
    "safetensors": lambda sd, d, v: testing.save_safetensors(sd, d / "w.safetensors"),
    "no-extension": lambda sd, d, v: testing.save_safetensors(sd, d / "weights"),
    "hf-safetensors": lambda sd, d, v: testing.save_hf_dir(sd, d / "hf1", v),
    "hf-bin": lambda sd, d, v: testing.save_hf_dir(sd, d / "hf2", v, weights="bin"),
    "hf-sharded-safetensors": lambda sd, d, v: testing.save_hf_dir(sd, d / "hf3", v, shards=3),
    "hf-sharded-bin": lambda sd, d, v: testing.save_hf_dir(sd, d / "hf4", v, weights="bin", shards=2),
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_formats_agree(base, fmt):
    version, sd, d, ref_logits = base
    path = WRITERS[fmt](sd, d, version)
    model = rwkv_engine.load(path, dtype="fp32")  # the file's values, compared at fp32 (auto keeps 16-bit files 16-bit)
    assert model.config.version == version
    assert model.config.n_layer == SIZES["n_layer"] and model.config.vocab_size == SIZES["vocab_size"]
    logits, _ = model.forward(PROMPT)
    tol = 2e-2 if ("bf16" in fmt or "fp16" in fmt) else 1e-6  # 16-bit files carry rounded weights
    assert rel_rms(logits, ref_logits) < tol


def test_config_fields(make_pth):
    cfg = rwkv_engine.load(make_pth("5.2")).config
    assert (cfg.version, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.head_size, cfg.vocab_size) == (
        "5.2",
        3,
        64,
        4,
        16,
        300,
    )
    assert cfg.ffn_dim == int(3.5 * 64) // 32 * 32
    cfg4 = rwkv_engine.load(make_pth("4")).config
    assert (cfg4.version, cfg4.ffn_dim) == ("4", 256)


def test_dtypes_and_errors_for_dtype(make_pth):
    path = make_pth("5.2")
    for dt, tdt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        m = rwkv_engine.load(path, dtype=dt)
        assert m.dtype == tdt and m.blocks[0].att.key.weight.dtype == tdt
        assert m.blocks[0].att.log_decay.dtype == torch.float32  # decays stay fp32
    with pytest.raises(InputError, match="dtype"):
        rwkv_engine.load(path, dtype="int3")


# --- bad files -------------------------------------------------------------------------------


def _expect(exc, match, path, **kw):
    with pytest.raises(exc, match=match) as info:
        rwkv_engine.load(path, **kw)
    assert isinstance(info.value, RWKVEngineError) and isinstance(info.value, ValueError)
    assert str(path) in str(info.value) or match in str(info.value)
    return info.value


def test_missing_file(tmp_path):
    _expect(CheckpointError, "no such file", tmp_path / "nope.pth")


def test_hub_id_offline_is_a_clear_error():
    # Tests run with HF_HUB_OFFLINE=1: the hub lookup fails at once, without traffic.
    _expect(CheckpointError, "Hugging Face Hub", "no-such-org/no-such-model")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.pth"
    p.write_bytes(b"")
    _expect(CheckpointError, "empty", p)


def test_text_file(tmp_path):
    p = tmp_path / "notes.pth"
    p.write_text("hello, this is not a model\n" * 10)
    _expect(CheckpointError, "not a checkpoint", p)


@pytest.mark.parametrize("writer", ["pth", "safetensors"])
def test_truncated(tmp_path, writer, make_pth):
    sd = testing.random_state_dict("5.2", **SIZES)
    full = (
        testing.save_pth(sd, tmp_path / "full.pth")
        if writer == "pth"
        else testing.save_safetensors(sd, tmp_path / "full.st")
    )
    data = full.read_bytes()
    cut = tmp_path / f"cut.{writer}"
    cut.write_bytes(data[: len(data) // 2])
    _expect(CheckpointError, "truncated|corrupt|cannot read", cut)


def test_not_a_state_dict(tmp_path):
    p = tmp_path / "list.pth"
    torch.save([torch.zeros(3)], p)
    _expect(CheckpointError, "dict of tensors", p)
    p2 = tmp_path / "nested.pth"
    torch.save({"a": {"b": torch.zeros(1)}}, p2)
    _expect(CheckpointError, "flat dict", p2)


def test_other_model(tmp_path):
    p = tmp_path / "gpt.pth"
    torch.save({"transformer.wte.weight": torch.zeros(10, 4)}, p)
    _expect(CheckpointError, "not an RWKV checkpoint", p)


def test_unknown_and_missing_keys(tmp_path):
    sd = testing.random_state_dict("5.2", **SIZES)
    extra = dict(sd, **{"blocks.1.att.mystery": torch.zeros(3)})
    _expect(CheckpointError, "unknown tensor.*blocks.1.att.mystery", testing.save_pth(extra, tmp_path / "extra.pth"))
    missing = {k: v for k, v in sd.items() if k != "blocks.2.ffn.value.weight"}
    _expect(CheckpointError, "missing.*blocks.2.ffn.value.weight", testing.save_pth(missing, tmp_path / "missing.pth"))
    gap = {k: v for k, v in sd.items() if not k.startswith("blocks.1.")}
    _expect(CheckpointError, r"blocks \[1\] are missing", testing.save_pth(gap, tmp_path / "gap.pth"))


def test_wrong_shape(tmp_path):
    sd = testing.random_state_dict("5.2", **SIZES)
    sd["blocks.1.att.value.weight"] = torch.zeros(64, 32)
    _expect(CheckpointError, "blocks.1.att.value.weight has shape", testing.save_pth(sd, tmp_path / "shape.pth"))


def test_unsupported_variants(tmp_path):
    sd = testing.random_state_dict("7", **SIZES)
    # RWKV-7a (DeepEmbed) loads (tests/test_deep_embed.py); with its tables incomplete it is missing tensors
    deep = dict(sd, **{"blocks.0.ffn.s_emb.weight": torch.zeros(300, 1024)})
    _expect(CheckpointError, "missing", testing.save_pth(deep, tmp_path / "de.pth"))
    dea = dict(sd, **{"blocks.0.qkv.k_emb.weight": torch.zeros(300, 256)})
    _expect(UnsupportedModelError, "RWKV-7b", testing.save_pth(dea, tmp_path / "dea.pth"))
    preview = dict(sd, **{"blocks.0.att.time_misc_a": torch.zeros(1, 1, 64)})
    _expect(UnsupportedModelError, "RWKV-7 preview", testing.save_pth(preview, tmp_path / "rc.pth"))


def test_pip_converted_file(tmp_path):
    sd = dict(testing.random_state_dict("4", **SIZES), _strategy="cpu fp32")
    p = tmp_path / "conv.pth"
    torch.save(sd, p)
    _expect(CheckpointError, "converted by the `rwkv` pip package", p)


def test_hf_dir_problems(tmp_path, make_pth):
    sd = testing.random_state_dict("4", **SIZES)
    d = testing.save_hf_dir(sd, tmp_path / "hf", "4")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=7)))
    _expect(CheckpointError, "num_hidden_layers=7", d)
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    _expect(CheckpointError, "model_type 'llama'", d)
    (d / "config.json").write_text("{not json")
    _expect(CheckpointError, "not valid JSON", d)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").unlink()
    _expect(CheckpointError, "needs one of", d)
    empty = tmp_path / "emptydir"
    empty.mkdir()
    _expect(CheckpointError, "no config.json and no checkpoint", empty)
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(make_pth("4"), two / "a.pth")
    shutil.copy(make_pth("4"), two / "b.pth")
    _expect(CheckpointError, "several checkpoints", two)
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(make_pth("4"), one / "a.pth")
    assert rwkv_engine.load(one).config.version == "4"


# Names as the files of each layout spell them (docs/formats.md B.1-B.4), written out by hand.
KNOWN_NAMES = {
    "hf": [
        ("rwkv.embeddings.weight", "emb.weight"),
        ("rwkv.ln_out.bias", "ln_out.bias"),
        ("head.weight", "head.weight"),
        ("rwkv.blocks.0.pre_ln.weight", "blocks.0.ln0.weight"),
        ("rwkv.blocks.2.attention.time_mix_key", "blocks.2.att.time_mix_k"),
        ("rwkv.blocks.2.attention.time_mix_gate", "blocks.2.att.time_mix_g"),
        ("rwkv.blocks.1.feed_forward.time_mix_receptance", "blocks.1.ffn.time_mix_r"),
        ("rwkv.blocks.1.attention.time_maa_w1", "blocks.1.att.time_maa_w1"),
        ("rwkv.blocks.3.ln2.bias", "blocks.3.ln2.bias"),
    ],
    "fla": [
        ("model.embeddings.weight", "emb.weight"),
        ("model.norm.weight", "ln_out.weight"),
        ("lm_head.weight", "head.weight"),
        ("model.layers.0.pre_norm.bias", "blocks.0.ln0.bias"),
        ("model.layers.1.attn.w_lora.lora.0.weight", "blocks.1.att.w1"),
        ("model.layers.1.attn.a_lora.lora.2.weight", "blocks.1.att.a2"),
        ("model.layers.1.attn.v_lora.lora.2.bias", "blocks.1.att.v0"),
        ("model.layers.0.attn.g_norm.weight", "blocks.0.att.ln_x.weight"),
        ("model.layers.0.attn.r_proj.weight", "blocks.0.att.receptance.weight"),
        ("model.layers.0.attn.k_k", "blocks.0.att.k_k"),
        ("model.layers.2.ffn_norm.weight", "blocks.2.ln2.weight"),
        ("model.layers.2.ffn.key.weight", "blocks.2.ffn.key.weight"),
    ],
}


@pytest.mark.parametrize("layout", ["hf", "fla"])
def test_name_table_both_ways(layout):
    """Reading (canonical_name) and writing (hf_name / fla_name, used by testing) agree with the
    hand-written names, and with each other over whole random state dicts."""
    from rwkv_engine.loading.names import canonical_name, fla_name, hf_name

    write = hf_name if layout == "hf" else fla_name
    for theirs, ours in KNOWN_NAMES[layout]:
        assert canonical_name(theirs) == ours and write(ours) == theirs
    for version in ("4", "5.2", "6.0") if layout == "hf" else ("7",):
        sd = testing.random_state_dict(version, **SIZES)
        assert all(canonical_name(write(k)) == k for k in sd)


def test_prepare_returns_a_plan_for_every_source(tmp_path):
    """A checkpoint gives a plan to fill; a converted directory a built one, which convert writes again."""
    from rwkv_engine import loading
    from rwkv_engine.loading import converted

    src = testing.save_pth(testing.random_state_dict("5.2", **SIZES), tmp_path / "m.pth")
    plan = loading.prepare(src, quantization="q8")
    assert isinstance(plan, loading.Plan) and not plan.built and plan.model.dtype_reason == "auto: fp32 checkpoint"
    out = converted.convert(plan, tmp_path / "conv", progress=False)
    again = loading.prepare(out)
    assert isinstance(again, loading.Plan) and again.built and list(again.tensors()) == []
    assert again.model.quantization.name == plan.model.quantization.name
    assert again.model.dtype_reason == "the converted directory's"
    copy = converted.convert(again, tmp_path / "copy", progress=False)
    a = rwkv_engine.load(out).forward(PROMPT)[0]
    assert torch.equal(rwkv_engine.load(copy).forward(PROMPT)[0], a)


NON_FINITE = {  # R4: every format the loader reads, each with a NaN or an infinite weight
    "pth": lambda sd, d: testing.save_pth(sd, d / "m.pth"),
    "safetensors": lambda sd, d: testing.save_safetensors(sd, d / "m.safetensors"),
    "hf-dir": lambda sd, d: testing.save_hf_dir(sd, d / "hf", "7"),
    "hf-bin-sharded": lambda sd, d: testing.save_hf_dir(sd, d / "hfbin", "7", weights="bin", shards=2),
    "gguf-f16": lambda sd, d: write_gguf(sd, d / "m.gguf", "F16"),
    "gguf-q8_0": lambda sd, d: write_gguf(sd, d / "q8.gguf", "Q8_0"),  # its codes and scales taken as they are
    "rwkv.cpp": lambda sd, d: write_rwkvcpp(sd, d / "m.bin", "FP16"),
}


@pytest.fixture(scope="module")
def finite_v7():
    return testing.random_state_dict("7", **SIZES, seed=4)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # (numpy, quantizing the NaN for Q8_0)
@pytest.mark.parametrize("value", ["NaN", "-inf"])
@pytest.mark.parametrize("fmt", sorted(NON_FINITE))
def test_non_finite_weights_refused_at_load(finite_v7, fmt, value, tmp_path):
    """A checkpoint holding a NaN or an infinite weight is refused by the loader, naming the
    tensor (the check runs as each tensor is read), not at its first token."""
    name = "blocks.1.att.key.weight"
    sd = {k: v.clone() for k, v in finite_v7.items()}
    sd[name][3, 5] = float(value)
    kw = {"policy": {"*": "q8"}} if fmt == "gguf-q8_0" else {}  # (tiny matrices stay dense by default)
    kind = "NaN" if value == "NaN" else "infinite"
    with pytest.raises(CheckpointError, match=rf"tensor {name} holds {kind} values") as e:
        rwkv_engine.load(NON_FINITE[fmt](sd, tmp_path), progress=False, **kw)
    assert "\n" not in str(e.value)


def test_non_finite_time_state_refused(tmp_path):
    """A state-tuned checkpoint's time_state (the initial state, not a module's weight) too."""
    sd = testing.random_state_dict("7", **SIZES, seed=4, time_state=True)
    sd["blocks.2.att.time_state"][0, 1, 2] = float("nan")
    with pytest.raises(CheckpointError, match="tensor blocks.2.att.time_state holds NaN values"):
        rwkv_engine.load(testing.save_pth(sd, tmp_path / "tuned.pth"))


def test_non_finite_converted_directory_refused(finite_v7, tmp_path):
    """`convert` refuses a NaN checkpoint, so every directory it writes was checked as its
    weights were read, and records so (`checked_finite`: its load reads them once, not twice);
    a directory without the record (written before convert checked) is checked at load, naming
    the tensor."""
    from safetensors.torch import load_file, save_file

    from rwkv_engine.cli import main

    sd = {k: v.clone() for k, v in finite_v7.items()}
    sd["head.weight"][7, 0] = float("nan")
    assert main(["convert", str(testing.save_pth(sd, tmp_path / "nan.pth")), str(tmp_path / "nan")]) != 0
    assert not (tmp_path / "nan").exists()
    out = tmp_path / "good"
    assert main(["convert", str(testing.save_pth(finite_v7, tmp_path / "good.pth")), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["rwkv_engine"].pop("checked_finite") is True
    (out / "config.json").write_text(json.dumps(config))  # as an older convert wrote it
    rwkv_engine.load(out)
    weights = out / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["blocks.2.ffn.value.weight"][0, 0] = float("-inf")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tensor blocks.2.ffn.value.weight holds infinite values"):
        rwkv_engine.load(out)
