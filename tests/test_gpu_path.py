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
