"""`rwkv-engine convert` and rwkv-engine directories: the same model as on-the-fly quantization, safe writes."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.errors import InputError
from rwkv_engine.loading import converted

from .conftest import rel_rms

IDS = list(range(1, 60))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    sd = testing.random_state_dict("5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=21, outliers=True)
    return testing.save_pth(sd, tmp_path_factory.mktemp("src") / "m.pth")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rwkv_engine", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "scheme,extra", [("q8", ["--group-size", "32"]), ("q4", ["--group-size", "32"]), ("q0bf16", []), ("q0f16", [])]
)
def test_converted_equals_on_the_fly(src, tmp_path, scheme, extra):
    out = tmp_path / f"out-{scheme}"
    r = _cli("convert", str(src), str(out), "-q", scheme, *extra)
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "rwkv_vocab_v20230424.txt").is_file()  # the tokenizer travels with the weights
    gs = 32 if extra else None
    live = rwkv_engine.load(src, quantization=scheme, group_size=gs)
    conv = rwkv_engine.load(out)
    assert conv.quantization.name == live.quantization.name and conv.dtype == live.dtype
    assert [type(m) for m in conv.modules()] == [type(m) for m in live.modules()]
    a, sa = live.forward(IDS, all_logits=True)
    b, sb = conv.forward(IDS, all_logits=True)
    assert torch.equal(a, b) and sa.allclose(sb, 0, 0)
    fp32, _ = rwkv_engine.load(src).forward(IDS, all_logits=True)
    assert rel_rms(b, fp32) < 0.2  # quantized, but the same model
    # a converted directory serves every command: generate reads it like any checkpoint
    g = _cli("generate", str(out), "-p", "Hi", "--max-tokens", "3", "--temperature", "0")
    assert g.returncode == 0, g.stderr


def test_convert_state_tuned_and_time_state_roundtrip(tmp_path):
    sd = testing.random_state_dict("5.2", n_layer=2, n_embd=64, vocab_size=300, head_size=16, seed=5)
    path = testing.save_pth(sd, tmp_path / "m.pth")
    model = rwkv_engine.load(path, dtype="fp16")
    out = converted.save(model, tmp_path / "o")
    back = rwkv_engine.load(out)
    assert back.dtype == torch.float16 and back.rescale_every == model.rescale_every
    assert torch.equal(back.forward(IDS[:20])[0], model.forward(IDS[:20])[0])


def test_convert_bad_requests(src, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    for args, words in (
        ([str(src), str(out), "-q", "q8"], "already exists"),
        ([str(src), str(tmp_path / "a"), "-q", "q5"], "unknown quantization scheme"),
        ([str(src), str(tmp_path / "b"), "-q", "q4", "--group-size", "48"], "group_size must be one of"),
        ([str(src), str(tmp_path / "c"), "-q", "q8", "--group-size", "96"], "does not divide"),
        ([str(src), str(tmp_path / "no" / "dir"), "-q", "q8"], "no such directory"),
        ([str(tmp_path / "missing.pth"), str(tmp_path / "d")], "no such file"),
    ):
        r = _cli("convert", *args)
        assert r.returncode != 0, args
        assert words in r.stderr and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]  # nothing half-written


def test_interrupted_convert_leaves_nothing_that_loads(src, tmp_path, monkeypatch):
    model = rwkv_engine.load(src, quantization="q8", group_size=32)
    write = converted.SafetensorsWriter.write
    calls = []

    def boom(self, name, t):  # interrupted after a few tensors were written
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        write(self, name, t)

    monkeypatch.setattr(converted.SafetensorsWriter, "write", boom)
    with pytest.raises(KeyboardInterrupt):
        converted.save(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_converted_directory_refuses_other_settings(src, tmp_path):
    out = converted.save(rwkv_engine.load(src, quantization="q8", group_size=32), tmp_path / "o")
    with pytest.raises(InputError, match="already converted"):
        rwkv_engine.load(out, quantization="q4")
    with pytest.raises(InputError, match="converted for dtype"):
        rwkv_engine.load(out, dtype="bf16")
    assert rwkv_engine.load(out, quantization="q8").quantization.name == "q8"


def test_int8_scales_of_older_directories_load(src, tmp_path):
    """Directories written before int8 scales became fp16 stored them in fp32: they still load."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "out-q8"
    assert _cli("convert", str(src), str(out), "-q", "q8").returncode == 0
    tensors = load_file(str(out / "model.safetensors"))
    assert any(k.endswith(".scales") and t.dtype == torch.float16 for k, t in tensors.items())
    new = rwkv_engine.load(out).forward(IDS)[0]
    old = {k: t.float() if k.endswith(".scales") else t for k, t in tensors.items()}
    save_file(old, str(out / "model.safetensors"), metadata={"format": "pt"})
    model = rwkv_engine.load(out)
    assert all(
        m.scales.dtype == torch.float16
        for m in model.modules()
        if hasattr(m, "qweight") and m.qweight.dtype == torch.int8
    )
    assert torch.equal(model.forward(IDS)[0], new)


def test_converted_embedding_reads_rows_from_the_file(src, tmp_path):
    out = converted.save(rwkv_engine.load(src, quantization="q8"), tmp_path / "o")
    model = rwkv_engine.load(out)
    assert model.emb.file_rows is not None and model.emb.file_rows.serves(model.emb.weight)
    ids = torch.tensor([[0, 5, 65535, 5]])
    assert torch.equal(model.emb(ids), model.emb.weight[ids])
    logits, _ = model.forward(IDS, all_logits=True)
    model.emb.file_rows = None  # the plain lookup through the mapping: the same model
    assert torch.equal(model.forward(IDS, all_logits=True)[0], logits)


def test_a_killed_converts_partial_directory_is_cleaned_up(src, tmp_path, capfd):
    """Smaller item: a SIGKILLed convert left its hidden .OUT.partial-* directory forever. The next
    convert beside it removes the ones whose writer is dead (and says so), never a live one's."""
    model = rwkv_engine.load(src)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, pid in (("stale", dead.pid), ("live", os.getpid())):
        d = tmp_path / f".out.partial-{name}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half a file")
        (d / converted.OWNER_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    converted.save(model, tmp_path / "out")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".out.partial-live", "out"], left
    assert not (tmp_path / "out" / converted.OWNER_FILE).exists()
    assert "removed 1 partial directory" in capfd.readouterr().err
