"""Native CPU kernels (C++, AVX2 + FMA + F16C), compiled on first use.

    from rwkv_engine.kernels import native
    ops = native.load()          # the compiled module, or None where it cannot be built
    if ops is not None:
        y = ops.gemv_q4(x, qweight, scales, biases)

`load()` JIT-compiles `kernels.cpp` (GEMVs, dequantization), `step.cpp` (the fused decode step of
models/native_step.py) and `bindings.cpp` with `torch.utils.cpp_extension.load` once per machine
and caches the shared library under torch's extension directory (`~/.cache/torch_extensions`, or
`$TORCH_EXTENSIONS_DIR`); later processes only load it (well under a second). The build needs a
C++20 compiler (gcc >= 10) and `ninja` on PATH (`pip install ninja`). On a CPU without
AVX2/FMA/F16C, on a non-x86 machine, or when the build fails, `load()` returns None and logs why
once; every caller then uses its plain-PyTorch path.

The kernels (all take x [B, K] in fp32 / bf16 / fp16 and return [B, N] in x's dtype; B may be
any size, it is processed 8 rows per pass over the weights):

    gemv_dense(x, w)                      w [N, K] fp32 / bf16 / fp16
    gemv_q8(x, qweight, scales)           qweight int8 [N, K], scales fp32 [N, G]
    gemv_q4(x, qweight, scales, biases)   qweight uint8 [N, K/2], scales, biases fp16 [N, G],
                                          group size K/G in (32, 64, 128)
    dequant_q8(qweight, scales, r0, r1, dtype, out=None)          rows r0..r1 as a dense [r1-r0, K] tile
    dequant_q4(qweight, scales, biases, r0, r1, dtype, out=None)  (into `out` when given)
    quantize_q4(weight, group_size, shrinks)  -> (qweight, scales, biases), the bytes of
                                          quant.primitives.quantize_int4 (asymmetric)

The formats are those of `rwkv_engine.quant.primitives`, which is also the reference they are
tested against (tests/test_native_kernels.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = ("bindings.cpp", "kernels.cpp", "step.cpp")
_HEADERS = ("kernels.h", "numeric.h", "pool.h", "simd.h", "step.h")
# Explicit ISA flags rather than -march=native: the cached library then runs on every AVX2
# machine, even when the cache directory is shared between different CPUs.
# -ffp-contract=off: no silent a*b+c -> fma, so quantize_q4 repeats the reference's roundings.
_CFLAGS = ("-O3", "-std=c++20", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-DNDEBUG")
_LDFLAGS = ("-fopenmp",)


def cpu_supported() -> tuple[bool, str]:
    """(ok, reason): whether this CPU can run the kernels."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return False, f"CPU architecture {machine!r} is not x86-64"
    if not torch.cpu._is_avx2_supported():
        return False, "the CPU has no AVX2"
    flags = _cpu_flags()
    if flags is not None and not {"fma", "f16c"} <= flags:
        return False, "the CPU has no FMA or F16C"
    return True, ""


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _build_name() -> str:
    """Extension name, unique per source text and flags so that versions never share a build."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for src in _SOURCES + _HEADERS:
        h.update((here / src).read_bytes())
    h.update(repr((_CFLAGS, _LDFLAGS, torch.__version__)).encode())
    return f"rwkv_engine_native_{h.hexdigest()[:12]}"


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False):
    """The compiled kernel module, or None where it cannot be built or run here (reason logged)."""
    ok, reason = cpu_supported()
    if not ok:
        logger.info("rwkv_engine native kernels disabled: %s", reason)
        return None
    try:
        from torch.utils import cpp_extension

        here = Path(__file__).parent
        name = _build_name()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose))
        os.makedirs(build_dir, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(here / s) for s in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: run without native kernels
        logger.warning("rwkv_engine native kernels unavailable, using PyTorch paths: %s", str(e).strip()[:500])
        return None
