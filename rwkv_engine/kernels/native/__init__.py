"""Native CPU kernels (C++), built per ISA level on first use; the best level the CPU runs is used.

    from rwkv_engine.kernels import native
    ops = native.load()          # the compiled module, or None where it cannot be built
    if ops is not None:
        y = ops.gemv_q4(x, qweight, scales, biases)
        ops.isa()                # the ISA level in use, e.g. "avx512"

`load()` is the one handle to the module: every caller goes through it (tests switch the native
paths off by replacing it). How the kernels are built and cached, and the ISA levels: build.py.
`RWKV_ENGINE_ISA=<level>` (read once, at the first load()) forces a lower level, for A/B runs
and tests; `RWKV_ENGINE_ISA=none` turns the native kernels off. On a CPU without any level, or
when a build fails, `load()` returns None and logs why once; every caller then uses its
plain-PyTorch path.

The kernels (all take x [B, K] in fp32 / bf16 / fp16 and return [B, N] in x's dtype; B may be
any size, it is processed 8 rows per pass over the weights):

    gemv_dense(x, w)                      w [N, K] fp32 / bf16 / fp16
    gemv_q8(x, qweight, scales)           qweight int8 [N, K], scales fp16 [N, G]
    gemv_q4(x, qweight, scales, biases)   qweight uint8 [N, K/2], scales, biases fp16 [N, G],
                                          group size K/G in (32, 64, 128)
    dequant_q8(qweight, scales, r0, r1, dtype, out=None)          rows r0..r1 as a dense [r1-r0, K] tile
    dequant_q4(qweight, scales, biases, r0, r1, dtype, out=None)  (into `out` when given)
    quantize_q4(weight, group_size, shrinks)  -> (qweight, scales, biases), the bytes of
                                          quant.primitives.quantize_int4 (asymmetric)
    quantize_q8(weight, group_size, col_scales) -> (qweight, scales), the bytes of quantize_int8
    column_scales(weight)                 -> fp16 [K], primitives.column_scales (quantize.cpp:
                                          plain C++, all threads)
    wkv7(r, k, v, w, a, b, state)         -> (y, new state): RWKV-7's WKV over [B, T, H, N] fp32,
                                          token by token (step.cpp; kernels/wkv7.py calls it)

The formats are those of `rwkv_engine.quant.primitives`, which is also the reference they are
tested against (tests/test_native_kernels.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil

from .build import (
    ENV,
    LEVELS,
    OPTIONS,
    TUNINGS,
    Level,
    build_kernels,
    choose_level,
    level,
    library_path,
    parse_spec,
    supported_levels,
    tuning,
    tuning_flags,
)

logger = logging.getLogger(__name__)

# Rows of x up to which the per-row GEMV kernels run (8 rows per pass over the weight); above,
# dequantized tiles + GEMM. A row's result depends on which side of it its batch falls, so the
# models and the server split batches at it to keep each row's bits independent of its batch.
# 16: the crossover of benchmarks/bench_kernels.py for bf16, int8 and int4 (docs/performance.md).
GEMV_MAX_ROWS = 16
# Rows of x the GEMVs carry per pass over a weight (kMaxB of kernels.cpp): a forward of up to this
# many rows x tokens reads each weight once; up to GEMV_MAX_ROWS, twice. Speculative passes aim at it.
GEMV_ROWS_PER_READ = 8


@functools.cache
def load(verbose: bool = False):
    """The compiled kernel module using the chosen ISA level, or None where there is none (reason
    logged once)."""
    from . import build

    if shutil.which(build.compiler()) is None:
        logger.warning(
            "rwkv_engine native kernels unavailable, using PyTorch paths: no C++ compiler (%s)", build.compiler()
        )
        return None
    lv, why = choose_level(os.environ.get(ENV))
    if lv is None:
        logger.warning("rwkv_engine native kernels disabled, using PyTorch paths: %s", why)
        return None
    try:
        return build.load_module(lv, verbose)
    except Exception as e:  # no compiler, no ninja, a failed build: run without native kernels
        logger.warning("rwkv_engine native kernels unavailable, using PyTorch paths: %s", str(e).strip()[:500])
        return None


def isa() -> str | None:
    """The ISA level of the native kernels in use, or None where they are off."""
    ops = load()
    return None if ops is None else ops.isa()


_using: list[str] = []  # the specs of the using() blocks entered, innermost last

AMX_MIN_ROWS = 4  # amx.h kMinRows


def amx_min_rows() -> int | None:
    """From how many rows of x a pass of a bf16 GEMV (bf16 weights, x exact in bf16) runs on AMX
    tiles with the kernels in use (amx.cpp: results differ from the vector kernel's in the last
    bits), None where it never does: no AMX (cpuid, as /proc/cpuinfo lists it), not the
    avx512_bf16 level, or a build without '+amx' (opt-in, build.OPTIONS); a '+amx_emulate' build
    runs emulated tiles."""
    from .build import _cpu_features

    name = isa()
    if name is None:
        return None
    lv, tune = parse_spec(_using[-1] if _using else name)
    opts = set(tune.split("+")[1:])
    if lv.name != "avx512_bf16" or "no_amx" in opts:
        return None
    if "amx_emulate" in opts or ("amx" in opts and {"amx_tile", "amx_bf16"} <= (_cpu_features() or set())):
        return AMX_MIN_ROWS
    return None


@contextlib.contextmanager
def using(name: str):
    """Runs the kernels of level `name` ('LEVEL' or 'LEVEL/TUNING', build.parse_spec) inside the
    block (tests, A/B benchmarks), then those in use before. Needs load() to have succeeded and
    the CPU to run the level."""
    ops = load()
    assert ops is not None, "native kernels unavailable"
    before = _using[-1] if _using else ops.isa()
    ops.use_kernels(str(build_kernels(name)))
    _using.append(name)
    try:
        yield ops
    finally:
        _using.pop()
        ops.use_kernels(str(build_kernels(before)))


__all__ = [
    "AMX_MIN_ROWS",
    "ENV",
    "GEMV_MAX_ROWS",
    "GEMV_ROWS_PER_READ",
    "LEVELS",
    "OPTIONS",
    "TUNINGS",
    "Level",
    "build_kernels",
    "choose_level",
    "isa",
    "level",
    "amx_min_rows",
    "library_path",
    "load",
    "parse_spec",
    "supported_levels",
    "tuning",
    "tuning_flags",
    "using",
]
