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

import contextlib
import contextvars
import ctypes
import functools
import math
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


_libc = None


def release_free_memory() -> None:
    """Give the pages of freed heap memory back to the system (glibc's malloc_trim), also those in
    the middle of the heap. With the raised thresholds, a load that keeps each result and frees
    each transient leaves holes that later, larger transients do not fit: the heap grew to 2.5x
    the model when a 7B checkpoint was quantized on load. Nothing off glibc."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc(0)


HUGE_PAGE = 2 << 20  # x86-64 / most aarch64 Linux
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


HUGE_PAGES_ENV = "RWKV_ENGINE_HUGE_PAGES"
# The mode a caller asks for where the user set none (`huge_pages_default`): a context variable,
# so that one load's choice reaches the tensors it copies and no other load's.
_huge_pages_default: contextvars.ContextVar[str | None] = contextvars.ContextVar("huge_pages_default", default=None)


@contextlib.contextmanager
def huge_pages_default(mode: str | None):
    """Within the block (a load), the huge-page mode is `mode` ("1", "0" or "private"; None: on)
    unless the user set RWKV_ENGINE_HUGE_PAGES, which wins."""
    if mode not in (None, "1", "0", "private"):
        raise ValueError(f"huge pages: expected '1', '0' or 'private', got {mode!r}")
    token = _huge_pages_default.set(mode)
    try:
        yield
    finally:
        _huge_pages_default.reset(token)


def huge_pages_available(mapped: bool = False) -> bool:
    """Whether weights go to transparent huge pages: Linux with THP not "[never]", unless the user
    set RWKV_ENGINE_HUGE_PAGES=0; with RWKV_ENGINE_HUGE_PAGES=private only weights that are the
    process's own anyway (a checkpoint's, transformed at load), not those `mapped` from a converted
    directory, which processes on one machine share through the page cache (Ray replicas).
    Without the variable, the mode of the enclosing `huge_pages_default`, else on."""
    mode = os.environ.get(HUGE_PAGES_ENV) or _huge_pages_default.get() or "1"
    if mode == "0" or (mapped and mode == "private"):
        return False
    return _thp_enabled()


@functools.cache
def _thp_enabled() -> bool:
    """The system's THP setting, read once (a load asks for every tensor)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(_THP_ENABLED) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_empty(shape, dtype):
    """An uninitialized CPU tensor in its own anonymous mapping, 2 MB-aligned and advised
    MADV_HUGEPAGE, so the kernel backs it with huge pages where it can (the THP "madvise" mode
    of most distributions serves only such regions). The mapping lives as long as the tensor.

    Why: a decode step streams every weight once, and with 4 KB pages a GEMV's reads walk a new
    page (and a TLB miss) every 4 KB. Measured on a Zen 4 (2 threads, our bf16 GEMV over 1.6 GB
    of weights, alternating rounds): 38.7-40.6 GB/s on ordinary pages, 44.9-47.4 on huge pages.
    """
    import mmap

    import torch

    numel = math.prod(int(n) for n in shape)
    nbytes = numel * dtype.itemsize
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    offset = -base % HUGE_PAGE
    _madvise(base + offset, nbytes, _MADV_HUGEPAGE)
    # torch.frombuffer keeps `m` alive for as long as the tensor (or a view of it) is.
    return torch.frombuffer(m, dtype=dtype, count=numel, offset=offset).view(*shape)


