"""Fused one-token WKV steps in Triton: RWKV-7 and RWKV-5/6 for a batch of B rows, one launch per call.

One program per (batch row, head, block of value columns): it holds the [K, BV] tile of that
head's fp32 state in registers, reads the token's vectors once, updates the tile and writes the
output columns and the tile back. No loop over heads or rows in Python, no dot products (all
products are elementwise with fp32 sums), so the arithmetic is the same in every Triton backend,
the interpreter included. Inputs may be fp32 / fp16 / bf16; everything is computed in fp32.

Graph-safe: no host synchronisation; the only allocations are the outputs, and none at all when
`out=` and `state_out=` are given (`state_out=state` updates the state in place: each program
reads its whole tile before it writes it, and tiles do not overlap). Compile happens on the
first call for a dtype / shape class, so warm up once before capturing a CUDA graph.

The kernels live in `triton_step.py`, imported on the first call, so this module imports on
machines without triton.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# Enough programs to fill a large GPU (an H200 has 132 SMs): below this many (row, head, value
# block) programs the value columns are split finer.
_TARGET_PROGRAMS = 512


def _bh_strides(x: Tensor, name: str, B: int, H: int, D: int) -> tuple[Tensor, int, int]:
    """x as [B, 1, H, D] with a unit stride along D: (tensor, batch stride, head stride)."""
    if tuple(x.shape) != (B, 1, H, D):
        raise ValueError(f"{name}: expected shape {(B, 1, H, D)}, got {tuple(x.shape)}")
    if x.stride(3) != 1:
        x = x.contiguous()
    return x, x.stride(0), x.stride(2)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _blocks(B: int, H: int, K: int, V: int) -> tuple[int, int, int]:
    """(BK, BV, value blocks): the whole key range per program, the value columns split until there
    are enough programs (or blocks of 16)."""
    BK = _pow2(K)
    BV = min(_pow2(V), 64)
    while BV > 16 and B * H * -(-V // BV) < _TARGET_PROGRAMS:
        BV //= 2
    return BK, BV, -(-V // BV)


def tiles_contiguous(s: Tensor) -> bool:
    """Each [K, V] tile of s [..., K, V] is contiguous (what the kernels need of a state)."""
    return s.stride(-1) == 1 and s.stride(-2) == s.shape[-1]


def _state_ok(s: Tensor, B: int, H: int, K: int, V: int) -> bool:
    """fp32 [B, H, K, V] with each [K, V] tile contiguous (rows and heads at any stride: a layer's
    slice of a whole-model state)."""
    return s.dtype == torch.float32 and tuple(s.shape) == (B, H, K, V) and tiles_contiguous(s)


def _outputs(r: Tensor, state: Tensor, B: int, H: int, K: int, V: int, out, state_out) -> tuple[Tensor, Tensor]:
    if not _state_ok(state, B, H, K, V):
        raise ValueError(
            f"state: expected fp32 {(B, H, K, V)} with contiguous [K, V] tiles, got {state.dtype} {tuple(state.shape)}"
        )
    if out is None:
        out = torch.empty(B, 1, H, V, dtype=r.dtype, device=r.device)
    elif tuple(out.shape) != (B, 1, H, V) or out.stride(3) != 1:
        raise ValueError(f"out: expected shape {(B, 1, H, V)} with unit last stride, got {tuple(out.shape)}")
    if state_out is None:
        state_out = torch.empty(B, H, K, V, dtype=torch.float32, device=state.device)
    elif not _state_ok(state_out, B, H, K, V):
        raise ValueError("state_out: expected fp32 [B, H, K, V] with contiguous [K, V] tiles")
    return out, state_out


def wkv7_step(
    r: Tensor,
    k: Tensor,
    v: Tensor,
    log_w: Tensor,
    a: Tensor,
    b: Tensor,
    state: Tensor,
    *,
    out: Tensor | None = None,
    state_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One token of RWKV-7's WKV for B rows: `kernels.wkv7.wkv7_naive` with T = 1, in one launch.

        r, k, log_w, a, b [B, 1, H, K]; v [B, 1, H, V] (any float dtype; any strides with a unit last
        one); state [B, H, K, V] fp32, [key][value], each [K, V] tile contiguous (rows and heads may be
    strided: a layer's view of a whole-model state). Returns (y [B, 1, H, V] in r's dtype,
        new state fp32). Inputs are not modified unless `state_out=state` (in-place update); `out`
        receives y when given.
    """
    B, _, H, K = r.shape
    V = v.shape[-1]
    from .triton_step import wkv7_step_kernel as kernel

    r, sr_b, sr_h = _bh_strides(r, "r", B, H, K)
    k, sk_b, sk_h = _bh_strides(k, "k", B, H, K)
    v, sv_b, sv_h = _bh_strides(v, "v", B, H, V)
    log_w, sw_b, sw_h = _bh_strides(log_w, "log_w", B, H, K)
    a, sa_b, sa_h = _bh_strides(a, "a", B, H, K)
    b, sb_b, sb_h = _bh_strides(b, "b", B, H, K)
    out, state_out = _outputs(r, state, B, H, K, V, out, state_out)
    BK, BV, NV = _blocks(B, H, K, V)
    kernel[(B * H, NV)](
        r, k, v, log_w, a, b, state, out, state_out,
        H, K, V,
        sr_b, sr_h, sk_b, sk_h, sv_b, sv_h, sw_b, sw_h, sa_b, sa_h, sb_b, sb_h, out.stride(0), out.stride(2),
        state.stride(0), state.stride(1), state_out.stride(0), state_out.stride(1),
        BK=BK, BV=BV, num_warps=4 if BV >= 32 else 2,
    )  # fmt: skip
    return out, state_out


