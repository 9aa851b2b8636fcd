"""The native kernels run without the GIL: the serving engine reads a prompt piece on its prefill
thread while the engine thread decodes (serve/beside.py), and a kernel that held the GIL would
stop the engine thread's Python for the whole call (a K-quant prefill GEMV of a 256-token piece
runs for tens of milliseconds).

Each of the prefill kernels (the GEMVs and the K-quant dequantization) runs on a helper thread
while this thread takes the time in a Python loop; with the GIL held for the call, no time could
be taken while the call runs. (The same release wraps every kernel entry point in bindings.cpp.)"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from rwkv_engine.kernels import native

ops = native.load()
pytestmark = pytest.mark.skipif(ops is None, reason="native kernels unavailable here (see log)")


def kq_blocks(N: int, K: int) -> torch.Tensor:
    """Q6_K blocks (ggml type 14, 210 bytes) of random codes with small finite scales."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (N, K // 256, 210), dtype=np.uint8)
    raw[:, :, 208:210] = np.float16(rng.uniform(-0.01, 0.01, (N, K // 256, 1))).view(np.uint8)
    return torch.from_numpy(raw.reshape(N, -1))


def calls():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 2048, generator=g)
    w = torch.randn(4096, 2048, generator=g).bfloat16()
    blocks, wide = kq_blocks(4096, 2048), kq_blocks(8192, 8192)
    return {
        "gemv_dense": lambda: ops.gemv_dense(x, w),
        "gemv_kq": lambda: ops.gemv_kq(x, blocks, 14, 2048),
        "dequant_kq": lambda: ops.dequant_kq(wide, 14, 8192, 0, 8192, torch.bfloat16),
    }


@pytest.mark.parametrize("name", ["gemv_dense", "gemv_kq", "dequant_kq"])
def test_kernels_let_other_threads_run_python(name):
    call = calls()[name]
    call()  # (built, warm)
    span, done = [], threading.Event()

    def run():
        t0 = time.perf_counter()
        call()
        span.extend((t0, time.perf_counter()))
        done.set()

    helper = threading.Thread(target=run)
    samples = []
    helper.start()
    while not done.is_set():
        samples.append(time.perf_counter())
    helper.join()
    t0, t1 = span
    ms = int(1e3 * (t1 - t0))
    assert ms >= 30, f"{name} took {ms} ms: too short to tell"
    # This thread's Python ran in most milliseconds of the call. With the GIL held it could run
    # only for a switch interval (5 ms) before the helper thread took the GIL back to enter the
    # call, and for one after the call returned, before the helper took the time.
    covered = len({int(1e3 * (t - t0)) for t in samples if t0 <= t <= t1})
    assert covered >= 0.6 * ms, (name, covered, ms)
