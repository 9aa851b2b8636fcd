"""The CUDA path, tested without a GPU: device flags, the meta device, torch.compile of the step,
the CUDA-graph runner's bucketing (captured eagerly on the CPU), the CUDA quantized layouts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import rwkv_engine
from rwkv_engine.errors import InputError

NO_CUDA = not torch.cuda.is_available()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rwkv_engine", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_exit_2(make_pth):
    path = make_pth("7", n_embd=64, head_size=16)
    r = _cli("generate", str(path), "-p", "hi", "--device", "cuda", "--max-tokens", "2")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
def test_load_cuda_without_cuda_is_an_input_error(make_pth):
    with pytest.raises(InputError, match="CUDA"):
        rwkv_engine.load(make_pth("7", n_embd=64, head_size=16), device="cuda", progress=False)


def test_device_flag_rejects_unknown_device():
    r = _cli("generate", "m.pth", "-p", "hi", "--device", "tpu")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


# --- the meta device: every version's forward creates nothing on the host --------------------

VERSIONS = ["4", "5.2", "6.0", "7"]


def _tiny(make_pth, version, **kw):
    return rwkv_engine.load(make_pth(version, **kw), dtype="fp32", progress=False)


@pytest.mark.parametrize("version", VERSIONS)
def test_forward_on_meta_device(make_pth, version):
    """A tensor made without device= (torch.eye(n)) or a host sync would fail here, as on CUDA."""
    model = _tiny(make_pth, version).to("meta")
    V = model.config.vocab_size
    for T in (1, 5, 40):  # the recurrent step, the short recurrence, the chunked prefill
        logits, state = model.forward(torch.arange(2 * T).reshape(2, T) % V)
        assert logits.device.type == "meta" and logits.shape == (2, V)
        assert state.device.type == "meta"
    model.graph_decode = True  # the graph runner's bookkeeping, eagerly on meta
    logits, state = model.forward(torch.tensor([[1], [2], [3]]), state=model.new_state(3))
    assert logits.shape == (3, V) and logits.device.type == "meta"


# --- the CUDA-graph runner: buckets, padding, row independence (eager stand-in on the CPU) ----


def test_bucket_for():
    from rwkv_engine.models.cuda_graph import BUCKETS, bucket_for

    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 33, 64, 65, 256)] == [1, 2, 4, 8, 16, 64, 64, 128, 256]
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    with pytest.raises(ValueError):
        bucket_for(257)


@pytest.mark.parametrize("version", ["5.2", "7"])
def test_graph_runner_matches_the_modules(make_pth, version):
    """Decode through DecodeGraphs (capture off) = the PyTorch block loop, row for row, and a row's
    bits do not depend on the other rows of its bucket, nor on what the padding rows hold."""
    from rwkv_engine.models.cuda_graph import DecodeGraphs

    model = _tiny(make_pth, version)
    V = model.config.vocab_size
    prompts = torch.randint(0, V, (5, 7), generator=torch.Generator().manual_seed(1))
    _, state = model.forward(prompts)
    ids = torch.tensor([3, 17, 42, 99, 5])
    model.native_decode = False
    ref_logits, ref_state = model.forward(ids[:, None], state=state)
    graphs = DecodeGraphs(model, capture=False)
    logits, new = graphs(ids, state)  # 5 rows -> bucket 8
    assert graphs.captured() == [8]
    assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert new.allclose(ref_state)
    # the padding rows of bucket 8 hold junk (even NaN): the real rows are bit for bit unchanged
    b = graphs.bucket(5)
    for t in b.state_in.values():
        t[5:].fill_(float("nan"))
    b.ids[5:].fill_(V - 1)
    again, new2 = graphs(ids, state)
    assert torch.equal(again, logits) and all(torch.equal(getattr(new2, k), getattr(new, k)) for k in new.fields)
    # the first 3 rows in a batch of 6 (same bucket) are the same bits as in the batch of 5
    six, _ = graphs(torch.cat([ids, ids[:1]]), state[[0, 1, 2, 3, 4, 0]])
    assert torch.equal(six[:5], logits) and graphs.captured() == [8]
    # a larger bucket grows the shared buffers (the smaller graphs are dropped, rebuilt on use)
    nine, _ = graphs(torch.cat([ids, ids[:4]]), state[[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    assert graphs.captured() == [16] and torch.allclose(nine[:5], logits, rtol=1e-5, atol=1e-5)
    again, _ = graphs(ids, state)
    assert graphs.captured() == [8, 16] and torch.equal(again, logits)
    # more rows than the largest bucket: split across replays
    small = DecodeGraphs(model, capture=False, buckets=(1, 2))
    split_logits, split_state = small(ids, state)
    assert small.captured() == [1, 2]
    assert torch.allclose(split_logits, ref_logits, rtol=1e-5, atol=1e-5) and split_state.allclose(ref_state)


def test_forward_uses_the_graph_runner_when_asked(make_pth):
    model = _tiny(make_pth, "7")
    model.graph_decode = True
    logits, state = model.forward([5])
    assert model._graphs is not None and model._graphs[1].captured() == [1]
    model.graph_decode = False
    ref, ref_state = model.forward([5])
    assert torch.allclose(logits, ref, rtol=1e-5, atol=1e-5) and state.allclose(ref_state)


# --- torch.compile of the one-token step (what CUDA graphs / reduce-overhead need) ------------


@pytest.mark.slow
def test_decode_step_compiles_fullgraph_and_matches_eager(make_pth, monkeypatch):
    """The one-token step traced whole (no graph break: no host sync, no Python-side branching on
    values). The smallest model; about a minute cold on 2 cores. The CPU's native kernels are
    switched off: what runs on CUDA is the PyTorch modules (and the GPU WKV kernels)."""
    import importlib

    from rwkv_engine.models import cuda_graph

    native = importlib.import_module("rwkv_engine.kernels.native")
    monkeypatch.setattr(native, "load", lambda verbose=False: None)  # every CPU-native path asks it

    model = _tiny(make_pth, "7", n_layer=2)
    model.emb.file_rows = None  # the CPU's file-backed embedding rows are a host-side read
    V = model.config.vocab_size
    _, state = model.forward(torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(2)))
    fields = dict(state.items())
    ids = torch.tensor([7, 11])
    out_eager = {k: torch.empty_like(v) for k, v in fields.items()}
    out_comp = {k: torch.empty_like(v) for k, v in fields.items()}
    eager = cuda_graph.step(model, ids, fields, out_eager)
    compiled = torch.compile(cuda_graph.step, fullgraph=True, dynamic=False)
    got = compiled(model, ids, fields, out_comp)
    assert torch.allclose(got, eager, rtol=1e-4, atol=1e-5)
    for k in fields:
        assert torch.allclose(out_comp[k], out_eager[k], rtol=1e-4, atol=1e-5), k


# --- quantized linears for CUDA: our layout read by Triton kernels (interpreted on the CPU) ----

_QUANT_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit decorates the kernels
import torch
import rwkv_engine
from rwkv_engine.quant import cuda as QC
from rwkv_engine.quant.linear import Int4Linear, Int8Linear
from rwkv_engine.testing import rel_rms

g = torch.Generator().manual_seed(0)
w = torch.randn(80, 256, generator=g)
w[3, 17] = 9.0  # an outlier column
cases = [(Int8Linear, 32), (Int8Linear, None), (Int4Linear, 32), (Int4Linear, 128)]
for cls, gs in cases:
    m = cls.from_weight(w, group_size=gs) if gs is not None else cls.from_weight(w)
    c = QC.CudaInt8Linear(m) if cls is Int8Linear else QC.CudaInt4Linear(m)
    assert torch.equal(c.dequantize(), m.dequantize()), cls  # the same weights, bit for bit
    assert c.qweight.data_ptr() == m.qweight.data_ptr()  # converted without a copy
    for dt, tol in ((torch.float32, 1e-6), (torch.float16, 2e-3)):
        for M in (1, 17):  # decode rows, and more than one BLOCK_M
            x = torch.randn(2, M, 256, generator=g).to(dt)
            ref = torch.nn.functional.linear(x.float(), m.dequantize(torch.float32))
            y = c(x)
            assert y.dtype == dt and y.shape == (2, M, 80)
            err = rel_rms(y.float(), ref)
            assert err < tol, (cls.__name__, gs, dt, M, err)
# a whole model: q8 / q4 swapped for the CUDA modules = the CPU modules' plain path
path = sys.argv[1]
for q in ("q4",):  # blocks 0-1 of a q4 model are q8 (the default policy), block 2 q4: both kernels
    ref = rwkv_engine.load(path, dtype="fp32", quantization=q, progress=False)
    ref.native_decode = False
    import rwkv_engine.kernels.native as N
    import rwkv_engine.quant.linear as L
    N.load = lambda verbose=False: None  # the reference path: dequantized matrices
    L.Int4Linear._reference = L._QuantLinearBase._reference  # not the CPU GEMV's int8 activations
    conv = rwkv_engine.load(path, dtype="fp32", quantization=q, progress=False)
    n = QC.convert_for_cuda(conv)
    left = [k for k, v in conv.named_modules() if isinstance(v, (Int8Linear, Int4Linear))]
    kinds = {type(v).__name__ for v in conv.modules()}
    assert n >= 6 and not left and {"CudaInt4Linear", "CudaInt8Linear"} <= kinds, (n, left, kinds)
    ids = [5, 9, 200, 7, 31]
    a, sa = ref.forward(ids)
    b, sb = conv.forward(ids)
    assert rel_rms(b, a) < 1e-5, (q, rel_rms(b, a))
    a, _ = ref.forward([3], sa)
    b, _ = conv.forward([3], sb)
    assert rel_rms(b, a) < 1e-5, (q, rel_rms(b, a))
print("OK")
"""


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_cuda_quant_linears_check_their_input_as_the_cpu_ones(kind):
    """R5: CudaInt8Linear / CudaInt4Linear refuse what Int8Linear / Int4Linear refuse, with the
    same one-line InputError, before any kernel is launched (so this runs without a GPU or
    Triton), give an empty batch an empty answer, and describe themselves the same way."""
    from rwkv_engine.quant import cuda as QC
    from rwkv_engine.quant.linear import Int4Linear, Int8Linear

    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    cpu = Int8Linear.from_weight(w, group_size=32) if kind == "int8" else Int4Linear.from_weight(w, group_size=64)
    gpu = QC.CudaInt8Linear(cpu) if kind == "int8" else QC.CudaInt4Linear(cpu)
    for bad in (torch.zeros(2, 127), torch.zeros(()), torch.zeros(2, 128, dtype=torch.int32), [0.0] * 128):
        with pytest.raises(InputError) as want:
            cpu(bad)
        with pytest.raises(InputError) as got:
            gpu(bad)
        assert str(got.value).split(": ", 1)[1] == str(want.value).split(": ", 1)[1]  # (each names its class)
        assert type(gpu).__name__ in str(got.value)
    empty = torch.zeros(3, 0, 128)
    assert gpu(empty).shape == cpu(empty).shape == (3, 0, 48)
    assert gpu.group_size == cpu.group_size == (32 if kind == "int8" else 64)
    assert gpu.extra_repr() == cpu.extra_repr()


