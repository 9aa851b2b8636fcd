"""The prompt cache's states on disk (`--state-store DIR`): conversations that survive a restart.

An RNN's whole conversation is one fixed-size state (12.6 MB for RWKV-7 1.5B), so the states the
prompt cache keeps in memory (serve/engine.py, `PromptCache`) can also go to disk for a few MB
each: a server restarted on the same directory, or another replica sharing it (the Ray
deployment's replicas on one machine or a shared file system), resumes a conversation from the
state after its longest cached chunk prefix instead of reading the conversation again.

The interface is the one `PromptCache` calls:

    store = StateStore(root, capacity_bytes, model_key(model), check=lambda s: s.check_usable(model, probe=False))
    store.put(start_key, prefix_ids, state)   # queued; written by the store's own thread
    store.get(start_key, prefix_ids)          # the State, or None (absent, or not fit to serve)
    store.close()                             # writes what is queued, stops the thread

Files: one safetensors file per state, named by a hash of (model key, start key, token ids), so
that a lookup is one `stat` per candidate prefix. Besides the state's tensors a file holds the
prefix's token ids; its metadata names the format, the model key, the start key and a SHA-256 of
every tensor's bytes. A file is served only when all of that matches what was looked up: a
truncated or corrupt file, a file of another model (`model_key`: the state signature, the device
kind and a fingerprint of the weights as loaded, so a q8 server never resumes a bf16 server's
state) or of another prefix is skipped with one warning on stderr and never served. Files are
written to a temporary name and renamed, so a reader never sees half a file. What is served is
then checked for the model's state layout and finite values; not by a forward from it (the check
`State.check_usable` makes of a state file of unknown origin): a file whose checksum and model key
hold is a state this model computed (that forward was 50-70 ms of a 0.1B model's resumed first
token, against about 120 ms for the whole warm one).

Capacity: the files of the directory are kept under `capacity_bytes`; after a write, the least
recently used files (by modification time: a hit touches its file) are deleted. Several
processes may share a directory: each counts what it sees on disk, not only what it wrote.

Writes never block the engine thread: `put` queues the state (a reference: states are values,
nothing modifies them after the prompt cache took them) and returns; when the writer is more than
`max_pending` states behind, new states are dropped (counted) rather than queued. Reads run on the
caller's thread (the engine's, at a prompt-cache miss): one file read and a hash, milliseconds for
a state of a few MB.

Bit for bit: a state read back is the state that was written, so a resumed prompt gives the
answer a cold prefill gives on the same model files, dtype, quantization and kernels. A replica on
another CPU (another ISA level) or device computes its own answers within rounding of those.
"""

from __future__ import annotations

import hashlib
import os
import queue
import sys
import threading
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..state import State
from ..threads import release_openmp_threads

FORMAT = "rwkv-engine-prompt-state/1"
SUFFIX = ".state.safetensors"
_IDS = "prompt_ids"  # the tensor of the prefix's token ids
_FIELD = "state."  # the prefix of the state's tensors


