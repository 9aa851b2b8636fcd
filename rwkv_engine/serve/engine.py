"""The serving engine: one model, many concurrent requests, continuous batching.

One thread, the engine thread, owns the model. Each turn of its loop it

1. drops cancelled requests (their batch slot is free for the next turn) and admits waiting
   requests while fewer than `max_batch` hold a slot;
2. prefills up to `prefill_chunk` prompt tokens, round-robin over the admitted requests whose
   prompt is not read yet: the next chunk of the first, which then goes to the back of the line,
   then (if the budget is not spent) of the next one; a prompt that is done samples its first
   token and joins the decoding batch. So a short prompt that arrives while a long one is
   being read waits for about one chunk of it, not for the whole of it;
3. runs one decode step for every decoding request together: their last tokens as [B, 1]
   through `model.forward` (one call per GEMV_MAX_ROWS rows on the CPU, see below), their
   states concatenated into one batch `State` [B, ...], then `Sampler.sample_batch`, each row
   with the request's own parameters and random generator.

So new prompts delay the running requests by about one chunk of prefill per decode step;
they are never paused for a whole prompt. A request leaves the batch when its `TextStream` ends (stop
token, stop string, max_tokens) or when it is cancelled; the batch state drops its row.

Batched = alone, bit for bit (on the CPU, with the native kernels): a request gets the tokens
`rwkv_engine.generate` gives it alone, greedy or sampled with a seed, whatever else is running.
* Decode: a one-token forward of at most GEMV_MAX_ROWS rows runs the fused native step, whose
  kernels compute each row on its own (models/native_step.py), so row i of the batch has the
  logits and state of that sequence stepped alone. A larger batch is stepped in groups of
  GEMV_MAX_ROWS rows for that reason (a [B, 1] forward of more rows would take the batched
  GEMM, whose rounding depends on the batch).
* Speculative verify passes (a row's pending tokens and drafts, [B, T]) go through the same
  native step in groups of at most GEMV_MAX_ROWS rows x tokens (`decode_rows`); each token gets
  the bits of a one-token step, so a speculating row decides what it decides alone.
* Sampling: `Sampler.sample_batch` samples row by row, each with the request's own counts and
  generator, as `generate` does for one sequence.
* Prefill: a prompt is read in pieces of `prefill_chunk` tokens and `generate` reads it in one
  `forward` (pieces of PREFILL_CHUNK inside); both cut it with `models.model.prefill_end`,
  which never leaves a last piece short enough for the GEMV, so every piece of either runs
  the GEMM and the chunked WKV (RWKV-7 on the CPU: the native recurrence), whose results for a
  token do not depend on where the prompt is cut: the logits and state are the same bit for bit (for a `prefill_chunk` that is a multiple
  of 32, the WKV chunk; the default is 256).

Prompt-state cache: prompts are prefilled in chunks aligned to multiples of `prefill_chunk`
from their first token, and the state after every full chunk is kept in an LRU map keyed by
(start state, token-id prefix), bounded in bytes. A new prompt resumes from the longest cached
prefix at which its own cold prefill would cut (shorter than the prompt by more than
GEMV_MAX_ROWS tokens: see `prefill_end`). Because the chunks are aligned, a resumed prefill runs
the very same forward calls on the very same state as a cold one: the cache changes how fast
an answer starts, never what it is.

Choices (`Request.n` > 1): the prompt is prefilled once; at its end the state is copied into n
rows, each choice sampled with its own `Sampler` (choice i of a seeded request uses seed + i, so
it equals the same request with n = 1 and that seed) and ending on its own.

Log-probabilities (`Request.logprobs`, `Request.echo`; see `logprobs.py`): each sampled token's
`Delta` carries its `TokenLogprob` (also for a stop token, which adds no text). An echo request
reads its whole prompt with `all_logits=True` to get the log-probability of every prompt token
after the first, so it does not resume from the prompt cache (it still fills it); they come in
one `Prompt` event per choice before the first `Delta`. Its first token is sampled from the
last row of those logits, which may differ from the last-position logits of a plain prefill in
the last bits (the output head is one GEMM over the chunk): an echo's continuation is not
guaranteed to be the same bits as the same request without echo.

Threads: `submit` and `cancel` may be called from any thread. Output goes to the request's
`sink(event)` -- for an echo request one `Prompt` first, then per choice `Delta(text)` any number
of times and one `Finished`; events carry the choice's `index` -- called on the engine thread;
a sink must not block (the server's hands the event to its asyncio loop).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError, RWKVEngineError
from ..generation import TextStream, encode_prompt
from ..kernels.native import GEMV_MAX_ROWS
from ..models.model import prefill_end
from ..sampling import Sampler, SamplingParams
from ..speculative import (
    DEFAULT_MAX_DRAFT,
    KINDS,
    PromptLookup,
    SpeculativeRow,
    SpeculativeStats,
    check_max_draft,
    make_drafter,
)
from ..state import State
from ..structured import Constraint, grammar_for
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from .metrics import Metrics


@dataclass
class EngineConfig:
    max_batch: int = 8  # sequences decoded together (= batch slots)
    max_queue: int = 64  # requests waiting for a slot; beyond: QueueFull
    prefill_chunk: int = 256  # prompt tokens per prefill step (and cache granularity)
    state_cache_bytes: int = 1 << 30  # prompt-state cache capacity (0 = no cache)
    speculative: str | None = None  # the requests' default: "lookup", "draft" or None (plain decoding)
    draft: str | None = None  # the draft model's checkpoint ("draft"; None: the model's quantized twin)
    draft_quantization: str = "q4"  # of the twin draft
    max_draft: int = DEFAULT_MAX_DRAFT  # most tokens drafted per pass
    name: str = "rwkv-engine serve"  # what its messages on stderr start with (the command running it)

    def __post_init__(self):
        for name in ("max_batch", "max_queue", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.state_cache_bytes, int) or self.state_cache_bytes < 0:
            raise InputError(f"state_cache_bytes must be >= 0, got {self.state_cache_bytes!r}")
        if self.speculative not in (None, *KINDS):
            raise InputError(f"speculative must be one of {', '.join(KINDS)} or None, got {self.speculative!r}")
        check_max_draft(self.max_draft, "max_draft")


@dataclass
class Request:
    """What to generate: a continuation of `prompt_ids` from `start_state` (None = fresh)."""

    prompt_ids: list[int]
    params: SamplingParams
    start_state: State | None = None
    start_key: str = ""  # names start_state in the prompt cache; "" is the fresh state
    n: int = 1  # choices sampled from the one prefill
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    echo: bool = False  # send a Prompt event (with logprobs: the prompt's log-probabilities)
    # A fresh grammar Constraint for each choice (default: from params.json_schema / json_object).
    constraint: Callable[[], Constraint] | None = None
    # Speculative decoding: "lookup", "draft", "off", or None for the engine's default. The output
    # is the same either way; a request with logprobs decodes plainly.
    speculative: str | None = None


@dataclass(frozen=True)
class Prompt:
    """The prompt of an echo request: log-probabilities of its tokens (the first has none), or
    None when the request asked for no log-probabilities."""

    logprobs: tuple[TokenLogprob, ...] | None
    index: int = 0


@dataclass(frozen=True)
class Delta:
    text: str
    index: int = 0  # the choice
    logprobs: tuple[TokenLogprob, ...] = ()  # of the token(s) behind this piece, if asked for
    generated: int = 0  # tokens the choice has generated so far, this piece's included


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    message: str | None = None  # what went wrong, for "error"
    index: int = 0  # the choice


Sink = Callable[[object], None]


class QueueFull(RWKVEngineError):
    """Every batch slot is taken and `max_queue` requests already wait."""

    retry_after = 1  # seconds


class EngineStopped(RWKVEngineError):
    """The engine is not running (not started yet, or shutting down)."""


def decode_rows(model, tokens: torch.Tensor, batch: State, all_logits: bool = False) -> tuple[torch.Tensor, State]:
    """`model.forward(tokens [B, T], batch, all_logits)`, on the CPU in groups of at most
    GEMV_MAX_ROWS rows x tokens: each group runs the native step, so every row's logits and
    state are those of its sequence alone (one forward of more rows would take the batched GEMM).
    T > 1: a speculative verify pass of the rows' pending tokens and drafts."""
    B, T = tokens.shape
    G = max(1, GEMV_MAX_ROWS // T)
    if B <= G or model.device.type != "cpu":
        return model.forward(tokens, state=batch, all_logits=all_logits)
    parts = [model.forward(tokens[i : i + G], state=batch[i : i + G], all_logits=all_logits) for i in range(0, B, G)]
    return torch.cat([p[0] for p in parts]), State.cat([p[1] for p in parts])


def _host(state: State) -> State:
    """A GPU state copied to pinned host memory (the cache lives in host RAM; `model.forward`
    moves a state from there to its device, a DMA from pinned pages); other states as they are."""
    if state.device.type != "cuda":
        return state
    pinned = {}
    for k, v in state.items():
        pinned[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v)
    return State(pinned, state.signature)


class PromptCache:
    """LRU map (start key, token-id prefix) -> State after that prefix, bounded in bytes."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, bytes], State] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(key: tuple[str, bytes], state: State) -> int:
        return state.nbytes + len(key[1]) + len(key[0])

    def put(self, start_key: str, prefix: Sequence[int], state: State) -> None:
        key = (start_key, array("q", prefix).tobytes())
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        size = self._size(key, state)
        if size > self.capacity:
            return
        while self._entries and self.nbytes + size > self.capacity:
            old_key, old = self._entries.popitem(last=False)
            self.nbytes -= self._size(old_key, old)
        self._entries[key] = _host(state)
        self.nbytes += size

    def lookup(self, start_key: str, ids: Sequence[int], chunk: int) -> tuple[int, State | None]:
        """(k, state after ids[:k]) for the longest cached k at which a cold prefill of `ids` cuts
        (a multiple of `chunk` with more than GEMV_MAX_ROWS tokens after it: `prefill_end`), or (0, None)."""
        if not self._entries:
            return 0, None
        raw = array("q", ids).tobytes()
        width = raw and len(raw) // len(ids)
        for k in range((len(ids) - GEMV_MAX_ROWS - 1) // chunk * chunk, 0, -chunk):
            key = (start_key, raw[: k * width])
            state = self._entries.get(key)
            if state is not None:
                self._entries.move_to_end(key)
                return k, state
        return 0, None

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice `index`: a seed becomes seed + index (mod 2**63)."""
    if index == 0 or params.seed is None:
        return params
    return params.replace(seed=(params.seed + index) % 2**63)


class Handle:
    """A submitted request; `cancel()` frees its slot (a no-op once it has finished)."""

    def __init__(self, engine: Engine, seq: _Sequence):
        self._engine = engine
        self._seq = seq

    @property
    def id(self) -> int:
        return self._seq.id

    def cancel(self) -> None:
        self._engine.cancel(self)


class _Sequence:
    """One choice of a request inside the engine (a batch row once decoding). The first choice
    of a request (its `group`) is the one that is queued and prefilled."""

    def __init__(self, seq_id: int, request: Request, sink: Sink, sampler: Sampler, stream: TextStream, index: int = 0):
        self.id = seq_id
        self.index = index  # the choice
        self.group = [self]  # every choice of the request (the same list in each)
        self.request = request
        self.sink = sink
        self.sampler = sampler
        self.stream = stream
        self.cancelled = False
        self.finished = False
        self.admitted = False  # holds a batch slot (Engine._admit)
        self.started = False  # prefill begun (cache looked up)
        self.pos = 0  # prompt tokens read
        self.cached = 0  # of which taken from the prompt cache
        self.state: State | None = None  # during prefill
        self.next_token: int | None = None  # sampled, not yet fed to the model
        self.prompt_logprobs: list[TokenLogprob] = []  # during an echo's prefill
        # Speculating rows: the row's pending tokens replace next_token; the batch row is the
        # committed state (speculative.SpeculativeRow).
        self.spec: SpeculativeRow | None = None


class Engine:
    """See the module docstring. `start()` it, `submit()` requests, `stop()` it."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, metrics: Metrics | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.metrics = metrics or Metrics()
        self.cache = PromptCache(self.config.state_cache_bytes)
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()  # guarded by _cond
        self._wake = False  # guarded by _cond: a cancel to handle
        self._stopping = False
        self._prefilling: deque[_Sequence] = deque()  # engine thread only
        self._decoding: list[_Sequence] = []  # engine thread only; row i of _batch
        self._batch: State | None = None
        self._joining: list[tuple[_Sequence, State]] = []  # prefilled this turn, join before decoding
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._holding = 0  # batch rows (choices) admitted and not finished (written by the engine thread only)
        self._ready = False  # warmed up (see _warm_up)
        self.speculative = SpeculativeStats()  # of every speculating row (engine thread)
        self._draft = None  # the draft model's DraftModel, loaded at the first request that needs it

    # --- control (any thread) -------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._thread = threading.Thread(target=self._loop, name="rwkv-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def ready(self) -> bool:
        """Alive and warmed up: the first request will not wait for kernels to be built."""
        return self._ready and self.alive

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; requests still queued or running finish with reason "error"."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request, sink: Sink) -> Handle:
        """Queue a request. Raises InputError (bad ids or params), QueueFull, EngineStopped."""
        return self.submit_all([(request, sink)])[0]

    def submit_all(self, requests: Sequence[tuple[Request, Sink]]) -> list[Handle]:
        """Queue (request, sink) pairs, all or none, in one step: no other request is queued
        between them, and none of them runs unless all are queued. Raises InputError (bad ids
        or params, or more requests than the queue and the batch can ever hold together),
        QueueFull (they fit, but not now), EngineStopped."""
        capacity = self.config.max_batch + self.config.max_queue
        if len(requests) > capacity:
            raise InputError(
                f"{len(requests)} prompts in one request; this server takes at most {capacity} at once "
                f"(max batch {self.config.max_batch} + max queue {self.config.max_queue})"
            )
        groups = [self._prepare(request) for request, _ in requests]
        with self._cond:
            if not self.alive:
                raise EngineStopped("the engine is not running")
            # Requests not yet admitted while slots are free take a slot at the next turn:
            # only those beyond the free slots wait.
            free = max(0, self.config.max_batch - self._holding)
            waiting = len(self._waiting) - free
            if waiting + len(requests) > self.config.max_queue:
                raise QueueFull(f"the server is busy: {max(0, waiting)} requests are already waiting")
            handles = []
            for (request, sink), (samplers, streams) in zip(requests, groups):
                group = [
                    _Sequence(next(self._ids), request, sink, s, t, i)
                    for i, (s, t) in enumerate(zip(samplers, streams))
                ]
                for s in group:
                    s.group = group
                self._waiting.append(group[0])
                handles.append(Handle(self, group[0]))
            self._cond.notify_all()
        return handles

    def _prepare(self, request: Request) -> tuple[list[Sampler], list[TextStream]]:
        """Check a request (its prompt ids are normalised in place); each choice's sampler and stream."""
        vocab = self.model.config.vocab_size
        request.prompt_ids = encode_prompt(self.tokenizer, request.prompt_ids, vocab)
        if request.start_state is not None and request.start_state.batch_size != 1:
            raise InputError(f"a start state must hold one sequence, got {request.start_state.batch_size}")
        self._check_choices(request)
        if request.speculative not in (None, "off", *KINDS):
            raise InputError(f"speculative must be one of {', '.join(KINDS)} or off, got {request.speculative!r}")
        params = [choice_params(request.params, i) for i in range(request.n)]
        constraint = request.constraint
        if constraint is None:
            grammar = grammar_for(request.params, self.tokenizer, vocab)
            constraint = grammar and grammar.constraint
        samplers = [Sampler(p, vocab, constraint=constraint and constraint()) for p in params]
        return samplers, [TextStream(self.tokenizer, p) for p in params]

    @property
    def max_choices(self) -> int:
        """The most choices (`n`) one request may have: half the batch, so one request never
        takes every slot (for a batch of 1, 1)."""
        return max(1, self.config.max_batch // 2)

    def _check_choices(self, request: Request) -> None:
        n, k, top = request.n, request.logprobs, self.max_choices
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= top:
            raise InputError(
                f"n must be an integer from 1 to {top} (half of the server's max batch {self.config.max_batch}), "
                f"got {n!r}"
            )
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise InputError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {k!r}")

    def cancel(self, handle: Handle) -> None:
        """Cancel every choice of the request."""
        leader = handle._seq
        with self._cond:
            live = [s for s in leader.group if not (s.finished or s.cancelled)]
            if not live:
                return
            for s in live:
                s.cancelled = True
            if leader in self._waiting:
                self._waiting.remove(leader)
                for s in live:
                    self._finish(s, "cancelled")
            else:
                self._wake = True
                self._cond.notify_all()

    def gauges(self) -> dict[str, float]:
        with self._cond:
            waiting = len(self._waiting)
        return {
            "requests_running": self._rows(),
            "requests_waiting": waiting,
            "prompt_cache_entries": len(self.cache),
            "prompt_cache_bytes": self.cache.nbytes,
            "prompt_cache_capacity_bytes": self.cache.capacity,
            "max_batch": self.config.max_batch,
            "speculative_acceptance_rate": self.speculative.acceptance_rate,
            "speculative_tokens_per_pass": self.speculative.tokens_per_pass,
        }

    # --- the engine thread --------------------------------------------------------------------

    def _warm_up(self) -> None:
        """One prefill and one decode step on a throwaway state before the first request: the
        native kernels are built (or loaded from their cache) on first use, which can take
        many seconds, and the first call of each path allocates its buffers."""
        t0 = time.perf_counter()
        cfg = self.config
        if cfg.speculative == "draft" or cfg.draft is not None:  # loaded now, not in a request's turn
            self._draft = make_drafter("draft", self.model, cfg.draft, cfg.draft_quantization)
        _, state = self.model.forward([0] * (GEMV_MAX_ROWS + 1))  # the GEMM / chunked-WKV path
        decode_rows(self.model, torch.zeros(1, 1, dtype=torch.long), state)  # the per-row step
        print(f"{self.config.name}: ready (warm-up {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        try:
            try:
                self._warm_up()
            except Exception as e:
                print(f"{self.config.name}: the warm-up forward failed; nothing can be served:", file=sys.stderr)
                traceback.print_exception(e, file=sys.stderr)
                return
            self._ready = True
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or self._prefilling or self._decoding or self._wake):
                        self._cond.wait()
                    if self._stopping:
                        break
                    self._wake = False
                    self._drop_cancelled()
                    self._admit()
                try:
                    # Prompt tokens up to one chunk per turn: one chunk of a long prompt, or
                    # several short prompts, so that a burst of new requests joins quickly.
                    budget = self.config.prefill_chunk
                    if self._prefilling:
                        t0 = time.perf_counter()
                        while self._prefilling and budget > 0:
                            budget -= self._prefill_step()
                        self.metrics.inc("engine_seconds_total", time.perf_counter() - t0, phase="prefill")
                    if self._joining:
                        self._join()
                    if self._decoding:
                        self._decode_step()
                except Exception as e:  # a bug here: drop what is in flight, keep serving
                    self._fail(self._clear(), e)
        finally:
            self._shutdown()

    def _clear(self) -> list[_Sequence]:
        """Forget every admitted request; returns them."""
        seqs = [s for leader in self._prefilling for s in leader.group] + self._decoding + [s for s, _ in self._joining]
        self._prefilling.clear()
        self._decoding, self._batch, self._joining = [], None, []
        return seqs

    def _join(self) -> None:
        """Add the requests prefilled this turn to the decoding batch (one concatenation)."""
        states = [st for _, st in self._joining]
        self._batch = State.cat(states if self._batch is None else [self._batch, *states])
        self._decoding += [s for s, _ in self._joining]
        self._joining = []

    def _rows(self) -> int:
        """Batch rows held: decoding, joining, and the choices of the requests being prefilled.
        (Also read by `gauges` from other threads: it only copies and counts.)"""
        return sum(len(s.group) for s in list(self._prefilling)) + len(self._joining) + len(self._decoding)

    def _admit(self) -> None:
        while self._waiting and self._rows() + len(self._waiting[0].group) <= self.config.max_batch:
            seq = self._waiting.popleft()
            for s in seq.group:
                s.admitted = True
            self._holding += len(seq.group)
            self._prefilling.append(seq)
            self.metrics.inc("prompt_tokens_total", len(seq.request.prompt_ids))

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._prefilling if any(c.cancelled for c in s.group)]:
            self._prefilling.remove(seq)
            for s in seq.group:
                self._finish(s, "cancelled")
        if any(s.cancelled for s in self._decoding):
            keep = [i for i, s in enumerate(self._decoding) if not s.cancelled]
            for s in self._decoding:
                if s.cancelled:
                    self._finish(s, "cancelled")
            self._keep_rows(keep)

    def _keep_rows(self, keep: list[int]) -> None:
        if len(keep) == len(self._decoding):
            return
        self._decoding = [self._decoding[i] for i in keep]
        self._batch = self._batch[keep] if keep else None

    def _prefill_step(self) -> int:
        """Prefill the next chunk of the first prefilling request, then move it to the back of the
        line (round-robin); the number of tokens (>= 1)."""
        seq = self._prefilling[0]
        req, chunk = seq.request, self.config.prefill_chunk
        ids = req.prompt_ids
        try:
            if not seq.started:
                seq.started = True
                # An echo needs the logits of every prompt position: it reads the whole prompt.
                seq.pos, seq.state = (0, None) if req.echo else self.cache.lookup(req.start_key, ids, chunk)
                seq.cached = seq.pos
                if seq.pos:
                    self.metrics.inc("prompt_cache_hits_total")
                    self.metrics.inc("prompt_cache_hit_tokens_total", seq.pos)
                else:
                    self.metrics.inc("prompt_cache_misses_total")
                    seq.state = req.start_state
            start = seq.pos
            end = prefill_end(start, len(ids), chunk)
            echo_logprobs = req.echo and req.logprobs is not None
            logits, seq.state = self.model.forward(ids[start:end], state=seq.state, all_logits=echo_logprobs)
            if echo_logprobs:
                # Row r predicts token start + r + 1; the last row predicts the first generated token.
                seq.prompt_logprobs += token_logprobs(
                    logits[:-1], ids[start + 1 : end], [req.logprobs] * (end - start - 1)
                )
                if end < len(ids):  # the row that predicts the next chunk's first token
                    seq.prompt_logprobs += token_logprobs(logits[-1:], ids[end : end + 1], [req.logprobs])
                logits = logits[-1]
            self.metrics.inc("prefill_tokens_total", end - start)
            seq.pos = end
            if end - start == chunk and self.cache.capacity:  # (a last piece may be longer)
                self.cache.put(req.start_key, ids[:end], seq.state)
            done = end - start
            if end < len(ids):
                self._prefilling.rotate(-1)
                return done
            self._prefilling.popleft()
            self._first_token(seq, logits)
            return done
        except Exception as e:  # one request's failure must not stop the others
            if seq in self._prefilling:
                self._prefilling.remove(seq)
            self._fail(seq.group, e)
            return 1

    def _first_token(self, leader: _Sequence, logits: torch.Tensor) -> None:
        """The prompt is read: sample each choice's first token from its last logits [V]."""
        state, leader.state = leader.state, None
        req, group = leader.request, leader.group
        if req.echo:
            prompt = None
            if req.logprobs is not None:
                prompt, leader.prompt_logprobs = tuple(leader.prompt_logprobs), []
            for seq in group:
                self._send(seq, Prompt(prompt, seq.index))
        if req.params.max_tokens == 0:
            for seq in group:
                self._emit(seq, seq.stream.finish("length"))
                self._finish(seq, seq.stream.finish_reason)
            return
        tokens = Sampler.sample_batch([s.sampler for s in group], logits[None].expand(len(group), -1))
        entries = self._logprobs(group, logits[None].expand(len(group), -1), tokens)
        for seq, token, entry in zip(group, tokens, entries):
            if self._push(seq, token, entry):
                seq.next_token = token
                self._speculate(seq, token)
                self._joining.append((seq, state))

    def _speculate(self, seq: _Sequence, token: int) -> None:
        """Make a row that asked for speculative decoding (and no log-probabilities) speculate."""
        req = seq.request
        kind = self.config.speculative if req.speculative is None else req.speculative
        if kind in (None, "off") or req.logprobs is not None:
            return
        if kind == "lookup":
            drafter = PromptLookup()
        else:
            if self._draft is None:
                cfg = self.config
                self._draft = make_drafter("draft", self.model, cfg.draft, cfg.draft_quantization)
            drafter = self._draft.for_params(seq.sampler.params)
        row = SpeculativeRow(drafter, seq.sampler, req.prompt_ids, self.config.max_draft, self.speculative)
        row.limit = seq.sampler.params.max_tokens
        row.take(token)
        seq.spec = row

    @staticmethod
    def _logprobs(rows: list[_Sequence], logits: torch.Tensor, tokens: list[int | None]) -> list[TokenLogprob | None]:
        """Row i's TokenLogprob for tokens[i] from logits [B, V], for the rows that asked for it
        (and were sampled: a row whose sampling failed has no token)."""
        want = [i for i, s in enumerate(rows) if s.request.logprobs is not None and tokens[i] is not None]
        out: list[TokenLogprob | None] = [None] * len(rows)
        if want:
            got = token_logprobs(logits[want], [tokens[i] for i in want], [rows[i].request.logprobs for i in want])
            for i, entry in zip(want, got):
                out[i] = entry
        return out

    def _decode_step(self) -> None:
        if any(s.spec is not None for s in self._decoding):
            self._mixed_step()
        else:
            self._plain_step()

    def _mixed_step(self) -> None:
        """A decode step with speculating rows: the plain rows as in `_plain_step`, the speculating
        ones in one verify pass per pass length (their pending tokens + drafts); a row's batch
        state moves on when the pass covered every token it decided (see speculative.py)."""
        rows, batch, metrics = self._decoding, self._batch, self.metrics
        t0 = time.perf_counter()
        sp = self.speculative
        counts = (sp.passes, sp.drafted, sp.accepted, sp.emitted)
        alive = [True] * len(rows)
        moved: dict[int, State] = {}  # row -> its new state [1, ...]
        plain = [i for i, s in enumerate(rows) if s.spec is None]
        passes: dict[int, list[tuple[int, list[int]]]] = {}
        try:
            for i, s in enumerate(rows):
                if s.spec is not None:
                    feed = s.spec.plan()
                    passes.setdefault(len(feed), []).append((i, feed))
            if plain:
                tokens = torch.tensor([[rows[i].next_token] for i in plain], dtype=torch.long)
                plain_logits, plain_after = decode_rows(self.model, tokens, batch[plain])
            verified = []
            for members in passes.values():
                idx = [i for i, _ in members]
                feed = torch.tensor([f for _, f in members], dtype=torch.long)
                logits, after = decode_rows(self.model, feed, batch[idx], all_logits=True)
                verified.append((idx, logits, after))
        except Exception as e:
            self._decoding, self._batch = [], None
            self._fail(rows, e)
            return
        t1 = time.perf_counter()
        if plain:
            prow = [rows[i] for i in plain]
            sampled = self._sample(prow, plain_logits)
            entries = self._logprobs(prow, plain_logits, sampled)
            for j, (i, token, entry) in enumerate(zip(plain, sampled, entries)):
                moved[i] = plain_after[j]
                alive[i] = token is not None and self._push(rows[i], token, entry)
                if alive[i]:
                    rows[i].next_token = token
        for idx, logits, after in verified:
            for j, i in enumerate(idx):
                seq = rows[i]
                try:
                    for token in seq.spec.decide(logits[j]):
                        if seq.spec.committed_all:
                            moved[i] = after[j]
                        if not self._push(seq, token):
                            alive[i] = False
                            break
                except Exception as e:
                    self._fail([seq], e)
                    alive[i] = False
        metrics.inc("decode_steps_total")
        metrics.inc("decode_rows_total", len(rows))
        sp = self.speculative
        for name, now, before in zip(
            ("passes", "drafted_tokens", "accepted_tokens", "emitted_tokens"),
            (sp.passes, sp.drafted, sp.accepted, sp.emitted),
            counts,
        ):
            metrics.inc(f"speculative_{name}_total", now - before)
        keep = [i for i in range(len(rows)) if alive[i]]
        for i in (i for i in keep if i in moved):
            for name, t in batch.items():  # the batch is the engine's own (cat / index copies)
                t[i].copy_(getattr(moved[i], name)[0])
        self._keep_rows(keep)
        t2 = time.perf_counter()
        metrics.inc("engine_seconds_total", t1 - t0, phase="forward")
        metrics.inc("engine_seconds_total", t2 - t1, phase="sample")

    def _plain_step(self) -> None:
        rows, metrics = self._decoding, self.metrics
        try:
            t0 = time.perf_counter()
            tokens = torch.tensor([[s.next_token] for s in rows], dtype=torch.long)
            logits, self._batch = decode_rows(self.model, tokens, self._batch)
        except Exception as e:
            self._decoding, self._batch = [], None
            self._fail(rows, e)
            return
        t1 = time.perf_counter()
        sampled = self._sample(rows, logits)
        entries = self._logprobs(rows, logits, sampled)
        t2 = time.perf_counter()
        metrics.inc("decode_steps_total")
        metrics.inc("decode_rows_total", len(rows))
        keep = []
        for i, (seq, token, entry) in enumerate(zip(rows, sampled, entries)):
            if token is not None and self._push(seq, token, entry):
                seq.next_token = token
                keep.append(i)
        self._keep_rows(keep)
        metrics.inc("engine_seconds_total", t1 - t0, phase="forward")
        metrics.inc("engine_seconds_total", t2 - t1, phase="sample")
        metrics.inc("engine_seconds_total", time.perf_counter() - t2, phase="stream")

    def _sample(self, rows: list[_Sequence], logits: torch.Tensor) -> list[int | None]:
        """A token for each row of logits [B, V]; None for a row whose sampling raised (that
        request fails, the others go on). After a failure each row is sampled again alone from
        its generator's state before the batch call, so it draws what it would have drawn."""
        samplers = [s.sampler for s in rows]
        saved = [None if s.generator is None else s.generator.get_state() for s in samplers]
        try:
            return Sampler.sample_batch(samplers, logits)
        except Exception:
            pass
        out = []
        for i, (seq, sampler, gen_state) in enumerate(zip(rows, samplers, saved)):
            if gen_state is None:
                sampler.generator = None
            else:
                sampler.generator.set_state(gen_state)
            try:
                out.append(Sampler.sample_batch([sampler], logits[i : i + 1])[0])
            except Exception as e:
                self._fail([seq], e)
                out.append(None)
        return out

    def _push(self, seq: _Sequence, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Give a sampled token to the request's stream; False when the request has ended."""
        before = len(seq.stream.tokens)
        text = seq.stream.push(token)
        self.metrics.generated(len(seq.stream.tokens) - before)
        self._emit(seq, text, () if logprob is None else (logprob,))
        if seq.stream.done:
            self._finish(seq, seq.stream.finish_reason)
            return False
        if seq.cancelled:
            self._finish(seq, "cancelled")
            return False
        return True

    def _emit(self, seq: _Sequence, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if text or logprobs:
            self._send(seq, Delta(text, seq.index, logprobs, len(seq.stream.tokens)))

    def _send(self, seq: _Sequence, event) -> None:
        if seq.cancelled:
            return
        try:
            seq.sink(event)
        except Exception:  # the receiver is gone: treat as a cancel
            seq.cancelled = True

    def _finish(self, seq: _Sequence, reason: str, message: str | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        seq.state = None
        if seq.admitted:
            self._holding -= 1
        self.metrics.inc("requests_total", outcome=reason)
        event = Finished(
            reason, len(seq.request.prompt_ids), len(seq.stream.tokens), seq.group[0].cached, message, seq.index
        )
        try:
            seq.sink(event)
        except Exception:
            pass

    def _fail(self, seqs: list[_Sequence], error: Exception) -> None:
        if isinstance(error, RWKVEngineError):
            message = str(error)
        else:
            print(f"{self.config.name}: a model step failed:", file=sys.stderr)
            traceback.print_exception(error, file=sys.stderr)
            message = f"the model step failed ({type(error).__name__}); the request was dropped"
        for seq in seqs:
            self._finish(seq, "error", message)

    def _shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            left = [s for leader in self._waiting for s in leader.group] + self._clear()
            self._waiting.clear()
        for seq in left:
            self._finish(seq, "error", "the server is shutting down")
