"""How many prompt tokens a turn of the engine may prefill (`Engine._turn`), from how long its
work takes: the decoding streams wait for a turn's prefill between two of their tokens. (Where
the engine reads prompts beside the decode steps, on a prefill thread of their own (beside.py),
nobody waits for a piece and it is a whole chunk; this pace is for turns that do both.)

While no row decodes, a turn prefills the whole `--prefill-chunk`: nobody waits for it but the
prompts themselves. While rows decode, a turn's prefill gets about `share` times the time of a
decode step, at least one WKV_CHUNK (the shortest piece a prompt can be cut to,
`prefill_piece_end`) and at most the chunk. So the gap between two tokens of a stream is about
(1 + share) decode steps, on any model and machine, instead of one decode step plus a whole
chunk (issue 38: on a 0.1B model on two cores, inter-token latency p99 1402 ms against a p50 of
45 ms). This is the scheduler half of vLLM's and SGLang's chunked prefill, whose per-step token
budget is fixed: here it is a time, measured.

A prompt waiting for its first token weighs as much as a stream waiting for its next one: while
more prompts are being read than rows decode, the share is multiplied by prompts / rows (still at
most the chunk). Without that, a burst of prompts (64 clients at once) was read at one decode
step's worth a turn while a few rows decoded: the queue drained slowly, and the last first token
came after 116 s against llama-server's 18 s (issue 38, 0.1B, 64 streams). Such a queue is also
read in pieces no shorter than `PieceCosts.efficient` (within 1.5x the best seconds a token the
curve knows): a budget tied to the decode step's time shrinks as the steps get cheaper, and 64
streams settled with 20 rows decoding, 44 prompts waiting and pieces of 45 tokens (TTFT p50
11-13 s), where pieces of 100 tokens kept 44 rows decoding (TTFT p50 0.6-1.2 s).

The time becomes tokens through the cost of a piece by its length (`PieceCosts`): running
averages of the seconds the engine measured for the pieces it read, by length in WKV chunks,
read between them as straight lines. A piece costs a fixed part (hundreds of small operators
whatever its length) plus a part per token: a 0.1B RWKV-7 in bf16 on two cores of an AMD Zen 5
read 32 tokens in 36 ms, 64 in 49, 128 in 74 and 256 in 119. One seconds-per-token figure (as
here before) charged 128 tokens four times 32; and under load, with the budget at its floor,
every piece was 32 tokens long, so that figure never met a longer one. The curve keeps what
longer pieces cost (whole chunks, read while nothing decodes), so a turn's time buys the tokens
it can; and a turn's later pieces get only the time its earlier ones left (`left`), since each
pays the fixed part again.

Both times are running estimates (exponential moving averages) of what the engine measured:
every piece's seconds, every decode step's seconds. Until both have been measured the budget is
the whole chunk, as it is with `share` 0 (the budget off).
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


def _average(estimate: float | None, value: float, smoothing: float) -> float:
    return value if estimate is None else estimate + smoothing * (value - estimate)


def _on(knots: list[tuple[float, float]], tokens: float) -> float:
    """The seconds at `tokens` on the straight lines joining `knots` (which reach past it)."""
    for (n0, s0), (n1, s1) in zip(knots, knots[1:]):
        if tokens <= n1:
            return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
    return knots[-1][1]


class PieceCosts:
    """The seconds a prefill piece takes by its length: for each length class (pieces of 1-32
    tokens, 33-64, ...: WKV chunks, rounded up) the running averages of the tokens and seconds of
    the pieces measured in it, a point (tokens, seconds) each, joined by straight lines. Shorter
    than the first point, the first line goes on down to its fixed part (or, with one point
    measured, down to (0, 0): proportional); past the last point, the cost is proportional to it
    (no cheaper a token than the longest piece measured: a guess that errs on the short side)."""

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self._points: dict[int, tuple[float, float]] = {}  # length class -> (tokens, seconds)

    def __len__(self) -> int:
        """The length classes measured."""
        return len(self._points)

    def add(self, tokens: int, seconds: float) -> None:
        """A piece of `tokens` tokens took `seconds`."""
        if tokens <= 0:
            return
        c = -(-tokens // WKV_CHUNK)
        n, s = self._points.get(c, (None, None))
        self._points[c] = (_average(n, tokens, self.smoothing), _average(s, seconds, self.smoothing))

    def _knots(self, most: float) -> list[tuple[float, float]]:
        """The curve from 0 to at least `most` tokens as points joined by straight lines."""
        points = sorted(self._points.values())
        (n0, s0), (n, s) = points[0], points[-1]
        head = (0.0, 0.0)
        if len(points) > 1:
            slope = (points[1][1] - s0) / (points[1][0] - n0)
            head = (0.0, max(0.0, s0 - slope * n0) if slope > 0 else s0)
        end = max(float(most), n + 1.0)
        return [head, *points, (end, s * end / n)]

    def seconds(self, tokens: float) -> float:
        """The estimated seconds of a piece of `tokens` tokens (some piece must have been measured)."""
        return _on(self._knots(tokens), tokens)

    def efficient(self, most: int, within: float = 1.5) -> int:
        """The shortest piece (whole WKV chunks, at most `most` tokens) whose estimated seconds a
        token are within `within` times the least of any such length: past it, a longer piece
        gains little. WKV_CHUNK while nothing is measured."""
        if not self._points:
            return min(most, WKV_CHUNK)
        lengths = range(WKV_CHUNK, max(most, WKV_CHUNK) + 1, WKV_CHUNK)
        knots = self._knots(lengths[-1])  # (once for every length)
        per_token = {n: _on(knots, n) / n for n in lengths}
        best = min(per_token.values())
        return min(n for n, t in per_token.items() if t <= within * best)

    def tokens(self, seconds: float, most: int) -> int:
        """The longest piece, of at most `most` tokens, whose estimated cost is within `seconds`
        (0 if none is, or nothing was measured). The curve need not rise everywhere (each point is
        its own average): the longest length that fits is taken wherever it lies."""
        if not self._points or seconds <= 0:
            return 0
        knots = self._knots(most)
        best = 0.0
        for (n0, s0), (n1, s1) in zip(knots, knots[1:]):
            if s1 <= seconds:
                best = max(best, n1)
            elif s0 <= seconds:
                best = max(best, n0 + (n1 - n0) * (seconds - s0) / (s1 - s0))
        return min(most, int(best + 1e-6))  # (a millionth of a token: the inversion's rounding, not time)


class PrefillPace:
    """A turn's prefill budget in tokens (`budget`) and what is left of it after each piece
    (`left`), from the measured piece and decode times (`prefilled`, `decoded`). smoothing: the
    weight of a new measurement in its estimate."""

    def __init__(self, chunk: int, share: float, smoothing: float = 0.25):
        self.chunk, self.share, self.smoothing = chunk, share, smoothing
        self.floor = min(chunk, WKV_CHUNK)
        self.costs = PieceCosts(smoothing)
        self.step_seconds: float | None = None  # seconds of a decode step
        self.turn_seconds: float | None = None  # the time of the turn being planned (None: no time limit)

    def budget(self, decoding: int, jobs_only: bool = False, prompts: int = 0) -> int:
        """The prompt tokens this turn may prefill; `decoding`: the rows that wait for this turn's
        decode step; `prompts`: the prompts waiting for their first token (being read or queued);
        `jobs_only`: the only prefill work is embedding / rerank jobs. With nothing decoding, a
        turn of jobs alone gets half the chunk: a chat that arrives meanwhile waits for the turn
        in flight (issue 37: 8 chats' first token during a 1000-text job was 2.08x of alone on a
        1.5B model, the job's 256-token turns taking about 3 s on two cores). While rows decode,
        the turn also has a time (`turn_seconds`), by which `left` cuts its later pieces."""
        self.turn_seconds = None
        if not self.share:
            return self.chunk
        if not decoding and jobs_only:
            return max(self.floor, self.chunk // 2)
        if not decoding or not self.costs or self.step_seconds is None:
            return self.chunk
        self.turn_seconds = self.share * max(1.0, prompts / decoding) * self.step_seconds
        floor = self.floor
        if prompts > decoding:  # a queue: read it in pieces that are not mostly fixed cost
            floor = max(floor, self.costs.efficient(self.chunk))
            self.turn_seconds = max(self.turn_seconds, self.costs.seconds(floor))
        return max(floor, self.costs.tokens(self.turn_seconds, self.chunk))

    def left(self, budget_left: int, spent: float) -> int:
        """The tokens the turn's next piece may read, `budget_left` of its tokens being left and
        `spent` seconds of it gone: no more than fit in the turn's time left. A piece has a fixed
        cost, so three pieces of 32 tokens take longer than one of 96: the budget in tokens alone
        would let a turn of many short pieces run well past its time."""
        if self.turn_seconds is None:
            return budget_left
        return min(budget_left, self.costs.tokens(self.turn_seconds - spent, self.chunk))

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A piece of `tokens` prompt tokens took `seconds`."""
        self.costs.add(tokens, seconds)

    def decoded(self, seconds: float) -> None:
        """A decode step took `seconds`."""
        self.step_seconds = _average(self.step_seconds, seconds, self.smoothing)
