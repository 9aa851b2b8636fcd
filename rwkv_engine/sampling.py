"""Sampling: turning next-token logits into a token id, the RWKV way.

The sampler is a handful of pure functions over tensors (batched: logits [B, V], one row per
sequence, per-row parameters as [B] tensors or plain numbers) plus `Sampler`, which holds the
little per-sequence state they need: the decayed occurrence counts of the penalties, the bias
vector and the sequence's own `torch.Generator`.

One sampling step, in this order (docs/formats.md D, the `rwkv` pip `PIPELINE.generate` and
`sample_logits`, which every RWKV front end copies):

1. bias and bans: `logit[t] += logit_bias[t]`; banned tokens get -inf, and so do the stop
   tokens while fewer than `min_tokens` tokens were generated.
2. penalties: `logit[t] -= presence + count[t] * frequency` for every token t generated so far
   (count[t] > 0). Counts are over generated tokens only, not the prompt.
   A sequence with a grammar (json_schema / json_object, tool calls: rwkv_engine/structured.py)
   then gets -inf at every token its grammar does not allow next.
3. `p = softmax(logit)`.
4. top-p: sort p descending; the cutoff is the sorted probability at which the running sum first
   reaches >= top_p; every token with p < cutoff is dropped (ties with the cutoff are kept).
5. top-k (if > 0): keep only the k most probable of what is left.
6. temperature, *after* the cut: `p = p ** (1 / T)` over the kept tokens, renormalised.
7. draw one token from p with the sequence's generator.
8. counts: every count is multiplied by `penalty_decay`, then the drawn token's count gets +1.

Why this order: the models are trained and tuned with it. Cutting before the temperature means
the nucleus is chosen from the model's own distribution, so a high temperature flattens the
choice among plausible tokens but can never bring back the long tail that top-p removed (with
temperature first, T=1.5 on a 65536-token vocabulary pulls in thousands of junk tokens). Step 6
is computed as `softmax(log p / T)` over the kept tokens, which is the same distribution as
`p ** (1/T)` renormalised but cannot underflow to all zeros at small T; below T ~ 1e-37, where
log p / T leaves fp32's range, it is the T -> 0 limit (`_tempered`).

Steps 1-2 with the grammar mask are `Sampler.prepare`, the one function that makes what is drawn
from, first refusing NaN or infinite logits (ModelOutputError): `Sampler.sample_batch` draws from
it, and speculative decoding (speculative.py) decides its verified positions from it.

temperature == 0 means greedy: the arg-max of the biased, penalised logits (the pip implements
it as top_p = 0, which keeps the most probable token and its exact ties). Greedy rows do not
consume random numbers.

Known differences from the pip `PIPELINE.generate` (deliberate):
* The pip gives a generated token a count of 0 (presence penalty only) when its text is a space,
  a tab or digits. Here every generated token counts; the sampler knows no text.
* With top_p = 1.0 the pip's float32 running sum may never reach 1.0 and then keeps only the
  top token. Here top_p >= 1 disables the cut.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .errors import InputError, ModelOutputError
from .sampling_params import CHAT, COMPLETION, SamplingParams, _number, _token_id  # noqa: F401 (re-exported)

Tensor = torch.Tensor

__all__ = [
    "CHAT",
    "COMPLETION",
    "SamplingParams",
    "Sampler",
    "bias_vector",
    "apply_penalties",
    "update_counts",
    "rwkv_probs",
    "sample_rows",
    "draw",
    "check_finite",
]


def check_finite(logits: Tensor, what: str = "the model's logits") -> None:
    """ModelOutputError unless every row of logits [..., V] has a finite maximum. A NaN row has a
    NaN maximum, an overflowed one +inf: an arg-max or a draw from either would be a token that
    means nothing (greedy took NaN rows as token 0, "stop"). -inf alone is a ban, not an error."""
    if not bool(torch.isfinite(logits.amax(-1)).all()):
        raise ModelOutputError(
            f"{what} are NaN or infinite (its weights or state are not finite, or so large that the "
            "forward overflowed): no token can be chosen"
        )


def _per_row(value, like: Tensor) -> Tensor:
    """A number or a [B] sequence/tensor as a [B, 1] (or [1] for 1-D `like`) float tensor."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if like.dim() == 1:
        return t.reshape(-1)[:1] if t.numel() == 1 else t
    return t.reshape(-1, 1)


