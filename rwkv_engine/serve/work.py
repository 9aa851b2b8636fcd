"""The engine's units of work: a request inside the engine (`Group`), each of its choices (`Row`,
a batch row while it decodes), and the prompts the scheduler reads chunk by chunk (`Prefill`).

They hold state and do one piece of work when asked; which of them runs when is the scheduler's
(engine.py) decision alone. A row delivers its own events (`Row.push`, `Row.finish`) to its
request's sink, on the engine thread.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections import deque
from collections.abc import Callable

import torch

from ..errors import RWKVEngineError
from ..generation import TextStream
from ..kernels.native import GEMV_MAX_ROWS
from ..models.model import prefill_piece_end
from ..sampling import Sampler
from ..speculative import SpeculativeRow
from ..state import State
from .logprobs import TokenLogprob, token_logprobs
from .messages import Delta, Finished, Read
from .metrics import Metrics
from .prompt_cache import PromptCache


class Row:
    """One choice of a request; a row of the decoding batch once it has its first token."""

    def __init__(self, group: Group, index: int, sampler: Sampler, stream: TextStream):
        self.group = group
        self.index = index  # the choice
        self.sampler = sampler
        self.stream = stream
        self.cancelled = False
        self.finished = False
        self.decoding = False  # holds a batch row (joining or in the batch)
        self.catching_up = False  # its draft model has a DraftPrefill queued
        self.next_token: int | None = None  # sampled, not yet fed to the model
        # A speculating row: its pending tokens and drafts replace next_token in a decode pass;
        # its batch row is the committed state (speculative.SpeculativeRow).
        self.spec: SpeculativeRow | None = None

    @property
    def id(self) -> int:
        return self.group.id

    def feed(self) -> list[int]:
        """The tokens of this row's next decode pass: its last token, or a speculating row's
        pending tokens and drafts (drafting runs here: the drafter proposes)."""
        return [self.next_token] if self.spec is None else self.spec.plan()

    def push(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Give a decided token to the stream (its text to the sink); False when the row has ended."""
        before = len(self.stream.tokens)
        text = self.stream.push(token)
        self.group.metrics.generated(len(self.stream.tokens) - before)
        self.emit(text, () if logprob is None else (logprob,))
        if self.stream.done:
            self.finish(self.stream.finish_reason)
            return False
        if self.cancelled:
            self.finish("cancelled")
            return False
        return True

    def emit(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if text or logprobs:
            self.send(Delta(text, self.index, logprobs, len(self.stream.tokens)))

    def send(self, event) -> None:
        if self.cancelled:
            return
        try:
            self.group.sink(event)
        except Exception:  # the receiver is gone: treat as a cancel
            self.cancelled = True

    def finish(self, reason: str, message: str | None = None) -> None:
        """End the choice: its `Finished` event; the request's `on_done` once every choice has ended."""
        if self.finished:
            return
        self.finished = True
        group = self.group
        if self.decoding:
            self.decoding = False
            group.running -= 1
        if all(r.finished for r in group.rows):
            group.on_done(group)
        group.metrics.inc("requests_total", outcome=reason)
        prompt_tokens = len(group.request.prompt_ids)
        event = Finished(reason, prompt_tokens, len(self.stream.tokens), group.cached, message, self.index)
        try:
            group.sink(event)
        except Exception:
            pass


def fail(rows: list[Row], error: Exception, name: str) -> None:
    """End `rows` with an error: an error of the request's making (RWKVEngineError) is its
    message; anything else is a bug, printed once with its traceback (on stderr, after `name`)."""
    if isinstance(error, RWKVEngineError):
        message = str(error)
    else:
        print(f"{name}: a model step failed:", file=sys.stderr)
        traceback.print_exception(error, file=sys.stderr)
        message = f"the model step failed ({type(error).__name__}); the request was dropped"
    for row in rows:
        row.finish("error", message)


class Group:
    """A request inside the engine: its choices (`rows`), queued as one, its prompt read once.

    Once the prompt is read, `logits` [V] and `state` are the prompt's, and `to_start` holds the
    choices still to start: a choice starts (its first token, a batch row) when a row is free,
    at most `EngineConfig.rows_per_request` of a request at once, so the choices of a request
    with more take turns."""

    def __init__(
        self, group_id: int, request, sink: Callable[[object], None], metrics: Metrics, on_done: Callable[[Group], None]
    ):
        self.id = group_id
        self.request = request
        self.sink = sink
        self.metrics = metrics
        self.on_done = on_done  # called once every choice has finished
        self.rows: list[Row] = []
        self.cached = 0  # prompt tokens taken from the prompt cache
        self.reading = False  # admitted, and no choice started yet: one of the prompts read at once
        self.logits: torch.Tensor | None = None
        self.state: State | None = None
        self.to_start: deque[Row] = deque()
        self.running = 0  # its rows in the batch

    @property
    def cancelled(self) -> bool:
        return any(r.cancelled for r in self.rows)


class Prefill:
    """A prompt the scheduler reads in pieces, in the order the engine picks (shortest first):
    `step` reads the next piece (at most `chunk` tokens, and at most `budget`, what is left of the
    turn's prefill budget) and returns how many tokens it read, 0 when no piece fits in the
    budget; `done` once all are read. The engine's prefill budget counts those tokens (Engine._prefill)."""

    done = False
    rows: list[Row] = []  # what fails when a step fails

    def step(self, chunk: int, budget: int) -> int:
        raise NotImplementedError


class PromptPrefill(Prefill):
    """A request's prompt on the target model, resumed from the prompt cache where it can be, and
    filling it; at the end, `logits` [V] (of the last position) and `state` are the prompt's.

    Pieces end at the cuts of `prefill_end` on the prompt's grid of `chunk` tokens, or earlier
    where the turn's budget is spent (`prefill_piece_end`); either way a resumed or a cold prefill
    gets the same bits. An echo request with log-probabilities reads every position's logits (`all_logits`)
    and keeps each prompt token's log-probability; it does not resume from the cache (it still
    fills it)."""

    def __init__(self, group: Group, model, cache: PromptCache, metrics: Metrics):
        self.group, self.model, self.cache, self.metrics = group, model, cache, metrics
        req = group.request
        self.ids = req.prompt_ids
        self.pos = 0
        self.end = 0  # where the piece being read ends
        self.state: State | None = None
        self.started = False
        self.logits: torch.Tensor | None = None
        self.echo_logprobs = req.echo and req.logprobs is not None
        self.prompt_logprobs: list[TokenLogprob] = []
        self.arrival = 0  # the engine's count of prompt tokens read when this one was admitted

    @property
    def done(self) -> bool:
        return self.logits is not None

    @property
    def rows(self) -> list[Row]:
        return self.group.rows

    def _start(self, chunk: int) -> None:
        req = self.group.request
        self.started = True
        if not req.echo:
            self.pos, self.state = self.cache.lookup(req.start_key, self.ids, chunk)
        self.group.cached = self.pos
        if self.pos:
            self.metrics.inc("prompt_cache_hits_total")
            self.metrics.inc("prompt_cache_hit_tokens_total", self.pos)
        else:
            self.metrics.inc("prompt_cache_misses_total")
            self.state = req.start_state

    def step(self, chunk: int, budget: int) -> int:
        tokens, state, all_logits = self.piece(chunk, budget)
        if not tokens:
            return 0
        if self.end < len(self.ids) and not all_logits and len(tokens) > GEMV_MAX_ROWS:
            # A piece before the last: nobody reads its logits, so no output head (on a 0.1B
            # model, 6 of a 32-token piece's 48 ms). Such a piece is longer than GEMV_MAX_ROWS
            # (`prefill_piece_end`), so `forward` would run the same block loop (`_prefill`):
            # the state has the same bits either way.
            return self.absorb(chunk, None, self.model.prefill(tokens, state=state))
        logits, after = self.model.forward(tokens, state=state, all_logits=all_logits)
        return self.absorb(chunk, logits, after)

    def piece(self, chunk: int, budget: int) -> tuple[list[int], State | None, bool]:
        """The next piece's forward: (tokens, the state it starts from, whether every position's
        logits are wanted); no tokens when no piece fits in `budget` (`prefill_piece_end`)."""
        if not self.started:
            self._start(chunk)
        self.end = prefill_piece_end(self.pos, len(self.ids), chunk, budget)
        return self.ids[self.pos : self.end], self.state, self.echo_logprobs

    def absorb(self, chunk: int, logits: torch.Tensor | None, state: State) -> int:
        """Take the output of the forward `piece` asked for (no logits for a piece before the
        last one without echo); the number of tokens read."""
        ids, start, end = self.ids, self.pos, self.end
        if self.echo_logprobs:
            logits = self._keep_logprobs(logits, start, end)
        self.metrics.inc("prefill_tokens_total", end - start)
        self.pos, self.state = end, state
        if end % chunk == 0 and self.cache.enabled:  # a cut of the chunk grid (`prefill_cuts`)
            self.cache.put(self.group.request.start_key, ids[:end], self.state)
        if end == len(ids):
            self.logits = logits
        return end - start

    def _keep_logprobs(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Keep the piece's prompt log-probabilities from its logits [T, V]; the last row [V]."""
        ids, k = self.ids, self.group.request.logprobs
        # Row r predicts token start + r + 1; the last row predicts the first generated token.
        self.prompt_logprobs += token_logprobs(logits[:-1], ids[start + 1 : end], [k] * (end - start - 1))
        if end < len(ids):  # the row that predicts the next piece's first token
            self.prompt_logprobs += token_logprobs(logits[-1:], ids[end : end + 1], [k])
        return logits[-1]


class DraftPrefill(Prefill):
    """A speculating row's draft model reading what it has not read of the row's context: the
    prompt at first, later what it missed while drafting paused. Read in pieces like a prompt,
    so no decode step waits for it; until the draft is within `max_lag` tokens of the context
    (what a pass may read), the row decodes without drafts (`SpeculativeRow.behind`)."""

    def __init__(self, row: Row):
        self.row = row
        self.behind = True
        row.catching_up = True

    @property
    def rows(self) -> list[Row]:
        return [self.row]

    @property
    def done(self) -> bool:
        return self.row.finished or not self.behind

    def step(self, chunk: int, budget: int) -> int:
        spec = self.row.spec
        n = spec.drafter.catch_up(spec.context, min(chunk, budget))
        self.behind = spec.drafter.lag(spec.context) > spec.max_lag
        return n


class InputsPrefill(Prefill):
    """An `InputsRequest` in the engine: inputs read and nothing generated (an embedding or rerank
    request). It is prefill work like a prompt, one piece per step (embedding.Embedding /
    Reranking) cut to the budget the step is given: fewer inputs in a padded batch, or fewer
    positions of a long one, so a job of thousands of inputs takes what the turn's prompts left
    and delays the decoding rows by one piece per turn, never by the whole job. A piece under
    MIN_PIECE tokens is not worth a forward: with less left, the step reads nothing (and the
    engine lets the job go first next turn, `starved`). It holds no batch row. It is its own
    `rows` (one, for cancel and failure): `finish`."""

    MIN_PIECE = 32  # fewest tokens a piece reads (or the whole chunk, if smaller)

    def __init__(self, item_id: int, work, sink: Callable[[object], None], metrics: Metrics, on_done):
        self.id, self.work, self.sink, self.metrics, self.on_done = item_id, work, sink, metrics, on_done
        self.cancelled = False
        self.finished = False
        self.reading = False  # admitted (one of the prompts read at once)
        self.starved = False  # read nothing in its last turn (Engine._prefill)

    @property
    def rows(self) -> list[InputsPrefill]:
        return [self]

    @property
    def done(self) -> bool:
        return self.work.done or self.finished

    def step(self, chunk: int, budget: int) -> int:
        if budget < min(self.MIN_PIECE, chunk):
            return 0
        t0 = time.perf_counter()
        n = self.work.step(min(chunk, budget))
        self.metrics.inc("embedding_seconds_total", time.perf_counter() - t0)
        self.metrics.inc("prefill_tokens_total", n)
        return n

    def deliver(self) -> None:
        """Send the result (`Read`) and end."""
        work = self.work
        values = work.vectors if hasattr(work, "vectors") else work.scores
        self.finish("stop", result=Read(values, work.tokens, getattr(work, "cached", 0)))

    def finish(self, reason: str, message: str | None = None, result: Read | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.on_done(self)
        self.metrics.inc("requests_total", outcome=reason)
        event = result or Finished(reason, self.work.tokens, 0, 0, message)
        try:
            self.sink(event)
        except Exception:
            pass
