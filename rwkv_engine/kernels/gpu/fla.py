"""Adapters to flash-linear-attention's (fla-core 0.6.0) Triton kernels, with our conventions.

fla and ours agree on the layout ([B, T, H, K] inputs, the log decay, a [B, H, K, V] fp32 state
laid out [key][value]) but differ in defaults these adapters pin down:

- `scale=1.0` always (fla's fused_recurrent kernels default to K^-0.5, RWKV has no such scale);
- the final state is always returned (fp32), and `initial_state` is never modified;
- RWKV-5's constant decay [H, K] is expanded per token for fla's RWKV-6 kernels;
- fp32 dot products in fla's chunk kernels run as IEEE fp32, not TF32 (Triton's default on
  NVIDIA): the engine feeds fp32 activations and its parity targets (1e-4 relative) are below
  TF32's rounding. Set per call through `triton.knobs`, where the Triton version has them.

Which kernel: the chunked form from 64 tokens on, the fused recurrence below (sequential over T,
fp32 arithmetic, no dot products). RWKV-7's chunked form runs with chunks of 16 and no assumption
on the decay by default (on the interpreter, fp32: 1.7e-7 relative RMS against the recurrence in
fp64, vs 4e-6 to 1.2e-5 for 64); `chunk_size=64` is fla's own layer's choice (tensor cores, fewer
state passes) and assumes log_w >= -exp(-0.5), which RWKV-7's decay satisfies by construction.

fla and triton are imported on first use; `available()` says whether these can run at all.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import warnings

import torch

Tensor = torch.Tensor

CHUNK_MIN_T = 64  # below this the fused recurrence; from here the chunked kernel (as fla's layers do)
RWKV7_LOG_W_MIN = -math.exp(-0.5)  # RWKV-7's log decay is -exp(-0.5) * sigmoid(...)

_notified = False


@functools.cache
def importable() -> bool:
    """fla and triton import (whatever the device)."""
    try:
        import fla.ops.rwkv6  # noqa: F401
        import fla.ops.rwkv7  # noqa: F401
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def available() -> bool:
    """fla's kernels can run here: CUDA is present and fla and triton import."""
    return torch.cuda.is_available() and importable()


def notice_missing() -> None:
    """One line on stderr, once per process, when a CUDA model runs without fla / triton."""
    global _notified
    if not _notified:
        _notified = True
        print(
            "rwkv-engine: fla-core / triton not installed, the WKV kernels on CUDA use the PyTorch forms "
            "(slower; pip install 'rwkv-engine[cuda]')",
            file=sys.stderr,
        )


@functools.cache
def _ops():
    import fla.ops.rwkv6 as rwkv6
    import fla.ops.rwkv7 as rwkv7

    # fla warns on every fp32 call of its chunked delta-rule kernel ("does not support float32 on
    # some platforms"); fp32 is what the engine feeds, and tested (tests/test_gpu_kernels.py).
    warnings.filterwarnings(
        "ignore", message="ChunkDeltaRuleFunction does not support float32", category=RuntimeWarning
    )
    return rwkv7, rwkv6


@contextlib.contextmanager
def _ieee_fp32_dots():
    try:
        from triton import knobs

        scope = knobs.language.scope
    except (ImportError, AttributeError):  # older triton: TRITON_F32_DEFAULT is read from the environment
        yield
        return
    with scope():
        knobs.language.fp32_default = "ieee"
        yield


def wkv7_fla(
    r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, a: Tensor, b: Tensor, state: Tensor, chunk_size: int = 16
) -> tuple[Tensor, Tensor]:
    """`kernels.wkv7.wkv7_naive` on fla's kernels: r, k, log_w, a, b [B, T, H, K]; v [B, T, H, V];
    state [B, H, K, V] fp32 [key][value]. Returns (y [B, T, H, V] in r's dtype, new state fp32).
    `chunk_size` 16 (any decay) or 64 (log_w >= RWKV7_LOG_W_MIN, the caller's guarantee)."""
    if chunk_size not in (16, 64):
        raise ValueError(f"chunk_size must be 16 or 64, got {chunk_size}")
    rwkv7, _ = _ops()
    T = r.shape[1]
    with _ieee_fp32_dots():
        if T >= CHUNK_MIN_T:
            gate = dict(safe_gate=True, lower_bound=RWKV7_LOG_W_MIN) if chunk_size == 64 else {}
            y, s = rwkv7.chunk_rwkv7(
                r,
                log_w,
                k,
                v,
                a,
                b,
                scale=1.0,
                initial_state=state,
                output_final_state=True,
                chunk_size=chunk_size,
                **gate,
            )
        else:
            y, s = rwkv7.fused_recurrent_rwkv7(
                r, log_w, k, v, a, b, scale=1.0, initial_state=state, output_final_state=True
            )
    return y.to(r.dtype), s.float()


def wkv6_fla(r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, u: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """`kernels.wkv5.wkv5_naive` on fla's RWKV-6 kernels: r, k [B, T, H, K]; v [B, T, H, V]; log_w
    [B, T, H, K] (RWKV-6) or [H, K] (RWKV-5's constant decay); u [H, K]; state [B, H, K, V] fp32.
    Returns (y [B, T, H, V] in r's dtype, new state fp32)."""
    _, rwkv6 = _ops()
    B, T, H, K = r.shape
    if log_w.dim() == 2:
        log_w = log_w.expand(B, T, H, K).contiguous()
    with _ieee_fp32_dots():
        if T >= CHUNK_MIN_T:
            y, s = rwkv6.chunk_rwkv6(r, k, v, log_w, u, scale=1.0, initial_state=state, output_final_state=True)
        else:
            y, s = rwkv6.fused_recurrent_rwkv6(
                r, k, v, log_w, u, scale=1.0, initial_state=state, output_final_state=True
            )
    return y.to(r.dtype), s.float()
