"""Sampling: turning next-token logits into a token id, the RWKV way.

The sampler is a handful of pure functions over tensors (batched: logits [B, V], one row per
sequence, per-row parameters as [B] tensors or plain numbers) plus `Sampler`, which holds the
little per-sequence state they need: the decayed occurrence counts of the penalties, the bias
vector and the sequence's own `torch.Generator`.

One sampling step, in this order (FORMATS.md section D, the `rwkv` pip `PIPELINE.generate` and
`sample_logits`, which every RWKV front end copies):

1. bias and bans: `logit[t] += logit_bias[t]`; banned tokens get -inf.
2. penalties: `logit[t] -= presence + count[t] * frequency` for every token t generated so far
   (count[t] > 0). Counts are over generated tokens only, not the prompt.
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
`p ** (1/T)` renormalised but cannot underflow to all zeros at small T.

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

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .errors import InputError

Tensor = torch.Tensor

__all__ = [
    "SamplingParams",
    "Sampler",
    "bias_vector",
    "apply_penalties",
    "update_counts",
    "rwkv_probs",
    "draw",
]


def _number(name: str, value, *, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a number, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise InputError(f"{name} must be an integer, got {value!r}")
        return int(value)
    value = float(value)
    if math.isnan(value):
        raise InputError(f"{name} must be a number, got nan")
    return value


def _token_id(name: str, value) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # JSON object keys arrive as strings
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{name}: token ids are non-negative integers, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. All fields are validated on construction.

    temperature        >= 0; 0 = greedy.
    top_p              in (0, 1]; 1 = no nucleus cut.
    top_k              >= 0; 0 = off.
    presence_penalty   subtracted once from every token generated so far.
    frequency_penalty  subtracted per (decayed) occurrence of a generated token.
    penalty_decay      in [0, 1]: every step the occurrence counts are multiplied by it.
    logit_bias         {token id: value} added to the logits; -inf bans the token.
    banned_token_ids   tokens that are never sampled.
    stop_token_ids     sampling one of these ends the generation; it is not part of the output.
                       Default (0,): id 0 is end-of-text for every RWKV vocabulary.
    stop               strings that end the generation; they are never part of the output.
    max_tokens         most tokens to generate (None = unbounded).
    seed               seed of the sequence's torch.Generator (None = nondeterministic).

    Use `dataclasses.replace(params, temperature=0.5)` for a modified copy (validated too).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_decay: float = 0.996
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    banned_token_ids: Sequence[int] = ()
    stop_token_ids: Sequence[int] = (0,)
    stop: Sequence[str] = ()
    max_tokens: int | None = 256
    seed: int | None = None

    def __post_init__(self):
        self.temperature = _number("temperature", self.temperature)
        if not 0.0 <= self.temperature < math.inf:
            raise InputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        self.top_p = _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _number("top_k", self.top_k, integer=True)
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not math.isfinite(value):
                raise InputError(f"{name} must be finite, got {value}")
            setattr(self, name, value)
        self.penalty_decay = _number("penalty_decay", self.penalty_decay)
        if not 0.0 <= self.penalty_decay <= 1.0:
            raise InputError(f"penalty_decay must be in [0, 1], got {self.penalty_decay}")

        if not isinstance(self.logit_bias, Mapping):
            raise InputError(f"logit_bias must be a mapping of token id to value, got {self.logit_bias!r}")
        bias = {}
        for k, v in self.logit_bias.items():
            v = _number(f"logit_bias[{k!r}]", v)
            if v == math.inf:
                raise InputError(f"logit_bias[{k!r}] must not be +inf")
            bias[_token_id("logit_bias", k)] = v
        self.logit_bias = bias
        self.banned_token_ids = self._ids("banned_token_ids", self.banned_token_ids)
        self.stop_token_ids = self._ids("stop_token_ids", self.stop_token_ids)

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            raise InputError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InputError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop = stop

        if self.max_tokens is not None:
            self.max_tokens = _number("max_tokens", self.max_tokens, integer=True)
            if self.max_tokens < 0:
                raise InputError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.seed is not None:
            self.seed = _number("seed", self.seed, integer=True)
            if not 0 <= self.seed < 2**63:
                raise InputError(f"seed must be in [0, 2**63), got {self.seed}")

    @staticmethod
    def _ids(name: str, ids) -> tuple[int, ...]:
        if isinstance(ids, int):
            ids = (ids,)
        try:
            ids = tuple(ids)
        except TypeError:
            raise InputError(f"{name} must be a list of token ids, got {ids!r}") from None
        return tuple(dict.fromkeys(_token_id(name, i) for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> "SamplingParams":
        """A validated copy with some fields changed."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise InputError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InputError if a token id named here is outside a vocabulary of `vocab_size`."""
        for name in ("logit_bias", "banned_token_ids", "stop_token_ids"):
            ids = getattr(self, name)
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise InputError(f"{name}: token id {bad[0]} is outside the vocabulary (size {vocab_size})")