@pytest.mark.slow
def test_cuda_quant_linears_under_the_triton_interpreter(make_pth, tmp_path):
    """CudaInt8Linear / CudaInt4Linear: the CPU modules' weights bit for bit (no conversion of the
    bytes), the Triton kernels' products within rounding of the dequantized matmul (fp32, fp16;
    decode and prefill rows), and a converted q8 / q4 model = the unconverted one."""
    pytest.importorskip("triton")
    script = tmp_path / "quant_cuda.py"
    script.write_text(_QUANT_SCRIPT)
    # matrices big enough to be quantized, and blocks past those the default policy keeps wider
    path = make_pth("7", n_layer=3, n_embd=256, head_size=64)
    r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_max_batch_default_follows_the_device():
    from rwkv_engine.cli import serve
    from rwkv_engine.cli.common import ArgumentParser

    parser = ArgumentParser(prog="t")
    serve.add_arguments(parser)
    args = parser.parse_args(["m.pth"])
    assert args.max_batch == (serve.CUDA_MAX_BATCH if torch.cuda.is_available() else serve.CPU_MAX_BATCH)
    assert parser.parse_args(["m.pth", "--max-batch", "3"]).max_batch == 3


def test_auto_device_and_dtype(monkeypatch):
    from rwkv_engine.device import resolve_device
    from rwkv_engine.loading.plan import auto_dtype

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(InputError, match="device"):
        resolve_device("tpu")
    cuda = torch.device("cuda")
    for bf16, want in ((True, torch.bfloat16), (False, torch.float16)):  # fp16 (with the rescale) before Ampere
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda bf16=bf16: bf16)
        for weights in (torch.float32, torch.bfloat16, torch.float16):
            for quantized in (False, True):
                assert auto_dtype(weights, cuda, quantized)[0] == want
    assert auto_dtype(torch.float32, torch.device("cpu"), False)[0] == torch.float32  # the CPU keeps its rule