def bias_vector(params: SamplingParams, vocab_size: int, device="cpu") -> Tensor | None:
    """[V] additive vector of `params.logit_bias` with -inf at banned tokens; None if all zero."""
    if not params.logit_bias and not params.banned_token_ids:
        return None
    params.check_vocab(vocab_size)
    bias = torch.zeros(vocab_size, dtype=torch.float32)
    for t, v in params.logit_bias.items():
        bias[t] = v
    bias[list(params.banned_token_ids)] = -math.inf
    if torch.isinf(bias).all():
        raise InputError("every token of the vocabulary is banned")
    return bias.to(device)


def apply_penalties(logits: Tensor, counts: Tensor, presence, frequency) -> Tensor:
    """logits - (presence + counts * frequency) where counts > 0.

    logits, counts: [V] or [B, V]; presence, frequency: numbers or [B] (one per row).
    """
    presence = _per_row(presence, logits)
    frequency = _per_row(frequency, logits)
    penalty = (presence + counts * frequency) * (counts > 0)
    return logits - penalty


def update_counts(counts: Tensor, tokens, decay) -> Tensor:
    """Occurrence counts after one step: all multiplied by `decay`, then +1 for each new token.

    counts: [V] with `tokens` an int, or [B, V] with `tokens` [B]; decay: number or [B].
    """
    counts = counts * _per_row(decay, counts)
    tokens = torch.as_tensor(tokens, device=counts.device).reshape(-1, 1)
    if counts.dim() == 1:
        return counts.index_add(0, tokens.reshape(-1), torch.ones(1, device=counts.device))
    return counts.scatter_add(1, tokens, torch.ones_like(tokens, dtype=counts.dtype))


def _kept(logp: Tensor, top_p: float, top_k: int) -> tuple[Tensor, Tensor] | None:
    """Steps 4-5 for one row of log-probabilities [V].

    Returns (logp [m], ids [m]) of the tokens top-p and top-k keep, most probable first, or None
    when they keep everything. Uses `topk` with a growing k (256, then x 8) instead of a full
    sort: the nucleus is usually small, and a full sort of 65536 floats is the most expensive
    step by far. The sizes k whose topk would certainly fall short of the nucleus are skipped
    (`_NucleusBound`, one O(V) pass), so a flat distribution costs one topk, not a series of
    growing ones; the topk that decides is the one a plain growing k reaches, so the result is
    the same to the bit (tied tokens in the same order too).
    """
    V = logp.shape[0]
    if top_p >= 1:
        return None if top_k <= 0 or top_k >= V else torch.topk(logp, top_k)
    bound = _NucleusBound(logp, top_p)
    k = bound.skip(min(V, max(256, top_k)), top_k)
    while True:
        values, ids = torch.topk(logp, k)
        cumulative = values.exp().cumsum(0)
        if bool(cumulative[-1] >= top_p) or k == V:
            # The cutoff is the probability at which the running sum first reaches top_p;
            # everything at least that probable is kept, ties included.
            first = min(int((cumulative < top_p).sum()), k - 1)
            m = int((logp >= values[first]).sum())
            break
        if 0 < top_k <= k:  # the cutoff is further down than top_k: top-k decides
            m = top_k
            break
        k = bound.skip(min(V, k * 8), top_k)
    if top_k > 0:
        m = min(m, top_k)
    if m > k:  # ties with the cutoff beyond the first k
        values, ids = torch.topk(logp, m)
    return values[:m], ids[:m]


class _NucleusBound:
    """Which topk sizes of `_kept` certainly hold less than top_p of a row's mass, from one
    histogram of the row (O(V)): the mass over bins of log-probability below the row's maximum,
    each 1/16 wide (a probability ratio of 1.06), summed in float64. The k most probable tokens
    lie in the first bins that hold k tokens, so their mass is at most those bins' mass; a k
    whose bound is below top_p by more than any rounding of `_kept`'s fp32 running sum (MARGIN)
    cannot reach it."""

    BINS, MARGIN = 1024, 1e-2

    def __init__(self, logp: Tensor, top_p: float):
        self.top_p, self.V = top_p, logp.shape[0]
        self._cum: tuple[Tensor, Tensor] | None = None
        self._logp = logp

    def _histogram(self) -> tuple[Tensor, Tensor]:
        if self._cum is None:  # built at the first k that a row's nucleus may outgrow
            logp = self._logp
            bins = ((logp.max() - logp) * 16).clamp_(max=self.BINS - 1).long()
            mass = torch.bincount(bins, weights=logp.double().exp(), minlength=self.BINS)
            self._cum = torch.bincount(bins, minlength=self.BINS).cumsum(0), mass.cumsum(0)
        return self._cum

    def skip(self, k: int, top_k: int) -> int:
        """The first of k, k x 8, ... (at most V) that may hold the nucleus, or that top_k stops at."""
        while k < self.V and not 0 < top_k <= k:
            if k <= 256:  # a first topk this small costs less than the histogram
                return k
            count, mass = self._histogram()
            j = min(int(torch.searchsorted(count, k)), self.BINS - 1)  # the first bins holding k tokens
            if float(mass[j]) >= self.top_p - self.MARGIN:
                return k
            k = min(self.V, k * 8)
        return k


