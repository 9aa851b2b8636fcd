"""The serving engine: one model, many concurrent requests, continuous batching.

One thread, the engine thread, owns the model and is the scheduler. Each turn of its loop
(`Engine._turn`) it

1. drops cancelled requests (their batch rows are free for this turn) and admits waiting
   requests while fewer than `max_batch` prompts are being read or wait for their first row;
2. prefills `Prefill` work (work.py) under the turn's token budget (`PrefillPace`, pace.py):
   `prefill_chunk` tokens while no row decodes; while rows decode, about `prefill_share` times
   a decode step's time worth of tokens, times prompts waiting / rows decoding where more
   prompts wait (measured as the engine runs, pieces by their length: a piece has a fixed cost,
   so the time buys one long piece rather than several short ones; at least one 32-token
   piece, at most `prefill_chunk`), so the streams' tokens come at an even pace while new
   prompts are read.
   Shortest first (`_prefill`, `_urgency`): the next piece of the prompt with the fewest tokens
   left (less a credit for the time it waited), cut to the budget left, then (if the budget is
   not spent) of the next one; a piece that does not fit waits for the next turn. The work is a
   request's prompt, or a speculating row's draft model reading what it has not read (its
   prompt, or what it missed while drafting paused: first); embedding and rerank work (below)
   comes after them. So a short prompt that arrives while a long one is being read waits for
   about one piece of it, not for the whole of it, and a burst of prompts gets its first tokens
   one prompt after another, not all at the end. A prompt is read without holding batch rows: a
   long one, or an echo that only scores its prompt, keeps no other request from starting;
3. starts choices of requests whose prompt is read on the free batch rows (`_start_choices`):
   each samples its first token from the prompt's last logits and joins the decoding batch (one
   `State` [B, ...]). A request holds at most `rows_per_request` rows (half the batch) at once,
   so one request never takes every row; the choices of a request with more take turns;
4. runs one decode step for every decoding row together (`DecodeBatch.step`, decode.py): each
   row's feed (its
   last token, or a speculating row's pending tokens and drafts) goes through `model.forward`
   in one pass per feed length (`decode_rows`: on the CPU, groups of GEMV_MAX_ROWS rows x
   tokens), then each row decides its tokens: plain rows by `Sampler.sample_batch`, each with
   the request's own parameters and random generator, speculating rows by speculative
   acceptance (speculative.py), both drawing from `Sampler.prepare`.

So new prompts delay the running requests by at most one turn's prefill budget per decode step
(tests/test_engine_fairness.py counts it); they are never paused for a whole prompt.

On the CPU with at least two threads, prompts are read beside the decode steps instead (beside.py,
`prefill_threads`): while rows decode and prefill work waits, step 2 hands the next piece (a whole
chunk, the same `_next_work` order) to the prefill thread (`_hand_over`) and the turn goes on to
its decode step on the engine thread's share of the threads; a later turn takes the piece back
(`_collect`) and does what step 2 does after a piece. The decoding rows then wait for no prompt
at all. Where only one kind of work waits, the turn runs it on all the threads as above. A row
leaves the batch when its `TextStream` ends (stop token, stop string, max_tokens) or when it is
cancelled; the batch state drops it.

Batched = alone, bit for bit (on the CPU, with the native kernels): a request gets the tokens
`rwkv_engine.generate` gives it alone, greedy or sampled with a seed, whatever else is running.
* Decode: a forward of at most GEMV_MAX_ROWS rows x tokens runs the fused native step, whose
  kernels compute each row on its own (models/native_step.py), so row i of the batch has the
  logits and state of that sequence stepped alone; larger batches are stepped in groups of that
  many (`models.model.decode_rows`). A speculative verify pass ([B, T]) gives each token the
  bits of a one-token step, so a speculating row decides what it decides alone.
* Sampling: row by row, each with the request's own counts and generator, as `generate` does.
* Prefill: a prompt is read in pieces of `prefill_chunk` tokens and `generate` reads it in one
  `forward`; both cut it where `models.model.prefill_end` cuts, which never leaves a last piece
  short enough for the GEMV, so every piece runs the GEMM and the chunked WKV, whose results for
  a token do not depend on where the prompt is cut (for a `prefill_chunk` that is a multiple of
  32, the WKV chunk; the default is 256).

Prompt-state cache (prompt_cache.py): the state after every full chunk of a prompt is kept; a new
prompt resumes from the longest cached prefix at which its own cold prefill would cut, so a
resumed prefill runs the very same forward calls on the very same state as a cold one. With
`state_store` (`--state-store`), the cache's states are also written to disk off the engine
thread and looked for there on a miss in memory (state_store.py): a conversation resumes after a
restart, or on another replica sharing the directory, with the same answer as a cold prefill.

Choices (`Request.n` > 1, up to 128): the prompt is prefilled once; each choice is sampled with
its own `Sampler` (choice i of a seeded request uses seed + i, so it equals the same request with
n = 1 and that seed), starts when a row is free for it and ends on its own.

Embeddings and rerank scores (`submit_inputs`, an `InputsRequest`): inputs read with nothing
generated are `InputsPrefill` work (work.py) beside the prompts, under the same budget: each
step reads one piece cut to the budget left (several short inputs right-padded in one [B, T]
forward, fewer of them when less is left, or a piece of a long one; embedding.Embedding), then
the work goes to the back of the line. Prompts go first in a turn, the job reads what they
leave (at least a 32-token piece, else nothing), and a job that read nothing in a turn goes
first in the next. So a job of a thousand texts takes at most one turn's budget per turn and
the decode step still runs every turn: a streaming chat waits one turn's prefill per token, a
chat admitted meanwhile has its prompt read in the next turn, before the job's piece, and the
job reads at least every other turn however many chats arrive. Such work holds no batch row;
it counts as one request in the queue and as one prompt being read. Rerank reads each
document's prefix (those of one length together, as one batch) and keeps its end state in the
prompt cache (`PromptCache.get`, exact prefix), so the same documents against another query
read only the query.

Where the next steps attach (none of them is built here):
* A mixed step (a prefill piece and the decode passes in one forward, sharing the linear
  layers' weight reads) is an arrangement of `_turn`: `PromptPrefill.piece` gives a piece's
  forward arguments and `PromptPrefill.absorb` takes its output; in `DecodeBatch.step`,
  `_feeds` gives the decode rows' tokens, `passes` runs their forwards and `_decide` takes
  their logits. On the CPU it needs a kernel that runs the decode rows' GEMV (their bits, the
  rows alone) and the piece's GEMM over one pass of each weight: the GEMM over both would give
  the decode rows batch-dependent bits. (On the CPU, reading the piece beside the decode steps
  on other cores took the decode steps' wait for prompts away instead: beside.py.)

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
from collections import deque
from collections.abc import Sequence

import torch

from ..embedding import Embedding, Reranking
from ..errors import InputError
from ..generation import TextStream, encode_prompt
from ..kernels.native import GEMV_MAX_ROWS
from ..models.model import WKV_CHUNK, decode_rows
from ..quant.linear import warm_gemms
from ..sampling import Sampler, SamplingParams
from ..settings import MAX_CHOICES, MAX_PASS_TOKENS, SPECULATIVE_KINDS, EngineConfig
from ..speculative import SpeculativeRow, SpeculativeStats, drafter_for, make_drafter
from ..state import State
from ..structured import grammar_for
from ..threads import release_openmp_threads, use_threads
from .beside import Piece, PieceWorker
from .decode import DecodeBatch, token_entries
from .logprobs import MAX_TOP_LOGPROBS
from .messages import Delta, EngineStopped, Finished, InputsRequest, Prompt, QueueFull, Read, Request, Sink
from .metrics import Metrics
from .pace import PrefillPace, device_clock
from .prompt_cache import PromptCache
from .state_store import StateStore, model_key
from .work import DraftPrefill, Group, InputsPrefill, Prefill, PromptPrefill, Row, fail

__all__ = [
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineStopped",
    "Finished",
    "Handle",
    "InputsRequest",
    "Prompt",
    "PromptCache",
    "QueueFull",
    "Read",
    "Request",
    "decode_rows",
]


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice `index`: a seed becomes seed + index (mod 2**63)."""
    if index == 0 or params.seed is None:
        return params
    return params.replace(seed=(params.seed + index) % 2**63)


