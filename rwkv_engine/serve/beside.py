"""Prompt pieces read beside the decode steps: a thread of the engine's own, on its own share of
the cores (`Engine`, `--prefill-threads`).

On a CPU the engine's two kinds of model work need not take turns. While streams decode and
prompts wait, the engine thread runs the decode steps on some of the threads and this worker
reads one prompt piece at a time on the others; the streams' tokens then never wait for a
prompt, and a prompt is read in whole chunks (the efficient shape) instead of in pieces cut to a
share of a decode step. Measured on an AMD Zen 5 (family 26 model 2), 2 cores, the 0.1B RWKV-7
shape in bf16, one process, decode steps and 128-token prefills in loops of their own, 5 s a
side: a 16-row step took 15.7-17.8 ms on both threads and a 128-token prefill 58-73 ms; on one
thread each, side by side, steps took 27-36 ms (p99 35-40) and prefills 98-109 ms, together
0.96-1.35x the work of the two on both threads in turn (4 rows: steps 13.7-14.5 ms, p99 19-22,
1.25-1.39x). One thread is close to as fast as two for these small operators, and neither side
waits for the other's parallel regions.

The worker only runs a piece's forward (`Prefill.step`); the engine thread hands it the work,
takes the piece back and does all the bookkeeping, so the scheduler's structures stay the
engine thread's own. The work in flight is the worker's until it comes back (`Engine._piece`).
A piece's bits do not depend on which thread or how many threads read it where the model's
operators give the same bits on any thread count; `Engine` checks that at warm-up, and where
they do not (oneDNN's AMX bf16 GEMMs: their blocking follows the thread count), the engine
thread reads its pieces in turns on this worker's count as well, so that no answer depends on
the load.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..threads import release_openmp_threads, use_threads
from .work import Prefill


class Piece:
    """A piece in flight: its work, and once `done`, the tokens read (`n`) or the `error`."""

    def __init__(self, work: Prefill, run: Callable[[], int]):
        self.work, self.run = work, run
        self.n = 0
        self.error: Exception | None = None
        self.seconds = 0.0
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()


class PieceWorker:
    """One thread reading the pieces it is given, one at a time, on `threads` threads."""

    def __init__(self, threads: int, name: str):
        self.threads = threads
        self._cond = threading.Condition()
        self._next: Piece | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"{name} prefill", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, work: Prefill, run: Callable[[], int]) -> Piece:
        """Read `run()` (a piece of `work`) on the worker; at most one piece at a time."""
        piece = Piece(work, run)
        with self._cond:
            if self._next is not None:
                raise RuntimeError("a piece is already waiting for the prefill thread")
            self._next = piece
            self._cond.notify()
        return piece

    def stop(self, timeout: float | None = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        use_threads(self.threads)
        try:
            while True:
                with self._cond:
                    while self._next is None and not self._stopping:
                        self._cond.wait()
                    if self._next is None:
                        return
                    piece, self._next = self._next, None
                t = time.perf_counter()
                try:
                    piece.n = piece.run()
                except Exception as e:  # the engine thread fails the piece's requests
                    piece.error = e
                piece.seconds = time.perf_counter() - t
                piece._done.set()
        finally:
            release_openmp_threads()
