"""GGUF (llama.cpp) and rwkv.cpp checkpoints: our dequantizers against the `gguf` package's, files
written the way their converters write them loaded against the source checkpoint, bad files."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.errors import CheckpointError, InputError, UnsupportedModelError
from rwkv_engine.loading import gguf as gguf_file
from rwkv_engine.loading import rwkvcpp
from rwkv_engine.quant.ggml_quants import BY_NAME, QK_K, dequantize
from rwkv_engine.quant.kquant_linear import KQuantLinear
from rwkv_engine.quant.linear import Int8Linear
from rwkv_engine.testing.ggml_writers import quantize, write_gguf, write_rwkvcpp

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf import quants as gq  # noqa: E402

IDS = [1, 5, 9, 200, 3, 77, 31]
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rwkv_engine", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", [*TYPES, "F16", "BF16"])
def test_dequantize_equals_gguf_package_bit_for_bit(name):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((16, 2 * QK_K)) * rng.uniform(0.01, 3, (16, 1))).astype(np.float32)
    if name in ("Q4_K", "Q5_K", "Q6_K"):
        raw = quantize(x, name)  # gguf.quants cannot quantize K types: ours, checked by its dequantizer
        raw2 = rng.integers(0, 256, raw.shape, dtype=np.uint8)  # any bytes, with finite fp16 fields
        fp16_at = [208] if name == "Q6_K" else [0, 2]
        bs = raw.shape[1] // (2 * QK_K // QK_K)
        blocks = raw2.reshape(-1, bs)
        for o in fp16_at:
            blocks[:, o : o + 2] = np.float16(rng.uniform(-0.01, 0.01, (blocks.shape[0], 1))).view(np.uint8)
        cases = [raw, raw2]
    elif name == "BF16":
        cases = [torch.from_numpy(x).to(torch.bfloat16).view(torch.uint8).numpy()]
    elif name == "F16":
        cases = [x.astype(np.float16).view(np.uint8)]
    else:
        cases = [gq.quantize(x, GT[name])]
    for raw in cases:
        ref = gq.dequantize(raw, GT[name])
        ours = dequantize(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)), BY_NAME[name], x.shape).numpy()
        assert np.array_equal(ref.view(np.uint32), ours.view(np.uint32)), name
    if name in ("Q4_K", "Q5_K", "Q6_K"):  # our test quantizer makes blocks of that type's error
        err = np.sqrt(((gq.dequantize(cases[0], GT[name]) - x) ** 2).mean() / (x**2).mean())
        assert err < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[name], err


def _model(version, n_embd=64):
    return testing.random_state_dict(version, n_layer=2, n_embd=n_embd, vocab_size=256, head_size=16, seed=3)


def _logits(path, **kw):
    return testing.logits_along(rwkv_engine.load(path, dtype="fp32", progress=False, **kw), IDS[:5], IDS[5:])


@pytest.mark.parametrize("version", ["6.0", "7"])
@pytest.mark.parametrize("ftype", ["F32", "F16", "BF16"])
def test_gguf_float_types_match_source(tmp_path, version, ftype):
    sd = _model(version)
    ref = _logits(testing.save_pth(sd, tmp_path / "m.pth"))
    path = write_gguf(sd, tmp_path / "m.gguf", ftype, rescale_every=1 if version == "6.0" else 0)
    err = testing.rel_rms(_logits(path), ref)
    assert err < {"F32": 1e-6, "F16": 2e-3, "BF16": 1e-2}[ftype], err


@pytest.mark.parametrize("version,ftype", [("7", t) for t in TYPES] + [("6.0", "Q8_0"), ("6.0", "Q5_1")])
def test_gguf_quantized_types(tmp_path, version, ftype):
    """Every tensor as gguf.quants dequantizes it, and logits within that type's error of the source."""
    sd = _model(version)  # (K types: the matrices 256 wide, ffn.value, are in that type; the rest F16)
    ref = _logits(testing.save_pth(sd, tmp_path / "m.pth"))
    path = write_gguf(sd, tmp_path / "m.gguf", ftype)
    ours = gguf_file.read(path)
    reader = gguf.GGUFReader(str(path))
    checked = 0
    for t in reader.tensors:  # the tensors kept in their layout: compare values one to one
        name = gguf_file._TOP.get(t.name)
        parts = t.name.split(".")
        if name is None and parts[2] in gguf_file._BLOCK:
            name = f"blocks.{parts[1]}.{gguf_file._BLOCK[parts[2]]}.{parts[3]}"
        if name is None or t.tensor_type.name != ftype:
            continue
        want = gq.dequantize(t.data, t.tensor_type).reshape(ours.tensors[name][0])
        assert np.array_equal(ours.tensors[name][2]().numpy(), want), name
        checked += 1
    assert checked >= (2 if ftype.endswith("_K") else 5)
    if ftype == "Q8_0":  # taken as it is: the module's codes are the file's bytes
        model = rwkv_engine.load(path, progress=False, policy={"*": "q8"})  # (tiny matrices stay dense by default)
        assert model.quantization.name == "q8"
        lin = model.get_submodule("blocks.1.att.key")
        assert isinstance(lin, Int8Linear)
        raw = next(t for t in reader.tensors if t.name == "blk.1.time_mix_key.weight").data
        codes = np.ascontiguousarray(raw.reshape(-1, 34)[:, 2:]).view(np.int8).reshape(lin.qweight.shape)
        assert torch.equal(lin.qweight, torch.from_numpy(codes))
    bound = {"Q8_0": 0.05, "Q6_K": 0.1, "Q5_0": 0.2, "Q5_1": 0.2, "Q5_K": 0.2}.get(ftype, 0.5)
    err = testing.rel_rms(_logits(path), ref)
    assert err < bound, err


