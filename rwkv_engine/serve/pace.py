"""How many prompt tokens a turn of the engine may prefill (`Engine._turn`), from how long its
work takes: the decoding streams wait for a turn's prefill between two of their tokens.

While no row decodes, a turn prefills the whole `--prefill-chunk`: nobody waits for it but the
prompts themselves. While rows decode, a turn's prefill gets about `share` times the time of a
decode step: `share x decode step seconds / prefill seconds per token` tokens, at least one
WKV_CHUNK (the shortest piece a prompt can be cut to, `prefill_piece_end`) and at most the
chunk. So the gap between two tokens of a stream is about (1 + share) decode steps, on any
model and machine, instead of one decode step plus a whole chunk (issue 38: on a 0.1B model on
two cores, inter-token latency p99 1402 ms against a p50 of 45 ms). This is the scheduler half of vLLM's and
SGLang's chunked prefill, whose per-step token budget is fixed: here it is a time, measured.

A prompt waiting for its first token weighs as much as a stream waiting for its next one: while
more prompts are being read than rows decode, the share is multiplied by prompts / rows (still at
most the chunk). Without that, a burst of prompts (64 clients at once) was read at one decode
step's worth a turn while a few rows decoded: the queue drained slowly, in short, costly pieces
(a 32-token piece of the 0.1B model costs about as much as 128 tokens read at once), and the last
first token came after 116 s against llama-server's 18 s (issue 38, 0.1B, 64 streams).

Both times are running estimates (exponential moving averages) of what the engine measured:
every turn's prefill seconds per token read, every decode step's seconds. Until both have been
measured the budget is the whole chunk, as it is with `share` 0 (the budget off).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..models.model import WKV_CHUNK


def device_clock(device: torch.device) -> Callable[[], float]:
    """`time.perf_counter`, on a GPU after the work queued on it: a prefill's kernels run after
    its `forward` returns, so without the wait its time would be counted in the next decode step
    (whose sampling waits for them)."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


class PrefillPace:
    """A turn's prefill budget in tokens (`budget`), from the measured prefill and decode times
    (`prefilled`, `decoded`). smoothing: the weight of a new measurement in its estimate."""

    def __init__(self, chunk: int, share: float, smoothing: float = 0.25):
        self.chunk, self.share, self.smoothing = chunk, share, smoothing
        self.floor = min(chunk, WKV_CHUNK)
        self.token_seconds: float | None = None  # prefill seconds per token
        self.step_seconds: float | None = None  # seconds of a decode step

    def budget(self, decoding: int, jobs_only: bool = False, prompts: int = 0) -> int:
        """The prompt tokens this turn may prefill; `decoding`: the rows that wait for this turn's
        decode step; `prompts`: the prompts waiting for their first token (being read or queued);
        `jobs_only`: the only prefill work is embedding / rerank jobs. With nothing decoding, a
        turn of jobs alone gets half the chunk: a chat that arrives meanwhile waits for the turn
        in flight (issue 37: 8 chats' first token during a 1000-text job was 2.08x of alone on a
        1.5B model, the job's 256-token turns taking about 3 s on two cores)."""
        if not self.share:
            return self.chunk
        if not decoding and jobs_only:
            return max(self.floor, self.chunk // 2)
        if not decoding or self.token_seconds is None or self.step_seconds is None:
            return self.chunk
        share = self.share * max(1.0, prompts / decoding)
        tokens = share * self.step_seconds / self.token_seconds
        return max(self.floor, min(self.chunk, int(tokens)))

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A turn read `tokens` prompt tokens in `seconds`."""
        if tokens > 0:
            self.token_seconds = self._average(self.token_seconds, seconds / tokens)

    def decoded(self, seconds: float) -> None:
        """A decode step took `seconds`."""
        self.step_seconds = self._average(self.step_seconds, seconds)

    def _average(self, estimate: float | None, value: float) -> float:
        return value if estimate is None else estimate + self.smoothing * (value - estimate)