class Handle:
    """A submitted request; `cancel()` frees its slots (a no-op once it has finished)."""

    def __init__(self, engine: Engine, group: Group):
        self._engine = engine
        self._group = group

    @property
    def id(self) -> int:
        return self._group.id

    def cancel(self) -> None:
        self._engine.cancel(self)


class Engine:
    """See the module docstring. `start()` it, `submit()` requests, `stop()` it."""

    def __init__(
        self, model, tokenizer, config: EngineConfig | None = None, metrics: Metrics | None = None, reranker=None
    ):
        self.model = model
        self.reranker = reranker  # embedding.Reranker over `model`, for rerank requests; None: none
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.metrics = metrics or Metrics()
        self.cache = PromptCache(self.config.state_cache_bytes, self._state_store())
        self._cond = threading.Condition()
        self._waiting: deque[Group] = deque()  # guarded by _cond
        self._wake = False  # guarded by _cond: a cancel to handle
        self._stopping = False
        self._live = 0  # guarded by _cond: requests submitted and not finished
        # Engine thread only (read by `gauges`, which only copies and counts): prefill work
        # in line (`_next_work` picks); requests whose prompt is read, with choices to start; rows with their first
        # token, to join the batch this turn (with the state they start from); the decoding rows.
        self._prefilling: deque[Prefill] = deque()
        self._starting: deque[Group] = deque()
        self._joining: list[tuple[Row, State]] = []
        self._batch = DecodeBatch(model, self.config.name)
        self.pace = PrefillPace(self.config.prefill_chunk, self.config.prefill_share)  # a turn's prefill budget
        self.budget = self.config.prefill_chunk  # the last turn's prefill budget (a gauge)
        self.clock = device_clock(model.device)  # what a turn's work is timed by (a test may give a fake one)
        self._reading = 0  # requests admitted with no choice started (Group.reading)
        self._prompt_tokens_read = 0  # by PromptPrefill work, ever (`_urgency`)
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._warm = False  # warmed up (see _warm_up)
        # Prompt pieces beside the decode steps (beside.py; set up by `_warm_up`): the worker, the
        # piece in flight (its work is the worker's until `_collect`), the engine thread's thread
        # count alone and beside a piece, the count it reads prompts on in turns (all, or the
        # worker's where the bits depend on the count), and the count it runs on now.
        self._worker: PieceWorker | None = None
        self._piece: Piece | None = None
        self._threads = self._decode_threads = self._turn_prefill_threads = self._using = 0
        self.speculative = SpeculativeStats()  # of every speculating row (engine thread)
        self._draft = None  # the draft model's DraftModel, loaded at the first request that needs it

    def _state_store(self) -> StateStore | None:
        cfg = self.config
        if cfg.state_store is None:
            return None
        model = self.model
        return StateStore(
            cfg.state_store,
            cfg.state_store_bytes,
            model_key(model),
            # A file whose checksum and model key hold is a state this model computed: the layout
            # and finite values are checked, not the model's output from it (`State._probe`: a
            # 17-token forward with every position's logits, 50-70 ms of a 0.1B model's restored
            # first token, where the warm one takes about 120 ms; issue 38's target is 1.2x).
            check=lambda state: state.check_usable(model, probe=False),
            name=cfg.name,
            count=lambda what, n: self.metrics.inc(f"state_store_{what}_total", n),
        )

    # --- control (any thread) -------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread. The calling thread's OpenMP workers (it loaded the model) are
        freed first: with a second team alive, every parallel region of the engine waited for
        its worker to wake (rwkv_engine/threads.py: prefill about half as fast on two cores).
        Tensor work the caller does later starts them again; the engine's model work is meant
        to be the process's only parallel tensor work while it runs."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        release_openmp_threads()
        self._thread = threading.Thread(target=self._loop, name="rwkv-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def ready(self) -> bool:
        """Alive and warmed up: the first request will not wait for kernels to be built."""
        return self._warm and self.alive

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; requests still queued or running finish with reason "error"."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._worker is not None:
            self._worker.stop(timeout)
        if self.cache.store is not None:  # the states queued for the disk are written first
            self.cache.store.close(timeout)

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
        prepared = [self._prepare(request) for request, _ in requests]
        with self._cond:
            self._reserve(len(requests))
            handles = []
            for (request, sink), (samplers, streams) in zip(requests, prepared):
                group = Group(next(self._ids), request, sink, self.metrics, self._request_done)
                group.rows = [Row(group, i, s, t) for i, (s, t) in enumerate(zip(samplers, streams))]
                self._waiting.append(group)
                handles.append(Handle(self, group))
            self._cond.notify_all()
        return handles

    def submit_inputs(self, request: InputsRequest, sink: Sink) -> Handle:
        """Queue an embedding (or, with `request.query`, a rerank) request: `sink` gets one `Read`,
        or a `Finished` ("error", "cancelled"). Raises InputError (no inputs, no reranker, a task
        the model has no head for), QueueFull, EngineStopped."""
        if not request.inputs:
            raise InputError("no inputs to read")
        cfg = self.config
        if request.query is None:
            work = Embedding(self.model, request.inputs, request.task, request.normalize, cfg.prefill_chunk)
        elif self.reranker is None:
            raise InputError("this server has no reranker (start it with --reranker FILE)")
        else:
            cache = _DocumentCache(self.cache, self.metrics) if self.cache.capacity else None
            work = Reranking(self.reranker, request.inputs, request.query, cfg.prefill_chunk, cache)
        with self._cond:
            self._reserve(1)
            item = InputsPrefill(next(self._ids), work, sink, self.metrics, self._inputs_done)
            self._waiting.append(item)
            self._cond.notify_all()
        return Handle(self, item)

    def _reserve(self, n: int) -> None:
        """Count n more live requests, or raise (EngineStopped, QueueFull). Holding _cond."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
        # max_batch requests run (their prompts read, their choices decoded); the others wait.
        if self._live + n > self.config.max_batch + self.config.max_queue:
            waiting = max(0, self._live - self.config.max_batch)
            raise QueueFull(f"the server is busy: {waiting} requests are already waiting")
        self._live += n

    def _prepare(self, request: Request) -> tuple[list[Sampler], list[TextStream]]:
        """Check a request (its prompt ids are normalised in place); each choice's sampler and stream."""
        if not self.model.config.lm_head:
            raise InputError("this model embeds; it does not generate (it has no language-model head)")
        vocab = self.model.config.vocab_size
        request.prompt_ids = encode_prompt(self.tokenizer, request.prompt_ids, vocab)
        if request.start_state is not None and request.start_state.batch_size != 1:
            raise InputError(f"a start state must hold one sequence, got {request.start_state.batch_size}")
        self._check_choices(request)
        if request.speculative not in (None, "off", *SPECULATIVE_KINDS):
            raise InputError(
                f"speculative must be one of {', '.join(SPECULATIVE_KINDS)} or off, got {request.speculative!r}"
            )
        params = [choice_params(request.params, i) for i in range(request.n)]
        constraint = request.constraint
        if constraint is None:
            grammar = grammar_for(request.params, self.tokenizer, vocab)
            constraint = grammar and grammar.constraint
        samplers = [Sampler(p, vocab, constraint=constraint and constraint()) for p in params]
        return samplers, [TextStream(self.tokenizer, p) for p in params]

    def _check_choices(self, request: Request) -> None:
        n, k = request.n, request.logprobs
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise InputError(f"n must be an integer from 1 to {MAX_CHOICES}, got {n!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise InputError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {k!r}")

    def cancel(self, handle: Handle) -> None:
        """Cancel every choice of the request."""
        group = handle._group
        with self._cond:
            live = [r for r in group.rows if not (r.finished or r.cancelled)]
            if not live:
                return
            for r in live:
                r.cancelled = True
            if group in self._waiting:
                self._waiting.remove(group)
                for r in live:
                    r.finish("cancelled")
            else:
                self._wake = True
                self._cond.notify_all()

    def gauges(self) -> dict[str, float]:
        """requests_running: batch rows held and prompts being read; requests_waiting: requests
        queued, and requests whose prompt is read waiting for a batch row."""
        with self._cond:
            waiting = len(self._waiting)
        reading = sum(isinstance(w, (PromptPrefill, InputsPrefill)) for w in list(self._prefilling))
        starting = sum(g.running == 0 and not g.cancelled for g in list(self._starting))
        return {
            "requests_running": len(self._batch) + len(self._joining) + reading,
            "requests_waiting": waiting + starting,
            "prompt_cache_entries": len(self.cache),
            "prompt_cache_bytes": self.cache.nbytes,
            "prompt_cache_capacity_bytes": self.cache.capacity,
            **(self.cache.store.gauges() if self.cache.store is not None else {}),
            "max_batch": self.config.max_batch,
            "prefill_budget_tokens": self.budget,
            "speculative_acceptance_rate": self.speculative.acceptance_rate,
            "speculative_tokens_per_pass": self.speculative.tokens_per_pass,
        }

    # --- the engine thread: the loop and its turn ---------------------------------------------------

    def _warm_up(self) -> None:
        """One prefill and one decode step on a throwaway state before the first request: the
        native kernels are built (or loaded from their cache) on first use, which can take
        many seconds, and the first call of each path allocates its buffers. The prefill is as
        long as a prompt piece can be, so the heap grows to a piece's size now: a 0.1B server's
        first 160-token piece after a start took 15-30 ms longer than the same piece later
        (fresh pages), and a conversation restored from --state-store is timed against a warm
        one (issue 38: at most 1.2x). It costs 0.1 s on the 0.1B shape and 1 s on the 1.5B one
        (Xeon, 2 threads)."""
        t0 = time.perf_counter()
        cfg = self.config
        if cfg.speculative == "draft" or cfg.draft is not None:  # loaded now, not in a request's turn
            self._draft = make_drafter("draft", self.model, cfg.draft, cfg.draft_quantization)
        if not self.model.config.lm_head:  # an embedder only ever prefills
            self.model.prefill([0] * (GEMV_MAX_ROWS + 1))
        else:
            _, state = self.model.forward([0] * (cfg.prefill_chunk + GEMV_MAX_ROWS))  # the GEMM / chunked-WKV path
            decode_rows(self.model, torch.zeros(1, 1, dtype=torch.long), state)  # the per-row step
        # The 16-bit GEMM's kernels for every padded row count a prompt piece can have: built on
        # first use, 20-30 ms a new length on the 0.1B shape (quant.linear.GEMM_ROW_STEP).
        warm_gemms(self.model, cfg.prefill_chunk + GEMV_MAX_ROWS)
        self._set_up_beside()
        self._measure_pieces()
        print(f"{self.config.name}: ready (warm-up {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

    def _set_up_beside(self) -> None:
        """Start the prefill worker (beside.py) where it can run: a CPU model that generates, and
        `prefill_threads` (default half the engine thread's) in [1, threads). A piece's bits must
        not depend on the thread count that reads it (a request's answer would then depend on
        the load): a piece is read on both counts and compared, and where the logits differ
        (oneDNN's AMX GEMMs: their blocking depends on the thread count) every prompt piece is
        read on the worker's count, in turns too, with a note."""
        cfg, model = self.config, self.model
        self._threads = self._turn_prefill_threads = self._using = torch.get_num_threads()
        threads = cfg.prefill_threads if cfg.prefill_threads is not None else self._threads // 2
        if not threads or model.device.type != "cpu" or not model.config.lm_head:
            return
        if threads >= self._threads:
            print(
                f"{cfg.name}: --prefill-threads {threads} leaves no thread to decode on "
                f"({self._threads} in all): prefill and decode take turns",
                file=sys.stderr,
            )
            return
        ids = list(range(WKV_CHUNK + GEMV_MAX_ROWS))  # the GEMM / chunked-WKV path
        alone = model.forward(ids)[0]
        self._use(threads)
        try:
            warm_gemms(model, cfg.prefill_chunk + GEMV_MAX_ROWS)  # (built per thread count)
            beside = model.forward(ids)[0]
        finally:
            self._use(self._threads)
        if not torch.equal(alone, beside):
            print(
                f"{cfg.name}: a prompt piece read on {threads} threads differs from the same piece on "
                f"{self._threads}: every prompt is read on {threads} (--prefill-threads 0: all threads, "
                "taking turns with decode)",
                file=sys.stderr,
            )
            self._turn_prefill_threads = threads
        self._decode_threads = self._threads - threads
        self._worker = PieceWorker(threads, cfg.name)
        self._worker.start()

    def _use(self, threads: int) -> None:
        """Run the engine thread's tensor work on `threads` threads (threads.use_threads)."""
        if threads != self._using:
            use_threads(threads)
            self._using = threads

    def _measure_pieces(self) -> None:
        """Time prompt pieces of 32, 64, 128, ... tokens up to the chunk, for the pace's cost
        curve (pace.py): under load the pace reads what the curve says a turn's time buys, and
        it learns what longer pieces cost only from pieces it has read; from a start with a queue
        of prompts the turns' time bought only short pieces, which then was all it knew (issue
        38: 64 streams read their prompts in pieces of 45-50 tokens). About the time of two
        chunks' prefill (0.3 s on the 0.1B shape on two cores). On the thread count that turns
        read prompts on."""
        if not self.config.prefill_share or not self.model.config.lm_head:
            return
        self._use(self._turn_prefill_threads)
        n, chunk = WKV_CHUNK, self.config.prefill_chunk
        while n <= chunk:
            t = self.clock()
            self.model.prefill([0] * n)
            self.pace.prefilled(n, self.clock() - t)
            n *= 2

    def _loop(self) -> None:
        try:
            try:
                self._warm_up()
            except Exception as e:
                print(f"{self.config.name}: the warm-up forward failed; nothing can be served:", file=sys.stderr)
                traceback.print_exception(e, file=sys.stderr)
                return
            self._warm = True
            while True:
                with self._cond:
                    while not (self._stopping or self._wake or self._waiting or self._has_work()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    self._wake = False
                    self._drop_cancelled()
                    self._admit()
                try:
                    self._turn()
                except Exception as e:  # a bug here: drop what is in flight, keep serving
                    self._fail(self._clear(), e)
        finally:
            self._shutdown()

    def _has_work(self) -> bool:
        return bool(self._prefilling or self._starting or self._batch.rows)

    def _turn(self) -> None:
        """One turn's model work: prefill under the turn's token budget (`PrefillPace`: the whole
        chunk, or while rows decode about `prefill_share` decode steps' time of it), then choices
        start on the free rows (their first token) and join the batch, then one decode step.

        (Each part is its own method so that a turn can be arranged differently, e.g. a prefill
        piece and the decode step's passes run as one forward under one token budget.)"""
        beside = self._beside()
        if self._piece is not None and (self._piece.done or not beside):
            self._collect()  # (waits for it where the engine thread has nothing else to do)
        if self._prefilling:
            if beside:
                self._hand_over()
            else:
                self._use(self._turn_prefill_threads)
                t0 = self.clock()
                jobs_only = all(isinstance(w, InputsPrefill) for w in self._prefilling)
                prompts = sum(not isinstance(w, InputsPrefill) for w in self._prefilling) + len(self._waiting)
                self.budget = self.pace.budget(len(self._batch.rows), jobs_only=jobs_only, prompts=prompts)
                self._prefill(self.budget, t0)
                self.metrics.inc("engine_seconds_total", self.clock() - t0, phase="prefill")
        if self._starting:
            self._start_choices()
        if self._joining:
            self._batch.join(self._joining)
            self._joining = []
        if self._batch.rows:
            alone = self._piece is None
            self._use(self._threads if alone else self._decode_threads)
            t0 = self.clock()
            self._decode_step()
            if alone:  # (the pace's budgets are for turns on all threads)
                self.pace.decoded(self.clock() - t0)

    def _beside(self) -> bool:
        """Whether this turn's prefill runs beside the decode steps (beside.py): a worker, rows
        decoding, and no draft catching up (a draft's catch-up reads its row's context, which the
        decode step extends: it runs on the engine thread, between two steps)."""
        return (
            self._worker is not None
            and bool(self._batch.rows)
            and not any(isinstance(w, DraftPrefill) for w in self._prefilling)
        )

    def _hand_over(self) -> None:
        """Give the prefill worker the next piece (`_next_work`'s, a whole chunk) if it is free."""
        if self._piece is not None:
            return
        work = self._next_work([])
        if work is None:
            return
        if isinstance(work, InputsPrefill) and self._starting:
            self._start_choices()  # first tokens from the prompts read, before the job's piece
        if work.done:
            self._requeue(work)
            return
        chunk = self.config.prefill_chunk
        self._piece = self._worker.submit(work, lambda: self._step(work, chunk, chunk))

    def _collect(self) -> None:
        """Take back the piece in flight (waiting for it if need be) and do what `_prefill` does
        after a piece: count it, and requeue its work or finish it."""
        piece, self._piece = self._piece, None
        piece.wait()
        work = piece.work
        self.metrics.inc("prefill_beside_seconds_total", piece.seconds)
        if piece.error is not None:
            if work in self._prefilling:
                self._prefilling.remove(work)
            self._fail(work.rows, piece.error)
            return
        self._count_piece(work, piece.n)
        for other in self._prefilling:
            if isinstance(other, InputsPrefill):
                other.starved = other is not work
        if any(r.cancelled for r in work.rows):  # cancelled while it was read: no next piece
            self._drop(work)
            return
        self._requeue(work)

    def _clear(self) -> list[Row]:
        """Forget every admitted request (after the piece in flight); returns their rows."""
        if self._piece is not None:
            self._piece.wait()
            self._piece = None
        rows = [r for w in self._prefilling if isinstance(w, (PromptPrefill, InputsPrefill)) for r in w.rows]
        rows += [r for g in self._starting for r in g.to_start]
        rows += self._batch.clear() + [r for r, _ in self._joining]
        self._prefilling.clear()
        self._starting.clear()
        self._joining = []
        return rows

    # --- admission and prefill ----------------------------------------------------------------------

    def _admit(self) -> None:
        """Admit waiting requests while fewer than max_batch prompts are being read (or wait for
        their first row). A prompt is read without holding batch rows: its choices take them
        when they start (`_start_choices`), so a long prompt, or an echo that never decodes,
        keeps no other request from starting."""
        while self._waiting and self._reading < self.config.max_batch:
            group = self._waiting.popleft()
            group.reading = True
            self._reading += 1
            if isinstance(group, InputsPrefill):
                self._prefilling.append(group)
                continue
            work = PromptPrefill(group, self.model, self.cache, self.metrics)
            work.arrival = self._prompt_tokens_read
            self._prefilling.append(work)
            self.metrics.inc("prompt_tokens_total", len(group.request.prompt_ids))

    def _drop(self, work: Prefill) -> None:
        """Take cancelled (or stale) prefill work out of line; its requests end "cancelled"."""
        self._prefilling.remove(work)
        for r in work.rows:
            r.finish("cancelled")

    def _drop_cancelled(self) -> None:
        flying = self._piece.work if self._piece is not None else None  # dropped once it is back
        for work in [w for w in self._prefilling if w is not flying and (w.done or any(r.cancelled for r in w.rows))]:
            self._drop(work)
        for group in [g for g in self._starting if g.cancelled]:
            self._starting.remove(group)
            for r in group.to_start:
                r.finish("cancelled")
            group.to_start.clear()
        rows = self._batch.rows
        if any(r.cancelled for r in rows):
            for r in rows:
                if r.cancelled:
                    r.finish("cancelled")
            self._batch.keep([i for i, r in enumerate(rows) if not r.cancelled])

    def _prefill(self, budget: int, t0: float) -> int:
        """Pieces of the prefill work while `budget` tokens are left, and while streams decode
        time in the turn begun at `t0` (`PrefillPace.left`); returns the tokens read. Each piece's
        time goes to the pace's cost curve.

        The next work's (`_next_work`) next piece, cut to the budget left, after which the work
        goes to the back of the line (the order among equals); a piece that does not fit in what
        is left waits for the next turn, and the next work's piece is tried. So a turn reads at
        most `budget` tokens (a turn's first piece always runs, whole if nothing shorter is
        allowed, `prefill_piece_end`: it may pass a budget of at least min(chunk, 32) by up to
        GEMV_MAX_ROWS tokens). Prompts (and drafts) go before inputs work (embeddings, rerank),
        which reads what they leave, so a chat's prompt is not held behind a large embedding
        job, and the choices of the prompts read start (their first tokens go out) before the
        job's piece runs; an inputs work that read nothing in its last turn goes first, so a
        stream of chats does not stall the job either."""
        left, total = budget, 0
        tried: list[Prefill] = []  # work whose piece did not fit this turn
        read: list[Prefill] = []
        while left > 0:
            work = self._next_work(tried)
            if work is None:
                break
            if isinstance(work, InputsPrefill) and self._starting:
                self._start_choices()  # first tokens from the prompts read, before the job's piece
            if not work.done:
                try:
                    t = self.clock()
                    n = self._step(work, left, budget)
                    if n:
                        self.pace.prefilled(n, self.clock() - t)
                except Exception as e:  # one request's failure must not stop the others
                    self._prefilling.remove(work)
                    self._fail(work.rows, e)
                    continue
                if n == 0 and not work.done:
                    tried.append(work)
                    continue
                read.append(work)
                total += n
                left = self.pace.left(left - max(1, n), self.clock() - t0)
                self._count_piece(work, n)
            self._requeue(work)
        for work in self._prefilling:
            if isinstance(work, InputsPrefill):
                work.starved = work not in read
        return total

    def _count_piece(self, work: Prefill, n: int) -> None:
        """Count a piece of `n` tokens read (none: nothing), for the metrics and `_urgency`."""
        if n:
            self.metrics.inc("prefill_pieces_total")
            if isinstance(work, PromptPrefill):
                self._prompt_tokens_read += n

    def _step(self, work: Prefill, left: int, budget: int) -> int:
        """`work`'s next piece of at most `left` tokens; where none that short is allowed and
        `left` is the whole `budget`, its natural piece (at most GEMV_MAX_ROWS past the chunk).
        The tokens read."""
        chunk = self.config.prefill_chunk
        n = work.step(chunk, left)
        if n == 0 and left == budget:  # no shorter piece is allowed: the natural one
            n = work.step(chunk, chunk + GEMV_MAX_ROWS)
        return n

    def _requeue(self, work: Prefill) -> None:
        """After a piece of `work`: to the back of the line, or, read, on to what follows."""
        self._prefilling.remove(work)
        if not work.done:
            self._prefilling.append(work)  # to the back of the line
            return
        try:
            self._prefilled(work)
        except Exception as e:
            self._fail(work.rows, e)

    def _next_work(self, tried: list[Prefill]) -> Prefill | None:
        """The prefill work whose piece comes next (not one of `tried`): an inputs work that read
        nothing last turn; else the prompt or draft that comes first by `_urgency`; else the first
        inputs work."""
        line = [w for w in self._prefilling if w not in tried]
        starved = next((w for w in line if isinstance(w, InputsPrefill) and w.starved), None)
        if starved is not None:
            return starved
        prompts = [w for w in line if not isinstance(w, InputsPrefill)]
        if prompts:
            return min(prompts, key=self._urgency)  # the first in line of equals
        return line[0] if line else None

    def _urgency(self, work: Prefill) -> float:
        """Which prompt is read first (the least): the one with the fewest tokens left to read,
        less half of what the other prompts read while it waited. Shortest first gives the most
        first tokens soonest (a short prompt waits for at most the piece in flight); the credit
        for waiting bounds how long a long prompt can be passed over: after its own length read
        twice over by others, nothing that arrives later goes before it. A draft catching up goes
        first (its row decodes without drafts meanwhile)."""
        if not isinstance(work, PromptPrefill):
            return float("-inf")
        return len(work.ids) - work.pos - (self._prompt_tokens_read - work.arrival) / 2

    def _prefilled(self, work: Prefill) -> None:
        """What follows a finished piece of prefill work: a request's prompt read starts its
        choices; a draft model that caught up lets its row draft again. (Another kind of work
        ends its own way: an embedding request, say, would pool its hidden states here and
        finish, taking no batch row.)"""
        if isinstance(work, PromptPrefill):
            self._prompt_read(work)
        elif isinstance(work, InputsPrefill):
            work.deliver()
        elif isinstance(work, DraftPrefill):
            work.row.catching_up = False

    def _prompt_read(self, work: PromptPrefill) -> None:
        """A request's prompt is read: echo it; then its choices wait to start (`_starting`)."""
        group = work.group
        req, rows = group.request, group.rows
        if req.echo:
            prompt = tuple(work.prompt_logprobs) if req.logprobs is not None else None
            for row in rows:
                row.send(Prompt(prompt, row.index))
        if req.params.max_tokens == 0:
            for row in rows:
                row.emit(row.stream.finish("length"))
                row.finish(row.stream.finish_reason)
            return
        group.logits, group.state = work.logits, work.state
        group.to_start.extend(r for r in rows if not r.finished)
        self._starting.append(group)

    def _start_choices(self) -> None:
        """Start waiting choices on the free batch rows, requests in the order their prompts were
        read, at most `rows_per_request` rows per request at once: each samples its first token
        from the prompt's last logits; those that go on join the batch."""
        free = self.config.max_batch - len(self._batch) - len(self._joining)
        cap = self.config.rows_per_request
        for group in list(self._starting):
            while free > 0 and group.to_start and group.running < cap:
                rows = [group.to_start.popleft() for _ in range(min(free, cap - group.running, len(group.to_start)))]
                try:
                    joined = self._first_tokens(group, rows)
                except Exception as e:
                    self._fail(rows, e)
                    continue
                free -= joined
            if not group.to_start:
                self._starting.remove(group)
                group.logits = group.state = None

    def _first_tokens(self, group: Group, rows: list[Row]) -> int:
        """Sample each of `rows`' first token from the prompt's last logits; the rows that go on
        join the batch. Returns how many joined."""
        logits = group.logits[None].expand(len(rows), -1)
        tokens = Sampler.sample_batch([r.sampler for r in rows], logits)
        joined = 0
        for row, token, entry in zip(rows, tokens, token_entries(rows, logits, tokens)):
            if row.push(token, entry):
                row.next_token = token
                self._speculate(row, token)
                row.decoding = True
                group.running += 1
                self._joining.append((row, group.state))
                joined += 1
        if joined and group.reading:
            group.reading = False
            self._reading -= 1
        return joined

    def _speculate(self, row: Row, token: int) -> None:
        """Make a row that asked for speculative decoding (and no log-probabilities) speculate."""
        req = row.group.request
        kind = self.config.speculative if req.speculative is None else req.speculative
        if kind in (None, "off") or req.logprobs is not None:
            return
        if kind == "draft" and self._draft is None:
            cfg = self.config
            self._draft = make_drafter("draft", self.model, cfg.draft, cfg.draft_quantization)
        drafter = drafter_for(self._draft if kind == "draft" else kind, self.model, row.sampler.params)
        # A draft more than one pass behind the row's context catches up as prefill work
        # (DraftPrefill, queued by the decode step), never inside a decode step.
        spec = SpeculativeRow(
            drafter, row.sampler, req.prompt_ids, self.config.max_draft, self.speculative, max_lag=MAX_PASS_TOKENS
        )
        spec.limit = row.sampler.params.max_tokens
        spec.take(token)
        row.spec = spec

    # --- the decode step ------------------------------------------------------------------------------

    def _decode_step(self) -> None:
        """One step of the decoding batch (`DecodeBatch.step`), counted; then a speculating row
        whose draft fell more than a pass behind gets the draft's catch-up queued as prefill work."""
        metrics, sp = self.metrics, self.speculative
        counts = (sp.passes, sp.drafted, sp.accepted, sp.emitted)
        metrics.inc("decode_steps_total")
        metrics.inc("decode_rows_total", len(self._batch))
        for phase, seconds in zip(("forward", "sample", "stream"), self._batch.step()):
            metrics.inc("engine_seconds_total", seconds, phase=phase)
        for name, now, before in zip(
            ("passes", "drafted_tokens", "accepted_tokens", "emitted_tokens"),
            (sp.passes, sp.drafted, sp.accepted, sp.emitted),
            counts,
        ):
            if now != before:
                metrics.inc(f"speculative_{name}_total", now - before)
        for row in self._batch.rows:
            if row.spec is not None and row.spec.behind and not row.catching_up:
                self._prefilling.append(DraftPrefill(row))

    # --- the end of a request ------------------------------------------------------------------------

    def _request_done(self, group: Group) -> None:
        """Every choice of a request has finished: its prompt slot and state are free."""
        if group.reading:
            group.reading = False
            self._reading -= 1
        group.logits = group.state = None
        with self._cond:
            self._live -= 1

    def _inputs_done(self, item: InputsPrefill) -> None:
        if item.reading:
            item.reading = False
            self._reading -= 1
        with self._cond:
            self._live -= 1

    def _fail(self, rows: list[Row], error: Exception) -> None:
        fail(rows, error, self.config.name)

    def _shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            left = [r for group in self._waiting for r in group.rows] + self._clear()
            self._waiting.clear()
        for row in left:
            row.finish("error", "the server is shutting down")


class _DocumentCache:
    """The prompt cache as a reranking's store of document-prefix states (embedding.Reranking);
    each look-up counted (rerank_cache_hits_total, rerank_cache_misses_total)."""

    def __init__(self, cache: PromptCache, metrics: Metrics):
        self.cache, self.metrics = cache, metrics

    def get(self, ids: list[int]) -> State | None:
        state = self.cache.get("", ids)
        self.metrics.inc("rerank_cache_hits_total" if state is not None else "rerank_cache_misses_total")
        return state

    def put(self, ids: list[int], state: State) -> None:
        self.cache.put("", ids, state)
