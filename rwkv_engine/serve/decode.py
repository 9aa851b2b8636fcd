"""The decoding batch: the rows that decode together and their states, one `State` [B, ...],
and the decode step that moves them all on by one pass (`DecodeBatch.step`).

A step feeds every row its tokens (`Row.feed`: one for a plain row, a speculating row's pending
tokens and drafts) in one pass per feed length (`passes`), each through
`models.model.decode_rows`, which keeps every row's bits those of its sequence alone. Then each
row decides its tokens: plain rows by `Sampler.sample_batch`, each with its own parameters and
generator, speculating rows by speculative acceptance (speculative.py), both from
`Sampler.prepare`. A row's state moves on when its pass covered every token it decided (always
for a plain row); the rows that ended leave. One row's failure (its drafter, its sampling) ends
that row only.

The rows' states live in two buffers of the same capacity (rows): `state` is the first len(rows)
rows of one, and a pass of every row writes the new states into the other
(`RWKV.forward_into`), after which the two swap. A row that leaves gets the last row moved into
its place (one row copied; the rows keep no order); rows that join are written after the last
(the buffers grow, with room for a quarter more, when they are full, and shrink when they are
less than a quarter used). Before, each step's new state, each join (a concatenation) and each
leave (an index) was a new batch-sized tensor with every row's state copied into it: on the 0.1B
RWKV-7 shape (2.4 MB a row), at 45 rows, on the engine's thread, a concatenation took 29 ms and
keeping 44 rows 33 ms, beside a decode step of those rows of 76 ms (AMD Zen 5, 2 threads).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ..models.model import decode_rows
from ..sampling import Sampler
from ..state import State
from .logprobs import TokenLogprob, token_logprobs
from .work import Row, fail


class Pass(NamedTuple):
    """One forward of the rows `idx` (indices into the batch) whose feeds have one length T:
    logits [n, V] for T = 1, [n, T, V] for a verify pass; the states after it [n, ...]."""

    idx: list[int]
    logits: torch.Tensor
    after: State


class DecodeBatch:
    """The decoding rows, row i of `state`. name: what error messages on stderr start with."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name
        self.rows: list[Row] = []
        self.state: State | None = None  # the first len(rows) rows of _buf
        self._buf: State | None = None  # [capacity, ...] each field
        self._spare: State | None = None  # the other buffer: a full pass's new states

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, entries: list[tuple[Row, State]]) -> None:
        """Add rows with the states they start from (each of one row), after the last row."""
        n, k = len(self.rows), len(entries)
        if self._buf is None or len(self._buf) < n + k:
            self._resize(n + k + (n + k) // 4, entries[0][1])
        for j, (_, st) in enumerate(entries):
            for name, t in self._buf.items():
                t[n + j].copy_(getattr(st, name)[0])
        self.rows += [row for row, _ in entries]
        self.state = self._buf[: n + k]

    def keep(self, keep: list[int]) -> None:
        """Keep the rows `keep` (indices), drop the others: each dropped row's place that is kept
        takes one of the last rows."""
        n, m = len(self.rows), len(keep)
        if m == n:
            return
        if not m:
            self.clear()
            return
        kept = set(keep)
        holes = [i for i in range(m) if i not in kept]
        movers = [i for i in keep if i >= m]  # as many as the holes
        for hole, mover in zip(holes, movers):
            for _, t in self._buf.items():
                t[hole].copy_(t[mover])
            self.rows[hole] = self.rows[mover]
        del self.rows[m:]
        if m <= len(self._buf) // 4:
            self._resize(m + m // 4 + 1, self._buf)
        self.state = self._buf[:m]

    def clear(self) -> list[Row]:
        """Drop every row; returns them."""
        rows, self.rows = self.rows, []
        self.state = self._buf = self._spare = None
        return rows

    def _resize(self, capacity: int, like: State) -> None:
        """New buffers of `capacity` rows (fields as `like`'s), the rows' states copied over."""
        n = len(self.rows)
        buf = State(
            {k: torch.empty((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device) for k, t in like.items()},
            like.signature,
        )
        if n:  # (the first n rows of the old buffer are theirs)
            for k, t in buf.items():
                t[:n].copy_(getattr(self._buf, k)[:n])
        self._buf, self._spare = buf, None
        self.state = buf[:n]

    def _spare_rows(self) -> State:
        """The first len(rows) rows of the spare buffer (made at the capacity of the other)."""
        if self._spare is None:
            self._spare = State({k: torch.empty_like(t) for k, t in self._buf.items()}, self._buf.signature)
        return self._spare[: len(self.rows)]

    def passes(self, feeds: list[list[int] | None]) -> list[Pass]:
        """One forward per feed length over the rows with a feed (None: no pass for that row)."""
        lengths: dict[int, list[int]] = {}
        for i, feed in enumerate(feeds):
            if feed is not None:
                lengths.setdefault(len(feed), []).append(i)
        out = []
        for T, idx in lengths.items():
            tokens = torch.tensor([feeds[i] for i in idx], dtype=torch.long)
            if len(idx) == len(self.rows):  # every row: into the spare buffer
                logits, after = decode_rows(self.model, tokens, self.state, T > 1, out=self._spare_rows())
            else:
                logits, after = decode_rows(self.model, tokens, self.state[idx], all_logits=T > 1)
            out.append(Pass(idx, logits, after))
        return out

    def move(self, passes: list[Pass], moved: dict[int, tuple[State, int]]) -> None:
        """Take the new states of the rows in `moved` (row -> (a pass's states, its row there));
        a single pass that moved every row becomes the batch's state as it is."""
        if len(passes) == 1 and len(moved) == len(self.rows) == len(passes[0].idx):  # (the spare's rows)
            self._buf, self._spare = self._spare, self._buf
            self.state = passes[0].after
            return
        for i, (after, j) in moved.items():  # the batch state is our own (cat / index copies)
            for name, t in self.state.items():
                t[i].copy_(getattr(after, name)[j])

    def step(self) -> tuple[float, float, float]:
        """One decode step for every row (see the module docstring); the seconds it spent on the
        forward passes, on deciding tokens and on handing them to the rows' streams."""
        rows = self.rows
        t0 = time.perf_counter()
        feeds = self._feeds()
        try:
            passes = self.passes(feeds)
        except Exception as e:
            fail(self.clear(), e, self.name)
            return time.perf_counter() - t0, 0.0, 0.0
        t1 = time.perf_counter()
        alive, moved, sampled = self._decide(passes, feeds)
        t2 = time.perf_counter()
        for i, token, entry in sampled:  # the plain rows' tokens to their streams
            alive[i] = token is not None and rows[i].push(token, entry)
            if alive[i]:
                rows[i].next_token = token
        t3 = time.perf_counter()
        self.move(passes, moved)
        self.keep([i for i in range(len(rows)) if alive[i]])
        return t1 - t0, t2 - t1, t3 - t2

    def _feeds(self) -> list[list[int] | None]:
        """Each row's feed; None for a row whose drafter failed (that row fails, the others go on)."""
        feeds: list[list[int] | None] = []
        for row in self.rows:
            try:
                feeds.append(row.feed())
            except Exception as e:
                fail([row], e, self.name)
                feeds.append(None)
        return feeds

    def _decide(self, passes: list[Pass], feeds: list[list[int] | None]):
        """Each row's tokens from its pass: (which rows go on, row -> (its pass's states, its row
        there) for the rows whose state moves, and the plain rows' (row, token, log-probability)
        to push). A speculating row's tokens are pushed as they are decided (each one may end it)."""
        rows = self.rows
        alive = [feed is not None for feed in feeds]
        moved: dict[int, tuple[State, int]] = {}
        sampled = []
        for idx, logits, after in passes:
            plain = [j for j, i in enumerate(idx) if rows[i].spec is None]
            if plain:
                prows = [rows[idx[j]] for j in plain]
                plogits = logits if len(plain) == len(idx) else logits[plain]
                tokens = sample(prows, plogits, self.name)
                sampled += zip((idx[j] for j in plain), tokens, token_entries(prows, plogits, tokens))
                moved.update((idx[j], (after, j)) for j in plain)
            for j, i in enumerate(idx):
                if rows[i].spec is not None:
                    alive[i] = self._speculated(rows[i], logits[j] if logits.dim() == 3 else logits[j : j + 1])
                    if rows[i].spec.committed_all:
                        moved[i] = (after, j)
        return alive, moved, sampled

    def _speculated(self, row: Row, logits: torch.Tensor) -> bool:
        """A speculating row's tokens from its pass's logits [T, V]; False when the row has ended."""
        try:
            for token in row.spec.decide(logits):
                if not row.push(token):
                    return False
        except Exception as e:
            fail([row], e, self.name)
            return False
        return True


def sample(rows: list[Row], logits: torch.Tensor, name: str) -> list[int | None]:
    """A token for each row of logits [B, V]; None for a row whose sampling raised (that row
    fails, the others go on). After a failure each row is sampled again alone from its
    generator's state before the batch call, so it draws what it would have drawn."""
    samplers = [r.sampler for r in rows]
    saved = [None if s.generator is None else s.generator.get_state() for s in samplers]
    try:
        return Sampler.sample_batch(samplers, logits)
    except Exception:
        pass
    out = []
    for i, (row, sampler, gen_state) in enumerate(zip(rows, samplers, saved)):
        if gen_state is None:
            sampler.generator = None
        else:
            sampler.generator.set_state(gen_state)
        try:
            out.append(Sampler.sample_batch([sampler], logits[i : i + 1])[0])
        except Exception as e:
            fail([row], e, name)
            out.append(None)
    return out


def token_entries(rows: list[Row], logits: torch.Tensor, tokens: list[int | None]) -> list[TokenLogprob | None]:
    """Row i's TokenLogprob for tokens[i] from logits [B, V], for the rows that asked for it
    (and were sampled: a row whose sampling failed has no token)."""
    want = [i for i, r in enumerate(rows) if r.group.request.logprobs is not None and tokens[i] is not None]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if want:
        got = token_logprobs(logits[want], [tokens[i] for i in want], [rows[i].group.request.logprobs for i in want])
        for i, entry in zip(want, got):
            out[i] = entry
    return out
