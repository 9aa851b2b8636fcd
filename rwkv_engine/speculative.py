"""Speculative decoding: several tokens per pass over the weights, with the target's exact output.

Decode is memory-bound: one pass reads every weight once whatever few rows it carries. A draft
proposes k tokens; one `model.forward` of the row's not-yet-fed tokens plus the k drafts (on the
CPU the fused native step's several-tokens mode: the linears run all of them as rows of one
GEMV, the WKV recurrence steps through them, and each token gets the bits of a one-token step)
gives the target's logits at every draft position, and each position is decided in order
exactly as plain decoding would decide it:

* greedy: the draft token is accepted if it is the arg-max of the adjusted logits, else the
  arg-max is taken and the round ends, so the output is token for token plain greedy decoding;
* sampling: standard speculative rejection sampling. p is the sampler's distribution at that
  position (bias, bans, penalties over the tokens so far, the grammar mask, top-p, top-k,
  temperature: `Sampler`), q the draft's. The draft token d is accepted with probability
  min(1, p[d] / q[d]); otherwise a token is drawn from max(p - q, 0) normalized. A prompt-lookup
  draft is deterministic: q is a point mass. The accepted token's law is exactly p.

Each decided token goes through `Sampler.accept` (counts, grammar) and the `TextStream` (stop
tokens, stop strings, max_tokens) one at a time, so penalties, biases, masks and stops apply at
every verified position as in plain decoding; after every accepted draft one more token (the
correction, or the bonus token after a fully accepted draft) comes out of the same pass.

State rollback is O(1): `forward` never modifies the state it is given. A round starts from a
committed state S and the tokens P decided since S but not yet fed (at least the last one). The
pass runs P + drafts from S; when every draft is accepted its final state is the new S and P is
the bonus token; at a rejection S stays and P grows by the accepted drafts and the correction,
which the next pass feeds again as rows of its GEMVs (compute that a memory-bound pass hides;
no second pass over the weights). `SpeculativeDecoder.state` feeds P when asked.

Drafts (`Drafter`): `PromptLookup` (n-gram match over the prompt and the text so far) and
`DraftModel` (a smaller RWKV sharing the vocabulary, or the target's own quantized twin:
`quantized_twin`). The draft length follows a cost model (`SpeculativeRow.draft_length`): the
row's acceptance rate, what a draft token costs (nothing for prompt lookup, the draft model's
bytes for a model) and what verifying it costs pick the length that decides the most tokens per
unit of time; where no length beats plain decoding, drafting pauses for 1, 2, 4 ... 32 passes
between one-token probes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import InputError
from .sampling import Sampler, SamplingParams, check_finite, rwkv_probs, sample_rows
from .settings import DEFAULT_DRAFT_QUANTIZATION, DEFAULT_MAX_DRAFT, MAX_PASS_TOKENS, SPECULATIVE_KINDS, check_max_draft

Tensor = torch.Tensor

__all__ = [
    "Drafter",
    "PromptLookup",
    "DraftModel",
    "SpeculativeDecoder",
    "SpeculativeStats",
    "make_drafter",
    "drafter_for",
    "DEFAULT_MAX_DRAFT",
    "quantized_twin",
    "decide",
    "KINDS",
    "MAX_PASS_TOKENS",
    "check_max_draft",
]

# The kinds, the longest pass (MAX_PASS_TOKENS), the default draft length and its check are
# settings (rwkv_engine/settings.py, free of torch for the command line). A pass holds at most
# max_draft + 1 tokens (fewer drafts when tokens from a rejected round are pending).
KINDS = SPECULATIVE_KINDS

# The cost model that picks a row's draft length (`SpeculativeRow`), in decode steps: a pass of k
# drafts costs 1 + k VERIFY_COST (bench_speculative.py, batch 1: a pass of 8 tokens costs 1.1-1.4
# steps of a bf16 target, more of a q8 one) + k times the drafter's `cost` (0 for prompt lookup;
# for a draft model, the bytes it reads a step over the target's: `step_bytes`).
VERIFY_COST = 0.1
# The acceptance rate is estimated from the row's passes, older ones counting ACCEPTANCE_DECAY
# times less each pass, starting from PRIOR_ACCEPTANCE with the weight of PRIOR_DRAFTS drafts.
ACCEPTANCE_DECAY = 0.9
PRIOR_ACCEPTANCE = 0.6
PRIOR_DRAFTS = 2.0
# A model draft whose cost is unknown (no target to compare it with) is taken to cost this.
UNKNOWN_DRAFT_COST = 0.5


@dataclass
class SpeculativeStats:
    """What the speculation did: passes over the weights, tokens drafted and accepted."""

    passes: int = 0  # verify passes (model.forward calls during decode)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens decided by the passes (accepted drafts + corrections / bonus tokens)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted / self.passes if self.passes else 0.0

    def add(self, other: SpeculativeStats) -> None:
        self.passes += other.passes
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted


# --- drafts -----------------------------------------------------------------------------------


class Drafter:
    """Proposes up to k next tokens of a context (prompt + tokens so far).

    `propose(context, k)` returns (tokens, q): q is None for a deterministic draft (a point mass
    at each token), else a list of [V] distributions the tokens were drawn from. `cost`: what
    drafting one token costs, in decode steps of the target (None: unknown).
    """

    cost: float | None = 0.0

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], list[Tensor] | None]:
        raise NotImplementedError

    def prepare(self, context: Sequence[int]) -> None:
        """Read the context ahead of the first `propose` (with the target's prompt: prefill)."""

    def lag(self, context: Sequence[int]) -> int:
        """How many tokens of `context` the drafter has not read yet (`propose` reads them first)."""
        return 0

    def catch_up(self, context: Sequence[int], n: int) -> int:
        """Read up to n of the tokens `lag` counts, ahead of `propose`; how many it read."""
        return 0


class PromptLookup(Drafter):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last
    n tokens (n from `max_ngram` down to `min_ngram`). No model; strong where the output repeats
    its input (code edits, quoting, summaries, RAG)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise InputError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], None]:
        ctx = list(context)
        n_ctx = len(ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = ctx[n_ctx - n :]
            for start in range(n_ctx - n - 1, -1, -1):  # latest match first, not the tail itself
                if ctx[start : start + n] == tail:
                    follow = ctx[start + n : start + n + k]
                    if follow:
                        return follow, None
        return [], None


class DraftModel(Drafter):
    """A smaller RWKV (same vocabulary) as the draft: it proposes by decoding k tokens itself.

    It keeps its own state and the states after each token it drafted, so following what the
    target accepted costs no re-reading: the longest agreeing prefix's state is picked (O(1)
    rollback) and only the tokens after it are fed. Greedy targets draft greedily; sampled ones
    draw from the draft's own sampling distribution (same bias, temperature, top-p, top-k; no
    penalties or grammar, which the target's decision applies), prepared by `Sampler.prepare`
    like every draw, with a generator of its own (seeded from the target's seed ^ 0x5EED).
    """

    def __init__(
        self,
        model,
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        cost: float | None = None,
    ):
        self.model = model
        self.cost = cost  # see Drafter; `priced` sets it from a target
        self.params = params or SamplingParams(temperature=0.0)
        seed = 0x5EED if self.params.seed is None else self.params.seed ^ 0x5EED
        # (its counts stay empty: it never accepts a token, so no penalty applies)
        self._sampler = Sampler(self.params.replace(seed=seed), model.config.vocab_size, generator)
        self._ctx: list[int] = []  # tokens its base state covers
        self._states: list = []  # state after _ctx + drafted[:j], j = 0..len(drafted)
        self._drafted: list[int] = []
        self._logits: list[Tensor] = []  # logits after _ctx + drafted[:j]

    def for_params(self, params: SamplingParams, generator: torch.Generator | None = None) -> DraftModel:
        """A fresh draft over the same model for another sequence."""
        return DraftModel(self.model, params, generator, self.cost)

    def priced(self, target) -> DraftModel:
        """This draft with its cost per token measured against `target` (when not known yet)."""
        if self.cost is None:
            self.cost = step_bytes(self.model) / max(1, step_bytes(target))
        return self

    def checked(self, target) -> DraftModel:
        """This draft, priced, once its vocabulary is found to be the target's (InputError if not)."""
        mine, theirs = self.model.config.vocab_size, target.config.vocab_size
        if mine != theirs:
            raise InputError(f"the draft model's vocabulary ({mine}) is not the target's ({theirs})")
        return self.priced(target)

    def prepare(self, context: Sequence[int]) -> None:
        """The draft's own prefill of the prompt, so that the first pass drafts at once."""
        self.propose(context, 0)

    def lag(self, context: Sequence[int]) -> int:
        return len(self._follow(list(context))[2])

    def catch_up(self, context: Sequence[int], n: int) -> int:
        """Read the next n tokens of the context the draft has not read (a piece of its prefill:
        its prompt, or what it missed while drafting paused), from the state it has."""
        context = list(context)
        state, _, rest = self._follow(context)
        piece = rest[:n]
        if not piece:
            return 0
        logits, state = self.model.forward(piece, state=state)
        covered = len(context) - len(rest) + len(piece)
        self._ctx, self._states, self._logits, self._drafted = context[:covered], [state], [logits], []
        return len(piece)

    def _follow(self, context: list[int]) -> tuple[object, Tensor | None, list[int]]:
        """(state, logits after it or None, tokens of context after it) from what is kept."""
        n = len(self._ctx)
        if self._states and context[:n] == self._ctx:
            j = 0
            while j < len(self._drafted) and n + j < len(context) and context[n + j] == self._drafted[j]:
                j += 1
            return self._states[j], self._logits[j], context[n + j :]
        return None, None, context

    def propose(self, context: Sequence[int], k: int) -> tuple[list[int], list[Tensor] | None]:
        context = list(context)
        state, logits, rest = self._follow(context)
        if rest:
            logits, state = self.model.forward(rest, state=state)
        elif logits is None:
            return [], None
        self._ctx, self._states, self._logits, self._drafted = context, [state], [logits], []
        tokens: list[int] = []
        qs: list[Tensor] = []
        greedy, p = self.params.greedy, self.params
        for i in range(k):
            check_finite(logits, "the draft model's logits")
            adj = Sampler.prepare([self._sampler], logits[None])[0]
            if greedy:
                t = int(adj.argmax())
            else:
                q = rwkv_probs(adj, p.temperature, p.top_p, p.top_k)
                t = int(torch.multinomial(q, 1, generator=self._sampler.generator)[0])
                qs.append(q)
            tokens.append(t)
            if i + 1 < k:
                logits, state = self.model.forward([t], state=state)
                self._drafted.append(t)
                self._states.append(state)
                self._logits.append(logits)
        return tokens, (None if greedy else qs)


def step_bytes(model) -> int:
    """Bytes a decode step of `model` reads: every tensor but the embedding (one row a token)."""
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if not name.startswith("emb."))


