"""Process memory settings for inference (Linux / glibc).

A forward pass allocates and frees the same large temporaries over and over (a prefill piece's
activations are tens of MB; a decode step's new state is 12 MB at the 1.5B shape). glibc serves
allocations above its mmap threshold with fresh mappings and gives them back on free, so each
one is paid again in page faults and zeroed pages: about 180,000 faults for one 512-token
prefill of the 1.5B shape, 10-15% of its time. `tune_malloc()` raises the mmap and trim
thresholds to 1 GiB, so freed blocks stay in the heap and are reused (measured: 3,000-90,000
faults, prefill 43 -> 49 tok/s, peak RSS unchanged or lower). `rwkv_engine.load` calls it once.
It does nothing off glibc, or when the user has set MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ / GLIBC_TUNABLES, or RWKV_ENGINE_MALLOC=0.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30
_done = False


def tune_malloc() -> bool:
    """Raise glibc's mmap / trim thresholds once per process; whether it did."""
    global _done
    if _done:
        return False
    _done = True
    user_set = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
    if not sys.platform.startswith("linux") or any(k in os.environ for k in user_set):
        return False
    if os.environ.get("RWKV_ENGINE_MALLOC", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _THRESHOLD))
