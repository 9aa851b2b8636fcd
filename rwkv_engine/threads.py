"""One OpenMP team at a time: why the serving engine frees the other threads' OpenMP workers.

PyTorch's CPU operators run their parallel loops on OpenMP (GNU libgomp in the Linux wheels).
Every thread that opens a parallel region gets a team of its own: worker threads that live as
long as that thread does. Between two regions a worker spins, ready for the next one, but only
while the process's OpenMP threads are no more than its CPUs; past that libgomp lets it spin for
a moment only, and then each region waits for its workers to wake from sleep.

A server loads its model on the main thread (one team: the main thread and a worker) and runs it
on the engine thread (a second team): four OpenMP threads on a two-core machine, and from then on
every region of the engine pays a wake-up. A forward is hundreds of small regions, so a prompt
piece ran at about half the speed of the same piece on the main thread. Measured on an AMD
Zen 5 (family 26 model 2), 2 threads, the 0.1B RWKV-7 shape in bf16: a 64-token prefill took
37 ms on a thread alone and 89 ms on the same thread once the main thread had run a single
parallel region; a [64, 768] add, 3.5 us against 44.5 us.

`release_openmp_threads()` frees the calling thread's team (its workers exit; a later region on
that thread starts them again), so the engine's is the only team left: `Engine.start` frees the
caller's (which loaded the model), and the server's helper threads that may run tensor code
free theirs after each job (`releasing`).

The native kernels run on a pool of their own (kernels/native/pool.h), whose helpers spin for
200 us after a call. libgomp's workers spin for 300,000 pauses after a region (milliseconds),
so after each of PyTorch's regions (a decode step's sampling, say) the OpenMP worker kept a core
busy well into the native step that followed, where the pool's helper needed it. `OPENMP_SPIN`
(10,000 pauses, about 0.1-0.4 ms: longer than the gaps between two operators of a forward) is
what the `rwkv-engine` command sets, unless the environment chooses (`configure_openmp`; Ray's
replicas get it in their actor's environment, `openmp_env`): on
the Zen 5 above, a 16-row decode step then took 15.6-15.9 ms instead of 20.6-20.9, and prompt
pieces took as long as before (32 tokens: 25.0-25.2 ms against 25.1-25.3).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
from collections.abc import Callable
from typing import TypeVar

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what is cheap to keep

# libgomp's spin before a waiting worker sleeps, in pauses (its default: 300,000)
OPENMP_SPIN = 10_000


def openmp_env() -> dict[str, str]:
    """The environment a process that will run the engine should start with (`configure_openmp`'s
    setting), for processes not started through the `rwkv-engine` command (Ray's replicas); none
    where this process's environment chooses a spin or wait policy (its processes inherit it)."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": str(OPENMP_SPIN)}


def configure_openmp() -> bool:
    """Set libgomp's spin (GOMP_SPINCOUNT = OPENMP_SPIN) for this process, where torch is not
    loaded yet (libgomp reads it when it loads) and neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY
    is set (the user's choice wins). True where it was set."""
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN)
    return True


T = TypeVar("T")


@functools.cache
def _runtime_libraries() -> tuple[ctypes.CDLL, ...]:
    """The process's own symbols and the OpenMP runtimes torch mapped (Linux)."""
    candidates: list[ctypes.CDLL] = []
    try:
        candidates.append(ctypes.CDLL(None))  # the runtime torch loaded, when its symbols are global
    except OSError:
        pass
    try:  # else the libgomp / libomp torch mapped (Linux)
        with open("/proc/self/maps") as f:
            paths = sorted(set(re.findall(r"/\S*lib(?:gomp|iomp5|omp)[^/\s]*\.so[^/\s]*", f.read())))
        for path in paths:
            try:
                candidates.append(ctypes.CDLL(path))
            except OSError:
                pass
    except OSError:
        pass
    return tuple(candidates)


def _function(name: str, argtypes: list, restype, libraries=None) -> Callable | None:
    """The C function `name` of the OpenMP runtime (or of `libraries`), or None where there is none."""
    for lib in _runtime_libraries() if libraries is None else libraries:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
            return fn
    return None


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """The OpenMP runtime's omp_pause_resource_all (OpenMP 5.0), or None where there is none."""
    return _function("omp_pause_resource_all", [ctypes.c_int], ctypes.c_int)


@functools.cache
def _thread_setters() -> tuple[Callable, Callable | None] | None:
    """(omp_set_num_threads, MKL's thread-local count setter or None), or None without OpenMP."""
    import torch

    if not torch.backends.openmp.is_available():
        return None
    omp = _function("omp_set_num_threads", [ctypes.c_int], None)
    if omp is None:
        return None
    mkl = None
    if torch.backends.mkl.is_available():  # (MKL is linked into libtorch_cpu)
        try:
            torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        except OSError:
            torch_cpu = None
        if torch_cpu is not None:  # the C entry point (the lower-case symbol is the Fortran one here)
            mkl = _function("MKL_Set_Num_Threads_Local", [ctypes.c_int], ctypes.c_int, [torch_cpu])
    return omp, mkl


def use_threads(n: int) -> None:
    """Run the calling thread's tensor work on n threads from now on, other threads unchanged.

    OpenMP's thread count (which PyTorch's operators, oneDNN and the native kernels' pool read)
    is a setting of each thread; `torch.set_num_threads` sets it for the caller too, but also
    sets the process-wide count PyTorch gives threads that start later and clears its cache of
    oneDNN computations. Here: OpenMP's and MKL's thread-local counts only. Where the runtime
    has no such calls, `torch.set_num_threads`."""
    import torch

    torch.get_num_threads()  # PyTorch sets a thread's count at its first parallel work: do that first
    setters = _thread_setters()
    if setters is None:
        torch.set_num_threads(n)
        return
    omp, mkl = setters
    omp(n)
    if mkl is not None:
        mkl(n)


def release_openmp_threads() -> bool:
    """Free the OpenMP worker threads of the calling thread's team; a later parallel region of
    this thread starts them again. True where the runtime did; False where it has no such call
    (or refused: inside a parallel region). Call it where a thread's tensor work is done and
    another thread's begins."""
    import torch  # (the runtime must be loaded before it is looked for)

    if not torch.backends.openmp.is_available():
        return False
    fn = _pause_all()
    return fn is not None and fn(_OMP_PAUSE_SOFT) == 0


def releasing(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` that frees its thread's OpenMP workers when it returns (for jobs run on helper
    threads, e.g. `asyncio.to_thread`, that may run tensor code beside the engine thread)."""

    @functools.wraps(fn)
    def run(*args, **kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            release_openmp_threads()

    return run