def quantized_twin(model, quantization: str = DEFAULT_DRAFT_QUANTIZATION):
    """The target loaded again from its own checkpoint with `quantization` (the default draft)."""
    import rwkv_engine

    if model.path is None:
        raise InputError("the quantized-twin draft needs a model loaded from a file (model.path is unset)")
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(model.dtype, "auto")
    return rwkv_engine.load(model.path, device=model.device, dtype=dtype, quantization=quantization, progress=False)


def make_drafter(kind: str, target=None, draft=None, draft_quantization: str = DEFAULT_DRAFT_QUANTIZATION) -> Drafter:
    """A drafter by name, to share between sequences (`drafter_for` gives each its own): "lookup",
    or "draft" (`draft`, a model or a path, else the target's quantized twin)."""
    if kind == "lookup":
        return PromptLookup()
    if kind == "draft":
        import rwkv_engine

        if draft is None:
            draft = quantized_twin(target, draft_quantization)
        elif not isinstance(draft, torch.nn.Module):
            draft = rwkv_engine.load(draft, progress=False)
        return DraftModel(draft) if target is None else DraftModel(draft).checked(target)
    raise InputError(f"speculative must be one of {', '.join(KINDS)}, got {kind!r}")


def drafter_for(drafter: str | Drafter, target, params: SamplingParams) -> Drafter:
    """The drafter of one sequence decoding with `params` on `target` (`generate` and the serving
    engine both take theirs from here): a name is built first (`make_drafter`); a `DraftModel`,
    which keeps the sequence's draft state, is checked against the target and copied for these
    params; any other drafter keeps no per-sequence state and serves as it is."""
    if isinstance(drafter, str):
        drafter = make_drafter(drafter, target)
    if not isinstance(drafter, Drafter):
        raise InputError(f"speculative must be 'lookup', 'draft' or a Drafter, got {drafter!r}")
    if isinstance(drafter, DraftModel):
        drafter = drafter.checked(target).for_params(params)
    return drafter