def model_key(model) -> str:
    """What a stored state must have been computed with to be served by `model`: its state
    signature, device kind, dtype and a fingerprint of its weights as loaded (a strided sample of
    every tensor, with names, dtypes and shapes: any other checkpoint, quantization or dtype
    differs, and it costs milliseconds)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
        if t.numel():  # 64 elements spread over the tensor, gathered without copying it whole
            where = torch.linspace(0, t.numel() - 1, min(t.numel(), 64), dtype=torch.float64).long()
            sample = t[torch.unravel_index(where, t.shape)] if t.dim() else t.reshape(1)
            h.update(sample.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    signature = model.config.state_signature()
    return f"{signature}:{model.device.type}:{model.dtype}:{h.hexdigest()[:16]}"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class StateStore:
    """See the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike,
        capacity_bytes: int,
        model_key: str,
        check: Callable[[State], None] | None = None,
        name: str = "rwkv-engine serve",
        max_pending: int = 64,
        count: Callable[[str, int], None] | None = None,
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self.model_key = model_key
        self._check = check
        self._name = name
        self._on_count = count  # called with "hits", "writes", ... (e.g. the server's metrics)
        self.counts = {"hits": 0, "writes": 0, "skipped": 0, "dropped": 0, "evicted": 0}
        self._warned: set[str] = set()
        self._lock = threading.Lock()  # counts, _warned, _bytes
        self._bytes = sum(size for _, size, _ in self._files())
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._write_loop, name="rwkv-engine-state-store", daemon=True)
        self._thread.start()

    # --- the interface PromptCache calls -----------------------------------------------------------

    def path(self, start_key: str, prefix: Sequence[int]) -> Path:
        h = hashlib.sha256(f"{self.model_key}\0{start_key}\0".encode())
        h.update(array("q", prefix).tobytes())
        return self.root / (h.hexdigest()[:40] + SUFFIX)

    def put(self, start_key: str, prefix: Sequence[int], state: State) -> None:
        """Queue `state` (the state after `prefix` from `start_key`) to be written; never blocks."""
        try:
            self._queue.put_nowait((start_key, list(prefix), state))
        except queue.Full:
            self._count("dropped")

    def get(self, start_key: str, prefix: Sequence[int]) -> State | None:
        """The stored state after `prefix`, or None: no file, or one that is not fit to be served
        (skipped with a warning)."""
        path = self.path(start_key, prefix)
        if not path.exists():
            return None
        try:
            state = self._read(path, start_key, prefix)
        except Exception as e:  # a bad file of any kind: never served, never fatal
            if path.exists():  # (not one that another server evicted meanwhile)
                self._skip(path, str(e) or type(e).__name__)
            return None
        try:
            os.utime(path)  # recently used
        except OSError:
            pass
        self._count("hits")
        return state

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._thread.is_alive():
            self._queue.put((None, None, None))
            self._thread.join(timeout)

    def flush(self) -> None:
        """Wait until every state queued so far is written (tests)."""
        self._queue.join()

    def gauges(self) -> dict[str, float]:
        with self._lock:
            return {"state_store_bytes": self._bytes, "state_store_capacity_bytes": self.capacity}

    # --- reading and writing ------------------------------------------------------------------------

    def _read(self, path: Path, start_key: str, prefix: Sequence[int]) -> State:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"not a readable safetensors file ({e})") from None
        if meta.get("format") != FORMAT:
            raise ValueError("not a prompt-state file")
        if meta.get("model") != self.model_key:
            raise ValueError(f"a state of another model ({meta.get('model')}; this server: {self.model_key})")
        if meta.get("sha256") != _digest(tensors):
            raise ValueError("its contents do not match their checksum (corrupt)")
        ids = tensors.pop(_IDS, None)
        if meta.get("start") != start_key or ids is None or ids.tolist() != list(prefix):
            raise ValueError("a state of another prompt")
        fields = meta.get("fields", "").split(",")
        if set(fields) != {k[len(_FIELD) :] for k in tensors}:
            raise ValueError("its fields are not the ones its metadata names")
        state = State({k: tensors[_FIELD + k] for k in fields}, meta.get("signature", ""))
        if self._check is not None:
            self._check(state)  # the served model's fields, shapes, dtypes; finite values
        return state

    def _write_loop(self) -> None:
        while True:
            start_key, prefix, state = self._queue.get()
            try:
                if state is None:
                    return
                self._write(start_key, prefix, state)
            except Exception as e:  # a full disk, a removed directory: the cache goes on in memory
                self._warn(f"could not write a state to {self.root} ({e})")
            finally:
                release_openmp_threads()  # (no OpenMP team beside the engine's: rwkv_engine/threads.py)
                self._queue.task_done()

    def _write(self, start_key: str, prefix: list[int], state: State) -> None:
        from safetensors.torch import save_file

        path = self.path(start_key, prefix)
        if path.exists():
            os.utime(path)
            return
        tensors = {_FIELD + k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        tensors[_IDS] = torch.tensor(prefix, dtype=torch.int64)
        meta = {
            "format": FORMAT,
            "model": self.model_key,
            "signature": state.signature,
            "start": start_key,
            "fields": ",".join(state.fields),
            "sha256": _digest(tensors),
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._bytes += path.stat().st_size
            over = self._bytes > self.capacity
        self._count("writes")
        if over:
            self._evict()

    def _files(self) -> list[tuple[Path, int, int]]:
        """(path, size, mtime in ns) of the directory's state files."""
        out = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                try:
                    st = entry.stat()
                except OSError:
                    continue  # removed meanwhile (another process evicted it)
                out.append((Path(entry.path), st.st_size, st.st_mtime_ns))
        return out

    def _evict(self) -> None:
        """Delete the least recently used files until the directory holds at most `capacity` bytes
        (counted anew from the directory: other processes may write to it too)."""
        files = sorted(self._files(), key=lambda f: f[2])
        total = sum(size for _, size, _ in files)
        evicted = 0
        for path, size, _ in files:
            if total <= self.capacity:
                break
            try:
                path.unlink()
                evicted += 1
            except FileNotFoundError:
                pass
            total -= size
        with self._lock:
            self._bytes = total
        self._count("evicted", evicted)

    # --- bookkeeping ----------------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n
        if self._on_count is not None and n:
            self._on_count(name, n)

    def _skip(self, path: Path, why: str) -> None:
        self._count("skipped")
        self._warn(f"state store: skipped {path} ({why}); it is not served", once=str(path))

    def _warn(self, message: str, once: str | None = None) -> None:
        with self._lock:
            if once is not None:
                if once in self._warned:
                    return
                self._warned.add(once)
        print(f"{self._name}: warning: {message}", file=sys.stderr, flush=True)
