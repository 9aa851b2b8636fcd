"""A drafter whose drafts are all accepted: the upper bound of speculative decoding."""

from __future__ import annotations

from ..speculative import Drafter


class KnownContinuation(Drafter):
    """A speculative drafter that proposes `continuation`, the tokens known to follow `prompt`
    (e.g. the target's own greedy output computed beforehand): every draft is accepted, the
    upper bound of speculative decoding (tests, benchmarks/bench_speculative.py)."""

    def __init__(self, prompt: list[int], continuation: list[int]):
        self.n, self.continuation = len(prompt), continuation

    def propose(self, context, k):
        done = len(context) - self.n
        return self.continuation[done : done + k], None
