"""WKV kernels for CUDA: our fused one-token steps (Triton) and flash-linear-attention's prefill kernels.

Nothing here imports triton or fla at import time (this package imports on any machine); they are
imported on first use. `kernels/wkv7.py::wkv7` and `kernels/wkv5.py::wkv5` call `wkv7_cuda` /
`wkv5_cuda` for CUDA tensors; the CUDA-graph runner may call the step kernels directly.

Shapes (as `kernels.wkv7.wkv7_naive` / `kernels.wkv5.wkv5_naive`): r, k, log_w, a, b [B, T, H, K];
v [B, T, H, V]; RWKV-5/6: log_w [H, K] (constant) or [B, T, H, K], u [H, K]; state [B, H, K, V]
fp32, laid out [key][value]. Inputs fp32 / fp16 / bf16, computed in fp32; y comes back in r's
dtype, the state in fp32.

    step.wkv7_step(r, k, v, log_w, a, b, state, *, out=None, state_out=None) -> (y, state)
    step.wkv5_step(r, k, v, log_w, u, state, *, out=None, state_out=None)    -> (y, state)
        T == 1, any B and H, one launch. The state's [K, V] tiles must be contiguous, its rows and
        heads may be strided (a layer's view state[:, i] of a whole-model state). Graph-safe: no host sync; allocates only y and the new
        state, nothing when `out` ([B, 1, H, V], unit last stride) and `state_out` are given;
        `state_out=state` updates the state in place. Needs triton; compiles on the first call
        per dtype / shape class: call once before capturing a graph. Inputs not modified.
    fla.wkv7_fla(r, k, v, log_w, a, b, state, chunk_size=16)               -> (y, state)
    fla.wkv6_fla(r, k, v, log_w, u, state)                                 -> (y, state)
        any T >= 1 (chunked from 64 tokens on, fla's fused recurrence below); allocate their
        outputs and fla's workspaces; not meant for graph capture (prefill). Inputs not modified.
        Need fla-core (pip install 'rwkv-engine[cuda]'); `fla.available()` says whether they run.
    wkv7_cuda(...) / wkv5_cuda(...) -> (y, state) or None
        the dispatch: T == 1 the step kernel, T > 1 fla; None where triton / fla is missing
        (the caller then runs its PyTorch form; one notice on stderr per process).
"""

from __future__ import annotations

import functools

from torch import Tensor

from . import fla, step


@functools.cache
def step_available() -> bool:
    """The step kernels can run: triton imports (the tensors being on CUDA is the caller's check)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _tiles(state: Tensor) -> Tensor:
    return state if step.tiles_contiguous(state) else state.contiguous()


def wkv7_cuda(r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, a: Tensor, b: Tensor, state: Tensor):
    """RWKV-7's WKV on CUDA tensors with our / fla's kernels, or None where they cannot run."""
    T = r.shape[1]
    if T == 1 and step_available():
        return step.wkv7_step(r, k, v, log_w, a, b, _tiles(state))
    if T > 1 and fla.available():
        return fla.wkv7_fla(r, k, v, log_w, a, b, state)
    if T > 0:
        fla.notice_missing()
    return None


def wkv5_cuda(r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, u: Tensor, state: Tensor):
    """RWKV-5/6's WKV on CUDA tensors with our / fla's kernels, or None where they cannot run."""
    T = r.shape[1]
    if T == 1 and step_available():
        return step.wkv5_step(r, k, v, log_w, u, _tiles(state))
    if T > 1 and fla.available():
        return fla.wkv6_fla(r, k, v, log_w, u, state)
    if T > 0:
        fla.notice_missing()
    return None


__all__ = ["fla", "step", "step_available", "wkv5_cuda", "wkv7_cuda"]
