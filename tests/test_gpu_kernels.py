"""The CUDA WKV kernels (rwkv_engine/kernels/gpu), tested without a GPU.

Every Triton kernel the engine calls on CUDA (our fused step kernels, fla's chunked and fused
recurrent RWKV-7 / RWKV-6 kernels) runs under Triton's interpreter (TRITON_INTERPRET=1, numpy on
the CPU) against the naive recurrences in fp64: output and final state, relative RMS. fp32 and fp16
only (the interpreter computes bf16 wrongly). All cases run in one subprocess: TRITON_INTERPRET
must be set before triton is imported, and fla's import costs 7-12 s once. Our kernels run
without help; fla's need the shim in tests/gpu_interpreter.py (which changes nothing they compute).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rwkv_engine.kernels import gpu

ROOT = Path(__file__).resolve().parent.parent

# fp16 inputs: the error is y's own rounding to fp16 (~3e-4 relative RMS) plus the kernels' fp32
# arithmetic; the state stays fp32.
TOL = {"fp32": 1e-5, "fp16": 2e-3}


def _case(kernel, dtype, B, T, K, **extra):
    parts = [kernel, dtype, f"B{B}", f"T{T}", f"K{K}"] + [k if v is True else f"{k}{v}" for k, v in extra.items()]
    return {"id": "-".join(parts), "kernel": kernel, "dtype": dtype, "B": B, "T": T, "H": 2, "K": K, "seed": 0, **extra}


CASES = [
    # our step kernels (T = 1)
    _case("step7", "fp32", 1, 1, 64),
    _case("step7", "fp32", 3, 1, 16, strided=True),
    _case("step7", "fp32", 3, 1, 16, inplace=True, strided=True),
    _case("step7", "fp16", 3, 1, 16),
    _case("step7", "fp16", 1, 1, 64),
    _case("step5", "fp32", 3, 1, 16),
    _case("step5", "fp32", 3, 1, 16, const=True, strided=True),
    _case("step5", "fp32", 1, 1, 64, const=True, inplace=True),
    _case("step5", "fp16", 3, 1, 16),
    _case("step5", "fp16", 3, 1, 16, const=True),
    # fla, RWKV-7: fused recurrence below 64 tokens, chunked from 64 (64 + 3: a ragged last chunk)
    _case("fla7", "fp32", 3, 5, 16),
    _case("fla7", "fp32", 1, 5, 64),
    _case("fla7", "fp16", 3, 5, 16),
    _case("fla7", "fp32", 3, 67, 16),
    _case("fla7", "fp16", 1, 67, 16),
    _case("fla7", "fp32", 1, 67, 16, chunk=64),
    # fla, RWKV-6 (per-token decay) and RWKV-5 (constant decay, expanded)
    _case("fla6", "fp32", 3, 5, 16),
    _case("fla6", "fp32", 3, 5, 16, const=True),
    _case("fla6", "fp16", 3, 5, 16),
    _case("fla6", "fp32", 3, 67, 16),
    _case("fla6", "fp32", 1, 67, 16, const=True),
    _case("fla6", "fp16", 1, 67, 16),
    # the dispatch CUDA tensors take (kernels.wkv7 / wkv5 -> gpu.wkv7_cuda / wkv5_cuda)
    _case("cuda7", "fp32", 3, 1, 16),
    _case("cuda7", "fp32", 3, 5, 16),
    _case("cuda5", "fp32", 3, 5, 16, const=True),
]
# whole tiny models with their WKV routed through the CUDA dispatch, against their CPU path (fp32): an
# interface check (the tensors the models pass); a 1% error in y moves these logits by 5e-5 (v6) to 3e-4 (v7)
MODEL_CASES = [
    {"id": f"model-v{v}", "kernel": "model", "version": v, "dtype": "fp32", "B": 2} for v in ("5.2", "6.0", "7")
]
# chunks of 64 with fla's safe-gate scheme: measured 4e-6 to 1.2e-5 in fp32 (chunks of 16: 2e-7)
CASE_TOL = {"fla7-fp32-B1-T67-K16-chunk64": 3e-5}

_HAVE_TRITON_FLA = all(importlib.util.find_spec(m) is not None for m in ("triton", "fla"))


@pytest.fixture(scope="module")
def interpreter_results():
    """Run every case in one TRITON_INTERPRET=1 subprocess: {case id: result}."""
    if not _HAVE_TRITON_FLA:
        pytest.skip("triton / fla-core not installed (pip install -e '.[test]')")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu_interpreter.py"), json.dumps(CASES + MODEL_CASES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            out = json.loads(line[5:])
            results[out.pop("id")] = out
    assert results, f"the interpreter run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return results


@pytest.mark.gpu_interpreter
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_kernel_matches_naive_under_interpreter(interpreter_results, case):
    out = interpreter_results.get(case["id"])
    assert out is not None, "case did not run (the subprocess died before it)"
    assert "error" not in out, out["error"]
    tol = CASE_TOL.get(case["id"], TOL[case["dtype"]])
    assert out["y"] < tol, f"y: relative RMS {out['y']:.2e} >= {tol:.0e}"
    assert out["state"] < tol, f"state: relative RMS {out['state']:.2e} >= {tol:.0e}"
    assert out["y_dtype"] == {"fp32": "float32", "fp16": "float16"}[case["dtype"]]
    assert out["state_dtype"] == "float32"
    assert out["inputs_unchanged"]


@pytest.mark.gpu_interpreter
@pytest.mark.parametrize("case", MODEL_CASES, ids=[c["id"] for c in MODEL_CASES])
def test_model_through_cuda_dispatch_under_interpreter(interpreter_results, case):
    out = interpreter_results.get(case["id"])
    assert out is not None, "case did not run (the subprocess died before it)"
    assert "error" not in out, out["error"]
    assert out["calls"] == [1, 5]  # the step kernel and fla's fused recurrence both ran
    assert out["logits"] < 1e-5, f"logits: relative RMS {out['logits']:.2e}"


def test_dispatch_without_triton_returns_none_with_one_notice(monkeypatch, capsys):
    """A CUDA model without fla / triton runs the PyTorch forms, and says so once per process."""
    monkeypatch.setattr(gpu.fla, "_notified", False)
    monkeypatch.setattr(gpu, "step_available", lambda: False)
    monkeypatch.setattr(gpu.fla, "available", lambda: False)
    B, H, N = 1, 2, 8
    x = torch.randn(B, 3, H, N)
    state = torch.zeros(B, H, N, N)
    for T in (1, 3, 1):
        assert gpu.wkv7_cuda(x[:, :T], x[:, :T], x[:, :T], -x[:, :T].abs(), x[:, :T], x[:, :T], state) is None
        assert gpu.wkv5_cuda(x[:, :T], x[:, :T], x[:, :T], -x[0, 0].abs(), x[0, 0], state) is None
    err = capsys.readouterr().err
    assert err.count("rwkv-engine: fla-core / triton not installed") == 1, err


def test_package_imports_without_triton_or_fla():
    """rwkv_engine (and its kernels.gpu) import where triton and fla do not, and report them absent."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('triton', 'fla'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import rwkv_engine, rwkv_engine.models\n"
        "from rwkv_engine.kernels import gpu\n"
        "assert not gpu.step_available() and not gpu.fla.importable() and not gpu.fla.available()\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('triton', 'fla')]\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_wkv7_compiles_fullgraph_on_cpu():
    """torch.compile(fullgraph=True) traces the dispatch (the native kernels' loader stats files,
    which dynamo cannot trace: it is skipped while compiling) and gives the recurrence's bits."""
    from rwkv_engine.kernels import wkv7, wkv7_naive

    g = torch.Generator().manual_seed(0)
    x = [torch.randn(2, 1, 2, 8, generator=g) for _ in range(6)]
    x[3] = -x[3].abs()
    state = torch.randn(2, 2, 8, 8, generator=g)
    y, s = torch.compile(wkv7, fullgraph=True, backend="eager")(*x, state)
    y0, s0 = wkv7_naive(*x, state)
    assert torch.equal(y, y0) and torch.equal(s, s0)