def _cut(values: Tensor, ids: Tensor, top_p: float, top_k: int, V: int) -> tuple[Tensor, Tensor] | None:
    """What `_kept` returns for a row, given what its first `torch.topk(row, k)` returned (values
    and ids [k]); None where `_kept` has to look further than k tokens: the running sum does not
    reach top_p within them and no top_k stops the cut first (`_kept` grows k), or ties with the
    cutoff reach the k-th token (`_kept` counts them over the row). The same tensor operations
    as `_kept` on the same tensors, so the same result to the bit.
    """
    k = values.shape[0]
    if top_p >= 1:
        return values, ids
    cumulative = values.exp().cumsum(0)
    if bool(cumulative[-1] >= top_p) or k == V:
        first = min(int((cumulative < top_p).sum()), k - 1)
        m = int((values >= values[first]).sum())
        if m == k and k < V:  # ties with the cutoff may continue beyond the k-th token
            return None
    elif 0 < top_k <= k:
        m = top_k
    else:
        return None
    if top_k > 0:
        m = min(m, top_k)
    return values[:m], ids[:m]


def _kept_rows(logp: Tensor, top_p: Sequence[float], top_k: Sequence[int]) -> list[tuple[Tensor, Tensor] | None]:
    """`_kept` for every row of logp [n, V]: the same tensors, with one topk for all rows.

    The rows whose first topk in `_kept` has the same size k share one `torch.topk(rows, k)`,
    which runs the same selection on each row as `torch.topk(row, k)`, so it gives the same values
    and ids (tied values in the same order too); `_cut` finishes each row from them. A row whose
    cut lies beyond those k tokens runs `_kept` itself.
    """
    n, V = logp.shape
    out: list[tuple[Tensor, Tensor] | None] = [None] * n
    groups: dict[int, list[int]] = {}  # first topk size of _kept -> rows
    for b in range(n):
        p, k = float(top_p[b]), int(top_k[b])
        if p < 1:
            groups.setdefault(min(V, max(256, k)), []).append(b)
        elif 0 < k < V:
            groups.setdefault(k, []).append(b)
    for k, rows in groups.items():
        values, ids = torch.topk(logp if len(rows) == n else logp[rows], k, dim=1)
        for j, b in enumerate(rows):
            p, tk = float(top_p[b]), int(top_k[b])
            kept = _cut(values[j], ids[j], p, tk, V)
            out[b] = kept if kept is not None else _kept(logp[b], p, tk)
    return out


def _check_temperature(temperature) -> None:
    if min(temperature) <= 0:
        raise InputError("the sampling distribution needs temperature > 0 (greedy is handled by the caller)")


def _listed(value, n: int) -> list:
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InputError(f"got {len(value)} per-row values for {n} rows")
        return list(value)
    return [value] * n


def rwkv_probs(logits: Tensor, temperature=1.0, top_p=1.0, top_k=0) -> Tensor:
    """The sampling distribution of RWKV's sampler (module docstring, steps 3-6).

    logits: [V] or [B, V]; temperature (> 0), top_p, top_k: numbers or [B]. Returns fp32
    probabilities of the same shape, each row summing to 1.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    rows = logp.reshape(-1, logp.shape[-1])
    B = rows.shape[0]
    temperature, top_p, top_k = _listed(temperature, B), _listed(top_p, B), _listed(top_k, B)
    _check_temperature(temperature)
    probs = torch.zeros_like(rows)
    for b, kept in enumerate(_kept_rows(rows, top_p, top_k)):
        if kept is None:
            probs[b] = _tempered(rows[b], temperature[b])
        else:
            probs[b, kept[1]] = _tempered(kept[0], temperature[b])
    return probs.reshape(logp.shape)


def sample_rows(logits: Tensor, temperature, top_p, top_k, generators: Sequence[torch.Generator | None]) -> list[int]:
    """Steps 3-7 for logits [B, V], row b drawn with generators[b]; the law of `rwkv_probs`.

    Draws among the kept tokens only, which is much cheaper than a draw over the whole
    vocabulary when top-p / top-k keep few tokens.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    B = logp.shape[0]
    temperature, top_p, top_k = _listed(temperature, B), _listed(top_p, B), _listed(top_k, B)
    _check_temperature(temperature)
    return _draw_kept(logp, _kept_rows(logp, top_p, top_k), temperature, generators)