def test_gguf_requantized_with_q(tmp_path, capsys):
    sd = _model("7")
    path = write_gguf(sd, tmp_path / "m.gguf", "Q4_0")
    model = rwkv_engine.load(path, quantization="q8", progress=False, policy={"*": "q8"})
    assert model.quantization.name == "q8"
    assert "re-quantized to q8" in capsys.readouterr().err


def test_convert_gguf_q4_streams_to_a_directory(tmp_path):
    sd = testing.random_state_dict("7", n_layer=2, n_embd=64, vocab_size=256, head_size=16, seed=4)
    path = write_gguf(sd, tmp_path / "m.gguf", "Q8_0")
    r = _cli("convert", str(path), str(tmp_path / "out"), "-q", "q4")
    assert r.returncode == 0, r.stderr
    assert "re-quantized to q4" in r.stderr
    live = rwkv_engine.load(path, quantization="q4", progress=False)
    conv = rwkv_engine.load(tmp_path / "out", progress=False)
    a = testing.logits_along(live, IDS[:4], IDS[4:])
    assert torch.equal(a, testing.logits_along(conv, IDS[:4], IDS[4:]))


def test_gguf_vocabulary_must_be_world(tmp_path):
    sd = _model("7")
    tokens = gguf_file.world_token_texts()[:256]
    tokens[42] = "not-world"
    with pytest.raises(UnsupportedModelError, match="id 42"):
        rwkv_engine.load(write_gguf(sd, tmp_path / "a.gguf", tokens=tokens), progress=False)


@pytest.mark.parametrize("arch", ["llama", "mamba"])
def test_gguf_of_another_architecture(tmp_path, arch):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if arch == "mamba":
        with pytest.raises(UnsupportedModelError, match="x.gguf.*'mamba'"):
            rwkv_engine.load(tmp_path / "x.gguf", progress=False)
        return
    r = _cli("generate", str(tmp_path / "x.gguf"), "--prompt", "hi")
    assert r.returncode == 1  # (2 is argparse's usage error)
    assert f"'{arch}'" in r.stderr and "x.gguf" in r.stderr and "Traceback" not in r.stderr


def test_gguf_truncated_and_unknown_type(tmp_path):
    path = write_gguf(_model("7"), tmp_path / "m.gguf", "Q4_0")
    data = path.read_bytes()
    for cut in (len(data) - 100, 2000, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="cut.gguf.*(truncated|corrupt)"):
            rwkv_engine.load(tmp_path / "cut.gguf", progress=False)
    w = gguf.GGUFWriter(str(tmp_path / "q2.gguf"), "rwkv7")
    w.add_tensor("token_embd.weight", np.zeros((8, 84), dtype=np.uint8), raw_dtype=GT.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="q2.gguf.*Q2_K"):
        rwkv_engine.load(tmp_path / "q2.gguf", progress=False)