# --- deciding one position ------------------------------------------------------------------


def decide(sampler: Sampler, logits: Tensor, draft: int | None, q: Tensor | None = None) -> tuple[int, bool]:
    """The token at one verified position and whether it is the draft token; updates the sampler.

    logits [V]: the target's at this position. draft: the proposed token (None: no draft, as in
    plain decoding). q: the draft's distribution it came from (None: a point mass at `draft`).
    What is decided from is what plain decoding draws from (`Sampler.prepare`: ModelOutputError
    on NaN or infinite logits, bias, penalties, the grammar mask).
    """
    p_ = sampler.params
    adjusted = Sampler.prepare([sampler], logits[None])
    if p_.greedy:
        t = int(adjusted[0].argmax())
    elif draft is None:
        t = sample_rows(adjusted, [p_.temperature], [p_.top_p], [p_.top_k], [sampler.generator])[0]
    else:
        p = rwkv_probs(adjusted[0], p_.temperature, p_.top_p, p_.top_k)
        pd = float(p[draft])
        qd = 1.0 if q is None else float(q[draft])
        u = float(torch.rand((), generator=sampler.generator, device=p.device))
        if pd > 0 and u * qd < pd:  # u < min(1, p/q)
            t = draft
        else:
            if q is None:
                residual = p.clone()
                residual[draft] = 0.0
            else:
                residual = (p - q.to(p.device)).clamp_min_(0.0)
            total = float(residual.sum())
            if not total > 0:  # p <= q everywhere means p == q: the draft is always accepted
                residual, total = p, 1.0
            t = int(torch.multinomial(residual / total, 1, generator=sampler.generator)[0])
    sampler.accept(t)
    return t, draft is not None and t == draft