def wkv5_step(
    r: Tensor,
    k: Tensor,
    v: Tensor,
    log_w: Tensor,
    u: Tensor,
    state: Tensor,
    *,
    out: Tensor | None = None,
    state_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One token of RWKV-5/6's WKV for B rows: `kernels.wkv5.wkv5_naive` with T = 1, in one launch.

    r, k [B, 1, H, K]; v [B, 1, H, V]; log_w [H, K] (RWKV-5's constant decay) or [B, 1, H, K]
    (RWKV-6's per-token decay); u [H, K]; state [B, H, K, V] fp32 as in `wkv7_step`.
    Returns (y [B, 1, H, V] in r's dtype, new state fp32); `out` / `state_out` as in `wkv7_step`.
    """
    B, _, H, K = r.shape
    V = v.shape[-1]
    from .triton_step import wkv5_step_kernel as kernel

    r, sr_b, sr_h = _bh_strides(r, "r", B, H, K)
    k, sk_b, sk_h = _bh_strides(k, "k", B, H, K)
    v, sv_b, sv_h = _bh_strides(v, "v", B, H, V)
    if log_w.dim() == 2:  # constant: the same decay for every row
        if tuple(log_w.shape) != (H, K):
            raise ValueError(f"log_w: expected shape {(H, K)}, got {tuple(log_w.shape)}")
        log_w = log_w if log_w.stride(1) == 1 else log_w.contiguous()
        sw_b, sw_h = 0, log_w.stride(0)
    else:
        log_w, sw_b, sw_h = _bh_strides(log_w, "log_w", B, H, K)
    if tuple(u.shape) != (H, K):
        raise ValueError(f"u: expected shape {(H, K)}, got {tuple(u.shape)}")
    u = u if u.stride(1) == 1 else u.contiguous()
    out, state_out = _outputs(r, state, B, H, K, V, out, state_out)
    BK, BV, NV = _blocks(B, H, K, V)
    kernel[(B * H, NV)](
        r, k, v, log_w, u, state, out, state_out,
        H, K, V,
        sr_b, sr_h, sk_b, sk_h, sv_b, sv_h, sw_b, sw_h, u.stride(0), out.stride(0), out.stride(2),
        state.stride(0), state.stride(1), state_out.stride(0), state_out.stride(1),
        BK=BK, BV=BV, num_warps=4 if BV >= 32 else 2,
    )  # fmt: skip
    return out, state_out