# --- pure functions ----------------------------------------------------------------------------


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


def rwkv_probs(logits: Tensor, temperature=1.0, top_p=1.0, top_k=0) -> Tensor:
    """The sampling distribution of RWKV's sampler (module docstring, steps 3-6).

    logits: [V] or [B, V]; temperature (> 0), top_p, top_k: numbers or [B]. Returns fp32
    probabilities of the same shape, each row summing to 1.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    temperature = _per_row(temperature, logp)
    top_p = _per_row(top_p, logp)
    top_k = _per_row(top_k, logp)
    if bool((temperature <= 0).any()):
        raise InputError("rwkv_probs needs temperature > 0 (greedy is handled by the caller)")
    keep = torch.ones_like(logp, dtype=torch.bool)
    if bool((top_p < 1).any()) or bool((top_k > 0).any()):
        probs = logp.exp()
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        # First sorted position where the running sum reaches top_p (the sum is monotone).
        first = (cumulative < top_p).sum(dim=-1, keepdim=True).clamp(max=logp.shape[-1] - 1)
        cutoff = sorted_probs.gather(-1, first)
        cutoff = torch.where(top_p >= 1, torch.zeros_like(cutoff), cutoff)
        keep = probs >= cutoff
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(logp.shape[-1], device=logp.device).expand_as(order))
        keep &= (top_k <= 0) | (rank < top_k)
    scaled = (logp / temperature).masked_fill(~keep, -math.inf)
    return torch.softmax(scaled, dim=-1)


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
    `generator` overrides the one built from `params.seed` (a chat shares one over its turns).
    Counts and generator live on the logits' device, created at the first call.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, generator: torch.Generator | None = None):
        params.check_vocab(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        self.generator = generator
        self.counts: Tensor | None = None
        self._bias = bias_vector(params, vocab_size)

    def _ready(self, device: torch.device) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=device)
        if self._bias is not None and self._bias.device != device:
            self._bias = self._bias.to(device)
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            if self.params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.params.seed)

    def adjusted_logits(self, logits: Tensor) -> Tensor:
        """Steps 1-2: logits [V] with bias, bans and penalties applied (does not update counts)."""
        self._ready(logits.device)
        out = logits.float()
        if self._bias is not None:
            out = out + self._bias
        p = self.params
        return apply_penalties(out, self.counts, p.presence_penalty, p.frequency_penalty)

    def __call__(self, logits: Tensor) -> int:
        if logits.dim() != 1 or logits.shape[0] != self.vocab_size:
            raise InputError(f"Sampler expects logits [{self.vocab_size}], got {tuple(logits.shape)}")
        return Sampler.sample_batch([self], logits[None])[0]

    def accept(self, token: int) -> None:
        """Step 8 for a token chosen elsewhere (e.g. forced): decay counts, count the token."""
        if self.counts is None:
            self._ready(torch.device("cpu"))
        self.counts = update_counts(self.counts, token, self.params.penalty_decay)

    @staticmethod
    def sample_batch(samplers: Sequence["Sampler"], logits: Tensor) -> list[int]:
        """One token for each row of logits [B, V], row b sampled by samplers[b]."""
        if logits.dim() != 2 or logits.shape[0] != len(samplers):
            raise InputError(f"sample_batch: logits {tuple(logits.shape)} do not match {len(samplers)} samplers")
        adjusted = torch.stack([s.adjusted_logits(row) for s, row in zip(samplers, logits)])  # (B, V)
        params = [s.params for s in samplers]
        greedy = [p.greedy for p in params]
        tokens = adjusted.argmax(dim=-1)
        if not all(greedy):
            idx = [b for b, g in enumerate(greedy) if not g]
            rows = adjusted[idx]
            probs = rwkv_probs(
                rows,
                temperature=[params[b].temperature for b in idx],
                top_p=[params[b].top_p for b in idx],
                top_k=[params[b].top_k for b in idx],
            )
            tokens[idx] = draw(probs, [samplers[b].generator for b in idx])
        out = tokens.tolist()
        for s, t in zip(samplers, out):
            s.accept(t)
        return out