# --- one sequence ---------------------------------------------------------------------------


class SpeculativeRow:
    """One sequence's speculation, without the model: what the next pass feeds, and the tokens
    its logits decide. `SpeculativeDecoder` drives it for `generate`; the serving engine drives
    many at once (their passes batched by length).

        feed = row.plan()                      # pending tokens + drafts, fed from the committed state
        logits, after = model.forward(feed, committed, all_logits=True)
        for token in row.decide(logits):       # stop iterating when the sequence ends
            ...
        if row.committed_all: committed = after    # every draft accepted (row.pending is the bonus)

    `pending` are the tokens decided since the committed state and not yet covered by it (the
    last decided token at least).

    max_lag: the most tokens the drafter may read inside a pass to catch up with the context
    (None: any number). Further behind, the row drafts nothing (`behind`) until the drafter has
    caught up elsewhere (`Drafter.catch_up`; the serving engine schedules that as prefill work).
    """

    def __init__(
        self,
        drafter: Drafter,
        sampler: Sampler,
        context: Sequence[int],
        max_draft: int = DEFAULT_MAX_DRAFT,
        stats=None,
        max_lag: int | None = None,
    ):
        check_max_draft(max_draft)
        self.drafter, self.sampler = drafter, sampler
        self.max_lag = max_lag
        self.behind = False
        self.context = list(context)
        self.pending: list[int] = []
        self.max_draft = max_draft
        self.stats = stats if stats is not None else SpeculativeStats()
        self.limit: int | None = None  # most tokens still wanted (None: unbounded); caps the drafts
        self.committed_all = False
        # The row's acceptance estimate: accepted / drafted over its passes, decayed (see above).
        self._accepted, self._drafted = PRIOR_ACCEPTANCE * PRIOR_DRAFTS, PRIOR_DRAFTS
        # When no draft length pays, drafting pauses for this many passes (doubling while it keeps
        # not paying), then one probe of a one-token draft refreshes the estimate.
        self._backoff = 0
        self._skip = 0
        self._probe = False
        self._drafts: list[int] = []
        self._qs: list[Tensor] | None = None

    @property
    def cost(self) -> float:
        """What drafting a token costs, in target decode steps (the drafter's, when known)."""
        return UNKNOWN_DRAFT_COST if self.drafter.cost is None else self.drafter.cost

    @property
    def acceptance(self) -> float:
        """The row's estimated probability that a draft token is accepted."""
        return self._accepted / self._drafted

    def draft_length(self) -> int:
        """The number of drafts for the next pass: the k that maximizes the expected tokens a pass
        decides, 1 + a + ... + a^k for acceptance a (each draft taken as accepted with
        probability a once its predecessors were), per unit of the pass's cost (see
        VERIFY_COST); 0 when no k beats plain decoding (1 token per step)."""
        if self._skip > 0:
            self._skip -= 1
            self._probe = self._skip == 0
            return 0
        if self._probe:
            self._probe = False
            return 1
        a = min(self.acceptance, 0.99)
        best_k, best = 0, 1.0
        expected = term = 1.0
        for k in range(1, self.max_draft + 1):
            term *= a
            expected += term
            gain = expected / (1.0 + k * (VERIFY_COST + self.cost))
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:
            self._backoff = min(32, 2 * self._backoff or 1)
            self._skip = self._backoff - 1
            self._probe = self._skip == 0
        else:
            self._backoff = 0
        return best_k

    def take(self, t: int) -> None:
        """Record a decided token (fed by the next pass)."""
        self.context.append(t)
        self.pending.append(t)
        if self.limit is not None:
            self.limit -= 1

    def plan(self, k: int | None = None) -> list[int]:
        """The tokens of the next pass: the pending ones, then up to k (default: `draft_length`)
        drafts, at most max_draft + 1 tokens in all (none while the drafter is `behind`)."""
        if k is None:
            self.behind = self.max_lag is not None and self.drafter.lag(self.context) > self.max_lag
            k = 0 if self.behind else self.draft_length()
        k = min(k, self.max_draft + 1 - len(self.pending))
        if self.limit is not None:
            k = min(k, self.limit - 1)
        drafts, qs = self.drafter.propose(self.context, k) if k > 0 else ([], None)
        self._drafts, self._qs = drafts[: max(k, 0)], qs
        return self.pending + self._drafts

    def decide(self, logits: Tensor):
        """Tokens decided from the pass's logits [len(plan), V], in order, each taken as it is
        yielded; sets `committed_all` when every draft was accepted (the caller then takes the
        pass's state as committed; `pending` is the bonus token alone)."""
        drafts, qs, st = self._drafts, self._qs, self.stats
        self.committed_all = False
        st.passes += 1
        st.drafted += len(drafts)
        base = len(self.pending) - 1
        for i in range(len(drafts) + 1):
            d = drafts[i] if i < len(drafts) else None
            t, ok = decide(self.sampler, logits[base + i], d, None if qs is None or d is None else qs[i])
            st.emitted += 1
            st.accepted += ok
            if i == len(drafts):  # every draft accepted: the pass's state covers them all
                self.pending = []
                self.committed_all = True
            self.take(t)
            yield t
            if not ok:
                break
        if drafts:  # the acceptance estimate learns from this pass
            accepted = len(drafts) if self.committed_all else i
            self._accepted = self._accepted * ACCEPTANCE_DECAY + accepted
            self._drafted = self._drafted * ACCEPTANCE_DECAY + len(drafts)