@pytest.mark.parametrize("version", ["4", "5.0", "5.1", "5.2", "6.0", "7"])
def test_rwkvcpp_files(tmp_path, version):
    sd = _model(version)
    ref = _logits(testing.save_pth(sd, tmp_path / "m.pth"))
    for dtype, bound in (("FP32", 1e-5), ("FP16", 3e-3), ("Q8_0", 0.05), ("Q5_1", 0.35), ("Q4_0", 0.5)):
        path = write_rwkvcpp(sd, tmp_path / f"m-{dtype}.bin", dtype)
        err = testing.rel_rms(_logits(path), ref)
        assert err < bound, (dtype, err)


@pytest.mark.parametrize("dtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_rwkvcpp_quantized_values_are_gguf_dequantized(tmp_path, dtype):
    sd = _model("5.2")
    path = write_rwkvcpp(sd, tmp_path / "m.bin", dtype)
    got = rwkvcpp.read(path)
    w = sd["blocks.1.ffn.key.weight"].float().numpy()
    want = gq.dequantize(gq.quantize(w, GT[dtype]), GT[dtype])
    assert got.types["blocks.1.ffn.key.weight"] == dtype
    assert np.array_equal(got.tensors["blocks.1.ffn.key.weight"][2]().numpy(), want)


def test_rwkvcpp_bad_files(tmp_path):
    path = write_rwkvcpp(_model("4"), tmp_path / "m.bin", "Q4_0")
    data = bytearray(path.read_bytes())
    (tmp_path / "cut.bin").write_bytes(data[: len(data) - 7])
    with pytest.raises(CheckpointError, match="cut.bin.*truncated"):
        rwkv_engine.load(tmp_path / "cut.bin", progress=False)
    data[32:36] = (5).to_bytes(4, "little")  # the first tensor's data type: rwkv.cpp's unused 5
    (tmp_path / "bad.bin").write_bytes(data)
    r = _cli("generate", str(tmp_path / "bad.bin"), "--prompt", "hi")
    assert r.returncode == 1 and "bad.bin" in r.stderr and "data type 5" in r.stderr and "Traceback" not in r.stderr


def _llama_cpp_tree():
    """llama.cpp's tree from the llama-cpp-python sdist, as benchmarks/bench_peers.py caches it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_peers
    finally:
        sys.path.pop(0)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rwkv-engine-bench"
    tree = cache / f"llama-cpp-python-{bench_peers.LLAMA_CPP_PYTHON}"
    return tree if (tree / "convert_hf_to_gguf.py").exists() else None


@pytest.mark.parametrize("version", ["6.0", "7"])
def test_gguf_from_llama_cpp_converter(tmp_path, version):
    """GGUFs made by llama.cpp's own convert_hf_to_gguf.py (from a HF / fla directory of the model)
    give the .pth's logits: exactly in F32, within fp16 / Q8_0 rounding otherwise."""
    tree = _llama_cpp_tree()
    if tree is None:
        pytest.skip("no llama.cpp tree cached (python benchmarks/bench_peers.py fetches it)")
    sd = testing.random_state_dict(version, n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=2)
    ref = _logits(testing.save_pth(sd, tmp_path / "m.pth"))
    hf = testing.save_hf_dir(sd, tmp_path / "hf", version)
    shutil.copy(Path(rwkv_engine.__file__).parent / "data" / "rwkv_vocab_v20230424.txt", hf)
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the tree's gguf-py
    for outtype, bound in (("f32", 1e-6), ("q8_0", 0.06)):
        out = tmp_path / f"m-{outtype}.gguf"
        r = subprocess.run(
            [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf), "--outtype", outtype, "--outfile", str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        err = testing.rel_rms(_logits(out), ref)
        assert err < bound, (outtype, err)


# --- K-quants run from their blocks (quant/kquant_linear.py) ---------------------------------


def _mixed(name: str) -> str:
    """A Q4_K_M-like mix: Q6_K for the head and the value / FFN-value matrices, Q8_0 for the
    receptance, Q4_K for the rest."""
    if name == "output.weight" or "_value" in name:
        return "Q6_K"
    return "Q8_0" if "receptance" in name else "Q4_K"


@pytest.mark.parametrize("version,ftype", [("7", "Q4_K"), ("7", "Q5_K"), ("7", "mixed"), ("6.0", "Q6_K")])
def test_gguf_kquants_run_from_the_files_blocks(tmp_path, version, ftype):
    """Each K-quant matrix becomes a KQuantLinear holding the file's own bytes (RWKV-6's rescaled
    matrices: the block scales times the power of two, exactly); logits within the format's own
    error of the .pth and within the activations' int8 rounding of the same file dequantized."""
    sd = testing.random_state_dict(version, n_layer=2, n_embd=256, vocab_size=300, head_size=64, seed=3)
    ref = _logits(testing.save_pth(sd, tmp_path / "m.pth"))
    rescale = 1 if version == "6.0" else 0
    path = write_gguf(sd, tmp_path / "m.gguf", _mixed if ftype == "mixed" else ftype, rescale_every=rescale)
    model = rwkv_engine.load(path, dtype="fp32", progress=False)
    assert model.quantization.name == "gguf"
    reader = gguf.GGUFReader(str(path))
    kinds = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if t.name == "output.weight" or (len(parts) == 4 and parts[2] in gguf_file._BLOCK):
            name = "head" if t.name == "output.weight" else f"blocks.{parts[1]}.{gguf_file._BLOCK[parts[2]]}"
            m = model.get_submodule(name)
            if not hasattr(m, "in_features"):  # (att.ln_x)
                continue
            kinds.setdefault(t.tensor_type.name, set()).add(type(m).__name__)
            if isinstance(m, KQuantLinear):
                want = np.asarray(t.data).reshape(m.qweight.shape)
                if rescale and name.endswith(("att.output", "ffn.value")):  # the converter's 2^-i undone
                    got = gq.dequantize(m.qweight.numpy(), t.tensor_type)
                    assert np.array_equal(got, gq.dequantize(want, t.tensor_type) * 2 ** int(parts[1])), name
                else:
                    assert np.array_equal(m.qweight.numpy(), want), name
    assert kinds.pop("F16", {"DenseLinear"}) == {"DenseLinear"}  # (widths not a multiple of 256: F16)
    want = {"Q4_K": {"KQuantLinear"}, "Q6_K": {"KQuantLinear"}, "Q8_0": {"Int8Linear"}}
    assert kinds == (want if ftype == "mixed" else {ftype: {"KQuantLinear"}}), kinds
    ours = _logits(path)
    dense = _logits(path, quantization="q0f32")  # the same values, dequantized once, fp32 x
    assert testing.rel_rms(ours, dense) < 0.06  # x rounded to int8 per 32 columns
    bound = {"Q4_K": 0.5, "Q5_K": 0.25, "Q6_K": 0.12, "mixed": 0.5}[ftype]
    assert testing.rel_rms(ours, ref) < bound


def test_gguf_kquant_blocks_are_mapped_and_convert_keeps_them(tmp_path, monkeypatch):
    """Without huge pages the blocks stay views of one mapping of the file (nothing copied);
    `convert` writes them as they are (no second rounding) and the directory gives the same bits."""
    sd = testing.random_state_dict("7", n_layer=2, n_embd=256, vocab_size=300, head_size=64, seed=4)
    path = write_gguf(sd, tmp_path / "m.gguf", _mixed)
    monkeypatch.setenv("RWKV_ENGINE_HUGE_PAGES", "0")
    model = rwkv_engine.load(path, dtype="fp32", progress=False)
    a, b = model.blocks[0].att.key.qweight, model.head.qweight
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # the one file mapping
    r = _cli("convert", str(path), str(tmp_path / "out"), "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    assert "run as they are stored" in r.stderr
    conv = rwkv_engine.load(tmp_path / "out", dtype="fp32", progress=False)
    assert isinstance(conv.head, KQuantLinear) and conv.head.qtype == "Q6_K"
    assert torch.equal(conv.blocks[1].att.key.qweight, model.blocks[1].att.key.qweight)
    assert torch.equal(testing.logits_along(conv, IDS[:4], IDS[4:]), testing.logits_along(model, IDS[:4], IDS[4:]))


@pytest.mark.parametrize("value", [0x7E00, 0xFC00])  # fp16 NaN, -inf
@pytest.mark.parametrize(
    "tensor,name", [("blk.1.time_mix_key.weight", "blocks.1.att.key.weight"), ("token_embd.weight", "emb.weight")]
)
def test_gguf_kquant_non_finite_scale_refused(tmp_path, tensor, name, value):
    """A K-quant block whose fp16 scale is NaN or infinite (every value of the block a multiple of
    it) is refused at load naming the tensor, for a matrix run from its blocks and for the
    embedding, which is dequantized by rows (neither is read through `Checkpoint.get`)."""
    sd = testing.random_state_dict("7", n_layer=2, n_embd=256, vocab_size=300, head_size=64, seed=4)
    path = write_gguf(sd, tmp_path / "m.gguf", "Q4_K")
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == tensor)
    assert t.tensor_type.name == "Q4_K"
    data = bytearray(path.read_bytes())
    at = t.data_offset + 3 * 144  # block 3's d (Q4_K: 144 bytes a block, d first)
    data[at : at + 2] = value.to_bytes(2, "little")
    path.write_bytes(bytes(data))
    kind = "NaN" if value == 0x7E00 else "infinite"
    with pytest.raises(
        CheckpointError, match=rf"tensor {name} holds {kind if name != 'emb.weight' else '(NaN|infinite)'} values"
    ):
        rwkv_engine.load(path, dtype="fp32", progress=False)


def test_gguf_scheme_needs_a_gguf(tmp_path):
    sd = _model("7")
    with pytest.raises(InputError, match="not a GGUF file"):
        rwkv_engine.load(testing.save_pth(sd, tmp_path / "m.pth"), quantization="gguf", progress=False)


@pytest.mark.parametrize("emb_type", ["Q8_0", "Q4_K", "Q6_K", "Q5_1"])
def test_gguf_quantized_embedding_stays_blocks(tmp_path, emb_type):
    """A quantized GGUF embedding (Q4_K in llama-quantize's Q4_K_M, Q6_K in its Q6_K, Q8_0 in its
    Q8_0) is kept as the file's blocks: no [vocab, C] float table anywhere in the model, a lookup's
    rows are gguf.quants' values bit for bit, ln0 applied to them gives the folded table's rows
    (loading/transforms.embedding) bit for bit, and the logits are those of the folded table."""
    from rwkv_engine.loading.transforms import embedding
    from rwkv_engine.quant.ggml_embedding import GgmlEmbedding

    sd = testing.random_state_dict("7", n_layer=2, n_embd=256, vocab_size=300, head_size=64, seed=5)
    path = write_gguf(sd, tmp_path / "m.gguf", lambda n: emb_type if n == "token_embd.weight" else "Q4_K")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    raw = tensors["token_embd.weight"]
    assert raw.tensor_type.name == emb_type
    V, C = 300, 256
    for dtype in ("fp32", "bf16"):
        model = rwkv_engine.load(path, dtype=dtype, progress=False)
        emb = model.emb
        assert isinstance(emb, GgmlEmbedding) and emb.qtype == emb_type
        assert np.array_equal(emb.qweight.numpy(), np.asarray(raw.data).reshape(V, -1))  # the file's bytes
        big = [k for k, t in model.state_dict().items() if t.is_floating_point() and t.numel() >= V * C]
        assert big == [], big  # (the head is a KQuantLinear: its blocks)
        ids = torch.tensor([0, 299, 7, 7, 150, 1])
        want = torch.from_numpy(gq.dequantize(np.asarray(raw.data), raw.tensor_type).reshape(V, C))[ids]
        got = emb.rows(ids)
        assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert emb.file_rows is not None and emb.file_rows.serves(emb.qweight)  # rows read with pread
        rows, emb.file_rows = emb.file_rows, None  # and through the mapping: the same bits
        assert torch.equal(emb.rows(ids).view(torch.int32), want.view(torch.int32))
        emb.file_rows = rows
        with pytest.raises(IndexError):
            emb(torch.tensor([V]))
        ln = [torch.from_numpy(np.array(tensors[f"token_embd_norm.{k}"].data)) for k in ("weight", "bias")]
        table = embedding(
            torch.from_numpy(gq.dequantize(np.asarray(raw.data), raw.tensor_type).reshape(V, C)), *ln, model.dtype
        )
        looked = emb(ids.view(2, 3))
        assert looked.shape == (2, 3, C) and looked.dtype == model.dtype
        assert torch.equal(looked.reshape(-1, C), table[ids])
        assert torch.equal(emb.dequantize(), table)
        alone = GgmlEmbedding.from_blocks(emb_type, emb.qweight.clone(), (V, C), *ln, model.dtype)
        assert alone.file_rows is None and torch.equal(alone(ids), table[ids])  # (through the tensor)
        with pytest.raises(InputError, match="blocks of a 300 x 256 table"):
            GgmlEmbedding.from_blocks(emb_type, emb.qweight[:, 1:], (V, C), *ln, model.dtype)
        ours = testing.logits_along(model, IDS[:4], IDS[4:])
        model.emb = torch.nn.Embedding.from_pretrained(table, freeze=True)
        model.reset_decode_step()
        assert torch.equal(testing.logits_along(model, IDS[:4], IDS[4:]), ours)
