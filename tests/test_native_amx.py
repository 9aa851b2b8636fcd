"""AMX tiles for the batched GEMVs of bf16 weights (kernels/native/amx.cpp).

- Everywhere the avx512_bf16 level runs: the build whose tile instructions are scalar loops
  (`+amx_emulate`, with the hardware's configuration checks) against the PyTorch product and the
  vector kernel, over the edges of the tiling (row blocks under 16 rows, panels of 1-4 blocks,
  K past the last 32-column step, K under one step, passes of 4-8 rows of x, a pass under
  amx.kMinRows on the vector kernel), and batch invariance within the tile path.
- On a CPU with AMX (cpuid amx_tile + amx_bf16): the same cases on the real tiles (the level in
  use) against the vector kernel of a `+no_amx` build. Skipped elsewhere (this says why).
"""

from __future__ import annotations

import pytest
import torch

from rwkv_engine.kernels import native
from rwkv_engine.kernels.native import build

from .test_native_kernels import rel_rms

# (N, K): row blocks 2 + 5 rows; 4 + 1 blocks + 3 rows; 8 full blocks; a 40-column K (one step and
# 8 columns past it); 16 columns (no step); a 1.5B model's shape
SHAPES = [(37, 96), (83, 64), (128, 40), (21, 16), (7, 2048), (256, 2048)]
BATCHES = (3, 4, 5, 8, 12, 16)


def _runnable(spec: str) -> str:
    if native.load() is None:
        return "native kernels unavailable here (see log)"
    why = dict((lv.name, why) for lv, why in native.supported_levels()).get("avx512_bf16", "not an x86 CPU")
    return f"avx512_bf16: {why}" if why else ""


def _check(spec_tiles: str, spec_vector: str):
    g = torch.Generator().manual_seed(5)
    for N, K in SHAPES:
        w = torch.randn(N, K, generator=g).bfloat16()
        x = torch.randn(16, K, generator=g).bfloat16()
        ref = x.float() @ w.float().T
        with native.using(spec_vector) as ops:
            assert native.amx_min_rows() is None
            vector = ops.gemv_dense(x, w)
            alone = torch.cat([ops.gemv_dense(x[i : i + 1], w) for i in range(16)])
        with native.using(spec_tiles) as ops:
            rows = native.amx_min_rows()
            assert rows == 4
            tiled = ops.gemv_dense(x, w)  # two passes of 8 rows: tiles
            # y in x's dtype: the fp32 sums rounded to bf16 (a wrong tile or packing is off by O(1))
            assert rel_rms(tiled, ref) < 2e-3, (N, K)
            assert rel_rms(tiled, vector) < 2e-3, (N, K)
            for B in BATCHES:
                y = ops.gemv_dense(x[:B], w)
                for b0 in range(0, B, 8):  # passes of 8 rows; a short one on the vector kernel
                    b1 = min(B, b0 + 8)
                    expected = tiled if b1 - b0 >= rows else alone
                    assert torch.equal(y[b0:b1], expected[b0:b1]), (N, K, B, b0)


def test_emulated_amx_tiles_match_the_reference():
    why = _runnable("avx512_bf16")
    if why:
        pytest.skip(why)
    _check("avx512_bf16/int256+amx_emulate", "avx512_bf16/int256")


def test_amx_tiles_on_this_cpu_match_the_vector_kernel():
    why = _runnable("avx512_bf16")
    if not why and not {"amx_tile", "amx_bf16"} <= (build._cpu_features() or set()):
        why = "this CPU has no AMX (amx_tile, amx_bf16): only the emulated tiles ran"
    if why:
        pytest.skip(why)
    _check("avx512_bf16/+amx", "avx512_bf16/+no_amx")


def test_amx_options_are_build_flags():
    assert native.tuning_flags("int256+amx_emulate") == ("-DRWKV_AMX_EMULATE",)
    assert native.tuning_flags("int512+no_amx") == (
        "-DRWKV_INT8_512",
        "-DRWKV_INT4_512",
        "-DRWKV_KQ_512",
        "-DRWKV_NO_AMX",
    )
    # AMX is opt-in: a default build has no tile path, '+amx' adds it
    assert native.tuning_flags("int512") == ("-DRWKV_INT8_512", "-DRWKV_INT4_512", "-DRWKV_KQ_512", "-DRWKV_NO_AMX")
    assert native.tuning_flags("int512+amx") == ("-DRWKV_INT8_512", "-DRWKV_INT4_512", "-DRWKV_KQ_512")
    assert native.parse_spec("avx512_bf16/+no_amx")[1] == native.tuning("avx512_bf16") + "+no_amx"
    with pytest.raises(ValueError):
        native.tuning_flags("int256+amx_magic")