class SpeculativeDecoder:
    """One sequence's speculative decode loop over a target model (see the module docstring).

    dec = SpeculativeDecoder(model, drafter, sampler, prompt_ids, state_after_prompt, logits_after_prompt)
    for token in dec.tokens():   # tokens as decided; the caller stops iterating when its stream ends
        ...
    dec.state                    # the state after the prompt and every token taken from tokens()
    """

    def __init__(
        self,
        model,
        drafter: Drafter,
        sampler: Sampler,
        context: Sequence[int],
        state,
        logits: Tensor,
        max_draft: int = DEFAULT_MAX_DRAFT,
        stats: SpeculativeStats | None = None,
    ):
        self.model = model
        self.row = SpeculativeRow(drafter, sampler, context, max_draft, stats)
        self.stats = self.row.stats
        self._state, self._logits = state, logits

    @property
    def limit(self) -> int | None:
        return self.row.limit

    @limit.setter
    def limit(self, value: int | None) -> None:
        self.row.limit = value

    @property
    def state(self):
        """The state after the context and every token handed out (feeds the pending ones)."""
        row = self.row
        if row.pending:
            _, self._state = self.model.forward(row.pending, state=self._state)
            row.pending = []
        return self._state

    def tokens(self, stop_ids: frozenset[int] = frozenset()):
        """Decided tokens, one at a time; each is taken (counted in `state`) as it is yielded,
        except a token of `stop_ids`, which ends the iteration unfed, as in plain decoding."""
        row = self.row
        t, _ = decide(row.sampler, self._logits, None)
        self._logits = None
        if t in stop_ids:
            yield t
            return
        row.take(t)
        yield t
        while True:
            feed = row.plan()
            logits, after = self.model.forward(feed, state=self._state, all_logits=True)
            for t in row.decide(logits):
                if row.committed_all:
                    self._state = after
                if t in stop_ids:  # not fed: drop it from what the state must cover
                    row.pending.pop()
                    row.context.pop()
                    yield t
                    return
                yield t
