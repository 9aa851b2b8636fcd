"""Text embeddings and reranking (docs/models.md, Embeddings and reranking).

    vectors = rwkv_engine.embed(model, ["first text", "second text"])        # Tensor [2, D], fp32
    reranker = rwkv_engine.load_reranker(model, "rwkv0b1-reranker.pth")
    scores = reranker.rerank(tokenizer, "a query", ["doc one", "doc two"])  # Tensor [2], in (0, 1)

Two poolings of the final hidden states (after ln_out), chosen by the model:

* An EmbeddingRWKV model (its checkpoint has task heads, PyPI `rwkv-emb`): every input gets the
  end token END_TOKEN appended; the embedding is the mean of the hidden states at the end-token
  positions, through the chosen task head (retrieval by default), not normalized: what its
  reference code computes, so vectors match the ones a `rwkv-emb` user has indexed.
* Any other RWKV model: the mean of the hidden states over every position of the input, scaled
  to unit length. An LM's last hidden state is trained to predict the next token and is dominated
  by the last few tokens; the mean reads the whole text, and is the pooling that works best for
  decoder models that were never trained to embed. Unit length makes a dot product a cosine, as
  OpenAI's embeddings are.

Inputs of different lengths share a batch right-padded: the model is causal, so the padding after
an input's last token changes none of its positions, and the pooling reads only those. The
inputs are sorted by length first so the padding is small.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .config import TASKS
from .errors import InputError, ModelOutputError
from .state import State

Tensor = torch.Tensor

END_TOKEN = 65535  # EmbeddingRWKV's end of text (`rwkv_emb`'s tokenizer, add_eos=True)
DEFAULT_TASK = "retr"  # the task head `rwkv_emb` applies when none is named
BATCH_TOKENS = 4096  # rows x padded length per embedding forward: bounds its memory

# The reranker's text layout (`rwkv_emb`'s offline mode): the document prefix, whose state can be
# kept, then the query with the end token. The instruction is the one it was trained with.
DEFAULT_INSTRUCTION = "Given a query, retrieve documents that answer the query"
DOCUMENT_TEMPLATE = "Instruct: {instruction}\nDocument: {document}\n"
QUERY_TEMPLATE = "Query: {query}"


def is_embedder(model) -> bool:
    """Whether `model` is an EmbeddingRWKV model (end-token pooling and task heads)."""
    return bool(model.config.task_heads)


def pooling(model) -> str:
    """The pooling `embed` applies for `model`: "end-token" or "mean" (the module docstring)."""
    return "end-token" if is_embedder(model) else "mean"


def check_task(model, task: str | None) -> str | None:
    """The task head to use (EmbeddingRWKV: DEFAULT_TASK when None); InputError for a task the
    model has no head for, or any task on a model without task heads."""
    heads = model.config.task_heads
    if not heads:
        if task is not None:
            raise InputError(
                f"task {task!r}: this model has no task heads (they are EmbeddingRWKV's); it embeds with mean pooling"
            )
        return None
    task = DEFAULT_TASK if task is None and DEFAULT_TASK in heads else task
    if task is None or task not in heads:
        what = "a task" if task is None else f"task {task!r}"
        raise InputError(f"{what}: this model's task heads are {', '.join(heads)} (of {', '.join(TASKS)})")
    return task


def encode(model, tokenizer, inputs) -> list[list[int]]:
    """The token ids `embed` runs for `inputs`: a string, a list of strings, a list of ids or a
    list of lists of ids. For an EmbeddingRWKV model each gets END_TOKEN appended (ids that end
    with it already are taken as they are). InputError for an empty input or an id outside the
    vocabulary, naming the input."""
    texts = _as_list(inputs)
    V = model.config.vocab_size
    out = []
    for i, item in enumerate(texts):
        if isinstance(item, str):
            if tokenizer is None:
                raise InputError("texts need a tokenizer (rwkv_engine.load_tokenizer(model))")
            ids = list(tokenizer.encode(item))
        else:
            ids = list(item)
        where = "the input" if len(texts) == 1 else f"input {i}"
        if not ids:
            raise InputError(f"{where} is empty")
        if is_embedder(model) and ids[-1] != END_TOKEN:
            ids.append(END_TOKEN)
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise InputError(f"{where}: token id {bad} is outside the vocabulary [0, {V})")
        out.append(ids)
    return out


def _as_list(inputs) -> list:
    """inputs as a list of items, each a string or a list of int ids."""
    if isinstance(inputs, str):
        return [inputs]
    if isinstance(inputs, Tensor):
        inputs = inputs.tolist()
    if not isinstance(inputs, Sequence) or not inputs:
        raise InputError("inputs must be a string, a list of strings, or token ids (a list of ints or of lists)")
    if all(_is_id(t) for t in inputs):
        return [list(inputs)]
    for i, item in enumerate(inputs):
        ok = isinstance(item, str) or (isinstance(item, Sequence) and all(_is_id(t) for t in item))
        if not ok:
            raise InputError(f"input {i} must be a string or a list of token ids, got {type(item).__name__}")
    return [item if isinstance(item, str) else list(item) for item in inputs]


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def embed_ids(
    model,
    seqs: Sequence[Sequence[int]],
    task: str | None = None,
    normalize: bool | None = None,
    batch_tokens: int = BATCH_TOKENS,
    progress: Callable[[int], None] | None = None,
) -> Tensor:
    """The embeddings [N, D] (fp32, on the CPU) of N token sequences as `encode` gives them.

    normalize: scale each to unit length (None: the model's default, module docstring).
    progress(n), when given, is called after each batch with the number of sequences it held.
    """
    job = Embedding(model, seqs, task, normalize, batch_tokens)
    while not job.done:
        before = job.completed
        job.step()
        if progress is not None and job.completed > before:
            progress(job.completed - before)
    return job.vectors


class Embedding:
    """N token sequences embedded piece by piece, each piece at most `budget` padded tokens
    (`step`), so a caller can interleave other work between pieces: the serving engine reads
    one piece per turn beside the prompts, each cut to what is left of the turn's prefill
    budget (serve/engine.py), and `embed_ids` reads them all in a row with the whole budget.

    Inputs sorted by length share right-padded batches of rows x longest <= the piece's budget;
    an input longer than that is a batch of its own, read in pieces of at most the budget, its
    state and partial pool carried. A smaller budget makes smaller batches (or shorter pieces of
    a long input), which changes a vector only in its last bits (the GEMM's rounding): an input
    alone, in a batch, or cut anywhere gets the same vector within rel-RMS 1e-5
    (tests/test_embedding.py). `vectors` [N, D] (fp32, CPU) is complete once `done`.
    """

    def __init__(self, model, seqs: Sequence[Sequence[int]], task=None, normalize=None, budget: int = BATCH_TOKENS):
        self.model, self.seqs, self.budget = model, seqs, max(1, budget)
        self.task = check_task(model, task)
        self.normalize = not is_embedder(model) if normalize is None else normalize
        self.vectors = torch.empty(len(seqs), model.config.n_embd)
        self.tokens = sum(len(s) for s in seqs)
        self.completed = 0  # inputs whose vector is in `vectors`
        self.done = not seqs
        self._order = deque(sorted(range(len(seqs)), key=lambda i: len(seqs[i])))  # not started yet
        # The batch being read (an input longer than a piece's budget): its inputs, running pool,
        # state and the position its next piece starts at.
        self._batch: list[int] = []
        self._pool: _Pool | None = None
        self._state: State | None = None
        self._pos = 0

    def step(self, budget: int | None = None) -> int:
        """Read the next piece, of at most `budget` padded tokens (None, and at most: the job's
        `budget`); the number of (padded) tokens it read, 0 when no piece fits."""
        budget = self.budget if budget is None else min(budget, self.budget)
        if self.done or budget < 1:
            return 0
        with torch.inference_mode():
            if self._pool is None:
                self._start(budget)
            pool, rows, pos = self._pool, len(self._batch), self._pos
            width = budget // rows  # positions this piece reads
            if width == 0:
                return 0
            end = min(pos + width, pool.ids.shape[1])
            self._state = self.model.prefill(pool.ids[:, pos:end], self._state, each=lambda s, x: pool.take(pos + s, x))
            self._pos = end
            if end == pool.ids.shape[1]:
                self._finish(self._batch, pool.result())
                self._batch, self._pool, self._state, self._pos = [], None, None, 0
                self.done = not self._order
            return rows * (end - pos)

    def _start(self, budget: int) -> None:
        """Begin the next batch: the shortest inputs left, as many as fit in `budget` padded (at least one)."""
        order, seqs = self._order, self.seqs
        batch = [order.popleft()]
        while order and (len(batch) + 1) * len(seqs[order[0]]) <= budget:
            batch.append(order.popleft())
        self._batch, self._pool = batch, _Pool(self.model, [seqs[i] for i in batch])

    def _finish(self, batch: list[int], pooled: Tensor) -> None:
        if self.task is not None:
            pooled = self.model.task_heads[self.task](pooled)
        if not torch.isfinite(pooled).all():
            raise ModelOutputError("the model computed a non-finite embedding (its weights or the input overflow)")
        self.vectors[batch] = (F.normalize(pooled, dim=-1) if self.normalize else pooled).cpu()
        self.completed += len(batch)


class _Pool:
    """The running pool of one right-padded batch [B, T]: `take(start, x)` adds the piece of
    last-block outputs x [B, t, C] at positions start..; `result()` the pooled states [B, C] fp32."""

    def __init__(self, model, seqs: list[Sequence[int]]):
        self.model = model
        dev = model.device
        self.lengths = torch.tensor([len(s) for s in seqs], device=dev)
        ids = torch.zeros(len(seqs), int(self.lengths.max()), dtype=torch.long)  # (the padding's id: never read)
        for row, s in enumerate(seqs):
            ids[row, : len(s)] = torch.as_tensor(list(s))
        self.ids = ids.to(dev)
        self.end_token = is_embedder(model)
        self.sums = torch.zeros(len(seqs), model.config.n_embd, device=dev)
        self.counts = torch.zeros(len(seqs), 1, device=dev)

    def take(self, start: int, x: Tensor) -> None:
        h = self.model.final_norm(x)  # [B, t, C]
        pos = torch.arange(start, start + h.shape[1], device=h.device)
        read = pos[None] < self.lengths[:, None]  # [B, t]
        if self.end_token:
            read &= self.ids[:, start : start + h.shape[1]] == END_TOKEN
        self.sums.add_((h * read[..., None]).sum(1))
        self.counts.add_(read.sum(1, keepdim=True))

    def result(self) -> Tensor:
        return self.sums / self.counts


def embed(
    model,
    inputs,
    tokenizer=None,
    *,
    task: str | None = None,
    normalize: bool | None = None,
    batch_tokens: int = BATCH_TOKENS,
    progress: Callable[[int], None] | None = None,
) -> Tensor:
    """Embeddings of `inputs` (a string, a list of strings, a list of ids or a list of lists of
    ids): [N, D] fp32 on the CPU, or [D] for one string or one list of ids.

    tokenizer: for strings (default: the model's, `rwkv_engine.load_tokenizer`).
    task: an EmbeddingRWKV task head, "retr" (default), "cls" or "sts"; None for other models.
    normalize: unit length (default: False for EmbeddingRWKV, as its reference; True otherwise).
    progress(n): called after each batch with the number of inputs it held.
    """
    check_task(model, task)
    if tokenizer is None and _has_text(inputs):
        from .tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model)
    single = isinstance(inputs, str) or (
        isinstance(inputs, Sequence) and bool(inputs) and all(_is_id(t) for t in inputs)
    )
    vectors = embed_ids(model, encode(model, tokenizer, inputs), task, normalize, batch_tokens, progress)
    return vectors[0] if single else vectors


def _has_text(inputs) -> bool:
    return isinstance(inputs, str) or (isinstance(inputs, Sequence) and any(isinstance(t, str) for t in inputs))


class Reranker:
    """An EmbeddingRWKV model and its reranker (`load_reranker`).

    The embedder reads the instruction and a document (the document prefix, whose state does
    not depend on the query and can be kept), then the query and the end token. The reranker's
    few blocks start from the embedder's WKV states of some of its layers (`layers`; token-shift
    states zero), read one token (its one-row embedding), and its score head gives a logit;
    sigmoid(logit) is the relevance in (0, 1).
    """

    def __init__(self, embedder, scorer, layers: list[int], instruction: str = DEFAULT_INSTRUCTION):
        self.embedder, self.scorer, self.layers = embedder, scorer, list(layers)
        self.instruction = instruction

    def document_ids(self, tokenizer, document: str) -> list[int]:
        """The tokens of a document's prefix (instruction and document; no end token)."""
        return list(tokenizer.encode(DOCUMENT_TEMPLATE.format(instruction=self.instruction, document=document)))

    def query_ids(self, tokenizer, query: str) -> list[int]:
        """The tokens read after a document prefix: the query and the end token."""
        return [*tokenizer.encode(QUERY_TEMPLATE.format(query=query)), END_TOKEN]

    @torch.inference_mode()
    def logits(self, states: State) -> Tensor:
        """Relevance logits [B] from the embedder's states [B] after document prefix and query."""
        start = self.scorer.new_state(states.batch_size)
        kv = states.att_kv[:, self.layers].to(start.att_kv.device)
        start = State({k: kv if k == "att_kv" else v for k, v in start.items()}, start.signature)
        ids = torch.zeros(states.batch_size, 1, dtype=torch.long)
        h, _ = self.scorer.hidden(ids, start)  # [B, 1, C]
        out = self.scorer.score_head(h[:, -1])
        if not torch.isfinite(out).all():
            raise ModelOutputError("the reranker computed a non-finite score (its weights or the input overflow)")
        return out.cpu()

    @torch.inference_mode()
    def score_ids(self, document_states: State, query: Sequence[int]) -> Tensor:
        """Relevance logits [B] of one query's ids (with its end token) after B document prefix states."""
        ids = torch.as_tensor([list(query)] * document_states.batch_size)
        return self.logits(self.embedder.prefill(ids, document_states))

    def rerank(self, tokenizer, query: str, documents: Sequence[str], batch_tokens: int = BATCH_TOKENS) -> Tensor:
        """The relevance (sigmoid of the logit, in (0, 1)) of each document to the query: [N] fp32."""
        if not documents:
            raise InputError("documents is empty: give at least one")
        job = Reranking(self, [self.document_ids(tokenizer, d) for d in documents], self.query_ids(tokenizer, query))
        while not job.done:
            job.step()
        return job.scores


class Reranking:
    """One query against N documents, read piece by piece like an `Embedding` (`step`, `done`).

    The documents go in length order, in groups of budget // len(query) (so at most that many
    states are held). A group's document prefixes not in `cache` (get(ids) -> State | None,
    put(ids, state): the serving engine's prompt cache) are read, those of one length together
    as one batch (no padding, whose tokens would change the state), in pieces cut to the step's
    budget, and cached; then the query is read on top of the group's states, as many at once as
    the step's budget holds, and scored. `scores` [N] (sigmoid of the logits, CPU) once done;
    `cached`, the document tokens the cache gave."""

    def __init__(
        self, reranker: Reranker, documents: list[list[int]], query: list[int], budget=BATCH_TOKENS, cache=None
    ):
        self.reranker, self.documents, self.query = reranker, documents, list(query)
        self.budget, self.cache = max(1, budget), cache
        self.tokens = sum(len(d) for d in documents) + len(documents) * len(query)
        self.scores = torch.empty(len(documents))
        self.cached = 0  # document tokens taken from the cache
        self.done = not documents
        self._steps = self._run()
        next(self._steps)  # to the first `yield`: nothing is read before the first step

    def step(self, budget: int | None = None) -> int:
        """Read the next piece, of at most `budget` tokens (None, and at most: the job's `budget`);
        the number of tokens it read, 0 when no piece fits. Two rounding exceptions: a batch of
        equal documents reads at least one position of each (its rows were chosen to fit the
        budget of the step that began it), and a query longer than the job's budget is scored one
        document at a time."""
        budget = self.budget if budget is None else min(budget, self.budget)
        if self.done or budget < 1:
            return 0
        with torch.inference_mode():
            return self._steps.send(budget)

    def _run(self):
        """A generator: receives each step's budget, yields the tokens that step read."""
        budget = yield 0
        q = len(self.query)
        rows = max(1, self.budget // q)
        order = sorted(range(len(self.documents)), key=lambda i: len(self.documents[i]))
        for first in range(0, len(order), rows):
            group = order[first : first + rows]
            states: dict[int, State] = {}  # document -> the state after its prefix
            unread: dict[tuple[int, ...], list[int]] = {}  # a prefix to read -> its documents
            for i in group:
                key = tuple(self.documents[i])
                if key in unread:  # the same document twice: read once
                    unread[key].append(i)
                    continue
                state = self.cache.get(self.documents[i]) if self.cache is not None else None
                if state is None:
                    unread[key] = [i]
                else:
                    states[i] = state
                    self.cached += len(key)
            for _, same in itertools.groupby(unread, key=len):  # (unread is in length order)
                run = list(same)
                while run:
                    batch, run = run[:budget], run[budget:]
                    ids = torch.tensor(batch, device=self.reranker.embedder.device)
                    B, T = ids.shape
                    state, pos = None, 0
                    while pos < T:
                        width = max(1, budget // B)
                        state = self.reranker.embedder.prefill(ids[:, pos : pos + width], state)
                        read = B * (min(T, pos + width) - pos)
                        pos += width
                        budget = yield read
                    for row, key in enumerate(batch):
                        own = state[row].clone()
                        if self.cache is not None:
                            self.cache.put(list(key), own)
                        states.update((i, own) for i in unread[key])
            scored = 0
            while scored < len(group):
                n = min(len(group) - scored, budget // q)
                if n == 0:
                    if budget < min(q, self.budget):
                        budget = yield 0
                        continue
                    n = 1
                part = group[scored : scored + n]
                logits = self.reranker.score_ids(State.cat([states[i] for i in part]), self.query)
                self.scores[part] = torch.sigmoid(logits)
                scored += n
                self.done = first + scored == len(order)
                budget = yield n * q


def load_reranker(model, path, instruction: str = DEFAULT_INSTRUCTION, progress: bool = True) -> Reranker:
    """The reranker in checkpoint `path` (a `rwkv_emb` reranker file, or an EmbeddingRWKV file that
    holds one), bound to its embedding model `model`. CheckpointError when the file is not a
    reranker or does not fit `model` (docs/models.md)."""
    from .loading.reranker import load_scorer

    scorer, layers = load_scorer(model, path, progress)
    return Reranker(model, scorer, layers, instruction)