def _tempered(logp: Tensor, temperature: float) -> Tensor:
    """Step 6: softmax(logp / T) over the log-probabilities [m] of a row's kept tokens.

    Below T ~ 1e-37, logp / T leaves fp32's range (-inf everywhere, or 0 / 0 where T itself
    rounds to 0 in fp32, as 1e-300 does), and the softmax is NaN. The law then is (up to fp32
    rounding) its T -> 0 limit, the most probable token with its exact ties; it is computed
    from the gaps to the maximum in float64, where any T > 0 is representable. Ordinary
    temperatures take the first line only, so their draws are unchanged to the bit.
    """
    scaled = logp / temperature
    if torch.isfinite(scaled.max()):
        return torch.softmax(scaled, dim=-1)
    gaps = logp.double() - logp.max()
    return torch.softmax(gaps / temperature, dim=-1).float()


def _draw_kept(logp: Tensor, kept_rows, temperature: list, generators) -> list[int]:
    """Steps 6-7 for log-probabilities [B, V] and each row's kept (log p, ids), or None for all."""
    out = []
    for b, kept in enumerate(kept_rows):
        if kept is None:
            weights, ids = _tempered(logp[b], temperature[b]), None
        else:
            weights, ids = _tempered(kept[0], temperature[b]), kept[1]
        i = torch.multinomial(weights, 1, generator=generators[b])[0]
        out.append(int(i if ids is None else ids[i]))
    return out


def draw(probs: Tensor, generators: torch.Generator | Sequence[torch.Generator | None] | None = None) -> Tensor:
    """Sample one token per row: [V] -> 0-d tensor, [B, V] -> [B]. One generator per row, or one for all."""
    if probs.dim() == 1:
        gen = generators[0] if isinstance(generators, (list, tuple)) else generators
        return torch.multinomial(probs, 1, generator=gen)[0]
    if not isinstance(generators, (list, tuple)):
        return torch.multinomial(probs, 1, generator=generators)[:, 0]
    return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators)])


# --- per-sequence state ----------------------------------------------------------------------