def to_huge_pages(t, min_bytes: int = HUGE_PAGE, mapped: bool = False):
    """A copy of the CPU tensor t on huge pages (`huge_page_empty`), or t itself where they are
    unavailable (see huge_pages_available, and `mapped` there), for tensors under min_bytes, and
    for other devices."""
    import torch

    if (
        not isinstance(t, torch.Tensor)
        or t.device.type != "cpu"
        or t.numel() * t.element_size() < min_bytes
        or not huge_pages_available(mapped)
    ):
        return t
    out = huge_page_empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def huge_page_bytes() -> int | None:
    """Bytes of this process's memory on transparent huge pages (Linux), else None."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_pages(t) -> None:
    """Drop the resident pages of a tensor in a read-only file mapping (Linux; they are read again
    from the page cache if touched). Never on memory that holds the only copy of its data.

    Converting a checkpoint, or copying a directory's mapped weights to huge pages, touches every
    page of the mapped file; without this, the file's pages and the result would both count in
    memory until the load returns.
    """
    import mmap

    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    page = mmap.PAGESIZE
    # Whole pages, the partial ones at both ends included: a page shared with a neighbouring
    # tensor is only dropped from this process (the file mapping is never written), and is read
    # again from the page cache if that tensor is used later.
    lo, hi = start // page * page, -(-end // page) * page
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_DONTNEED)


def _madvise(addr: int, length: int, advice: int) -> None:
    global _libc_madvise
    if _libc_madvise is None:
        try:
            _libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
            _libc_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        except (OSError, AttributeError):
            _libc_madvise = False
    if _libc_madvise:
        _libc_madvise(addr, length, advice)  # advice only: a kernel without THP ignores it


_libc_madvise = None


class FileRows:
    """Rows of a row-major 2-D tensor stored at `offset` in a file, read with pread.

    A model directory's embedding is memory-mapped like its other tensors, but a prompt needs
    only its own tokens' rows of it. Looking them up through the mapping charges the process
    with far more than that: on a file cached in large folios (ext4 on recent kernels) one fault
    maps up to a whole folio, and a 512-token prompt of random ids put about 185 MB of the 1.5B
    shape's 256 MB embedding into the peak RSS, where the rows themselves are 2 MB. Reading the
    rows with pread copies just them into the result; the file's pages stay in the page cache,
    shared and not charged to the process. One syscall per row: about a microsecond, against
    tens of milliseconds per token for the rest of the model.
    """

    def __init__(self, path: str | os.PathLike, offset: int, shape: tuple[int, int], dtype, source):
        import torch

        self.path = str(path)
        self.offset = offset
        self.shape = shape
        self.dtype = dtype
        self.row_bytes = shape[1] * torch.empty((), dtype=dtype).element_size()
        self._source = source.data_ptr()  # the mapped tensor these rows stand for
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    @staticmethod
    def available() -> bool:
        return hasattr(os, "preadv")

    def serves(self, weight) -> bool:
        """Whether `weight` is still the mapped tensor of the file (not moved, cast or replaced)."""
        return self._fd >= 0 and weight.device.type == "cpu" and weight.data_ptr() == self._source

    def read(self, ids):
        """Rows ids[...] -> tensor [*ids.shape, C] (ids must be in range)."""
        import torch

        flat = ids.reshape(-1).tolist()
        V = self.shape[0]
        bad = [i for i in flat if not 0 <= i < V]
        if bad:
            raise IndexError(f"token id {bad[0]} out of range for an embedding of {V} rows")
        out = torch.empty(len(flat), self.shape[1], dtype=self.dtype)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        rb = self.row_bytes
        for j, i in enumerate(flat):
            got = os.preadv(self._fd, [view[j * rb : (j + 1) * rb]], self.offset + i * rb)
            if got != rb:
                raise OSError(f"{self.path}: short read of embedding row {i} ({got} of {rb} bytes)")
        return out.reshape(*ids.shape, self.shape[1])

    def __getstate__(self):  # copies and pickles open the file anew (never share the descriptor)
        return {k: v for k, v in self.__dict__.items() if k != "_fd"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        try:
            self._open()
        except FileNotFoundError:  # a spilled table's file is unlinked: the copy reads its own weight
            self._fd = -1

    def close(self, _close=os.close) -> None:  # (bound now: at interpreter exit the module's os may be gone)
        if getattr(self, "_fd", -1) >= 0:
            _close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()


SPILL_MIN_BYTES = 64 << 20  # smaller tables stay in memory


def spill(t, directory: str | None = None):
    """(the tensor t backed by an unlinked temporary file, FileRows over it), or (t, None).

    A checkpoint's embedding is computed at load (ln0 folded in, docs/formats.md A.7), so unlike a model
    directory's it has no file to be read from: held in memory it is 0.5 GB of the 7B shape's
    5.5 GB budget for q4, while a prompt needs a few of its rows. Spilled, its pages live in the
    page cache (clean, reclaimable, not charged to the process) and rows are read with pread, as
    from a model directory. The mapping is shared, so an in-place change of the weight is what
    the rows read. The file is in `directory` (default: tempfile's, i.e. $TMPDIR or /tmp) and has
    no name once mapped; on a tmpfs it still occupies memory, but no less than it would in the
    process. Where the platform lacks pread or the table is small, t is returned as it is.
    """
    import tempfile

    import torch

    nbytes = t.numel() * t.element_size()
    if not FileRows.available() or t.device.type != "cpu" or t.dim() != 2 or nbytes < SPILL_MIN_BYTES:
        return t, None
    t = t.contiguous()
    fd, path = tempfile.mkstemp(prefix="rwkv-engine-emb-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(t.view(torch.uint8).numpy()).cast("B"))
        mapped = torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype).view(t.shape)
        rows = FileRows(path, 0, tuple(t.shape), t.dtype, mapped)
    except (OSError, RuntimeError):  # no room or no writable temporary directory: keep it in memory
        return t, None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return mapped, rows