class Sampler:
    """The sampling state of one sequence: occurrence counts, bias vector, random generator.

        sampler = Sampler(params, vocab_size)
        token = sampler(logits)            # logits [V]; updates the counts

    `Sampler.sample_batch(samplers, logits)` samples B sequences at once from logits [B, V],
    each with its own parameters and generator; a row gets the same token it would get alone.
    `generator` overrides the one built from `params.seed` (a chat shares one over its turns);
    otherwise it is created on the logits' device at the first call. `constraint` (a
    `structured.Constraint`, e.g. from `structured.grammar_for(params, ...)`) masks the tokens
    its grammar does not allow, after bias and penalties, and advances on every accepted token.

    The counts are kept sparse (the generated token ids and their decayed counts), so a step
    costs O(tokens generated) on top of the logits, not O(V); `counts` gives the dense [V] view
    that `apply_penalties` / `update_counts` define.
    """

    def __init__(
        self, params: SamplingParams, vocab_size: int, generator: torch.Generator | None = None, constraint=None
    ):
        params.check_vocab(vocab_size)
        self.params = params
        self.constraint = constraint  # a structured.Constraint: grammar mask per step (None = free)
        self.vocab_size = vocab_size
        self.generator = generator
        bias = bias_vector(params, vocab_size)
        # Kept sparse: adding the zeros of the dense vector changes no logit.
        self._bias_ids = None if bias is None else bias.nonzero()[:, 0]
        self._bias = None if bias is None else bias[self._bias_ids]
        self._position: dict[int, int] = {}  # token id -> index in _seen / _count
        self.generated = 0  # tokens accepted so far (min_tokens bans the stop tokens until then)
        self._stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long) if params.min_tokens else None
        self._seen = torch.zeros(0, dtype=torch.long)
        self._count = torch.zeros(0, dtype=torch.float32)

    @property
    def counts(self) -> Tensor:
        dense = torch.zeros(self.vocab_size, dtype=torch.float32)
        return dense.index_put_((self._seen,), self._count)

    def _ready(self, device: torch.device) -> None:
        if self._bias is not None and self._bias.device != device:
            self._bias, self._bias_ids = self._bias.to(device), self._bias_ids.to(device)
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            if self.params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.params.seed)

    def adjusted_logits(self, logits: Tensor) -> Tensor:
        """Steps 1-2: logits [V] with bias, bans and penalties applied (does not update counts)."""
        return self._adjust_(logits.to(torch.float32, copy=True))

    def _adjust_(self, out: Tensor) -> Tensor:
        """`adjusted_logits` in place on fp32 logits [V]."""
        self._ready(out.device)
        if self._bias is not None:
            ids = self._bias_ids
            out.index_put_((ids,), out[ids] + self._bias)
        p = self.params
        if self.generated < p.min_tokens and len(self._stop_ids):
            out[self._stop_ids.to(out.device)] = -math.inf
        if self._position and (p.presence_penalty or p.frequency_penalty):
            seen = self._seen.to(out.device)
            penalty = p.presence_penalty + self._count.to(out.device) * p.frequency_penalty
            out.index_put_((seen,), out[seen] - penalty)
        return out

    def __call__(self, logits: Tensor) -> int:
        if logits.dim() != 1 or logits.shape[0] != self.vocab_size:
            raise InputError(f"Sampler expects logits [{self.vocab_size}], got {tuple(logits.shape)}")
        return Sampler.sample_batch([self], logits[None])[0]

    def accept(self, token: int) -> None:
        """Step 8 for a token chosen elsewhere (e.g. forced): decay counts, count the token."""
        token = int(token)
        self.generated += 1
        if self.constraint is not None and self.constraint.active:
            self.constraint.accept(token)
        self._count = self._count * self.params.penalty_decay
        i = self._position.get(token)
        if i is None:
            self._position[token] = len(self._seen)
            self._seen = torch.cat([self._seen, torch.tensor([token])])
            self._count = torch.cat([self._count, torch.ones(1)])
        else:
            self._count[i] += 1

    @staticmethod
    def prepare(samplers: Sequence[Sampler], logits: Tensor) -> Tensor:
        """What row b of logits [B, V] is drawn from by samplers[b]: fp32, bias and bans, penalties,
        then the grammar mask (steps 1-2; counts not updated). ModelOutputError when a row is NaN
        or infinite. The one home of that rule: `sample_batch` and speculative decoding call it."""
        check_finite(logits)
        adjusted = logits.to(torch.float32, copy=True)
        for s, row in zip(samplers, adjusted):
            s._adjust_(row)
        constrained = [
            (b, s.constraint) for b, s in enumerate(samplers) if s.constraint is not None and s.constraint.active
        ]
        if constrained:
            from .structured import apply_masks

            apply_masks(adjusted, constrained)
        return adjusted

    @staticmethod
    def sample_batch(samplers: Sequence[Sampler], logits: Tensor) -> list[int]:
        """One token for each row of logits [B, V], row b sampled by samplers[b]."""
        if logits.dim() != 2 or logits.shape[0] != len(samplers):
            raise InputError(f"sample_batch: logits {tuple(logits.shape)} do not match {len(samplers)} samplers")
        adjusted = Sampler.prepare(samplers, logits)
        params = [s.params for s in samplers]
        out = [None] * len(samplers)
        greedy = [b for b, p in enumerate(params) if p.greedy]
        idx = [b for b, p in enumerate(params) if not p.greedy]
        if greedy:  # one argmax and one transfer for all of them (on a GPU, not one sync per row)
            rows = adjusted if len(greedy) == len(samplers) else adjusted[greedy]
            for b, t in zip(greedy, rows.argmax(dim=-1).tolist()):
                out[b] = t
        if idx:
            drawn = sample_rows(
                adjusted if len(idx) == len(samplers) else adjusted[idx],
                temperature=[params[b].temperature for b in idx],
                top_p=[params[b].top_p for b in idx],
                top_k=[params[b].top_k for b in idx],
                generators=[samplers[b].generator for b in idx],
            )
            for b, t in zip(idx, drawn):
                out[b] = t
        for s, t in zip(samplers, out):
            s.accept(t)
        return out
