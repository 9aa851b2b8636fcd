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
7. draw one token from p with the sequence's generator: one uniform number u in (0, 1], and
   the token at which the running sum of p, in token-id order, first reaches u.
8. counts: every count is multiplied by `penalty_decay`, then the drawn token's count gets +1.

Why this order: the models are trained and tuned with it. Cutting before the temperature means
the nucleus is chosen from the model's own distribution, so a high temperature flattens the
choice among plausible tokens but can never bring back the long tail that top-p removed (with
temperature first, T=1.5 on a 65536-token vocabulary pulls in thousands of junk tokens). Step 6
is computed as `softmax(log p / T)` over the kept tokens, which is the same distribution as
`p ** (1/T)` renormalised but cannot underflow to all zeros at small T; below T ~ 1e-37, where
log p / T leaves fp32's range, it is the T -> 0 limit (`_tempered_weights`).

Every step is a batched tensor operation over the rows, whatever their parameters, in O(V) a
row: the top-p cutoff is found among a row's 256 most probable tokens, or for a wider nucleus
from a histogram of the row, sorting only the tokens of the bin where the running sum reaches
top_p (`_nucleus_cutoff`); the draw (step 7) is one random number a row and a running sum,
where a growing topk of the row and `torch.multinomial` over the kept tokens (one exponential
random number per kept token, most probable first) cost most of a decode step on a random
model's flat rows. That changed seeded draws once (issue 38): the same seed still gives the
same tokens, alone or in any batch, but not the tokens of earlier versions (docs/generation.md).

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


# Step 4: the cutoff among a row's 256 most probable tokens (`_NUCLEUS_TOPK`) where they hold
# top_p of its mass (a trained model's rows, mostly), else from a histogram of the row: bins of
# 1/256 nat of log-probability below the row's maximum (a probability ratio of 1.004 a bin) over
# 64 nats; the last bin holds everything further down (less than 1e-23 of the mass).
_NUCLEUS_TOPK = 256
_BINS_PER_NAT = 256
_BINS = 64 * _BINS_PER_NAT


def _nucleus_cutoff(gaps: Tensor, weights: Tensor, top_p: Tensor) -> Tensor:
    """Step 4 for rows whose top_p < 1: the cutoff of each row, as a gap to the row's maximum [n, 1].

    gaps [n, V]: logits minus the row's maximum (-inf for banned tokens); weights = exp(gaps);
    top_p [n] (float64). The cutoff is the probability at which the running sum of the
    probabilities, most probable first, first reaches top_p; every token at least as probable is
    kept (ties included). In O(V) a row, without sorting it: the running sum goes through the
    row's `_NUCLEUS_TOPK` most probable tokens; a row where they hold less than top_p goes to
    `_histogram_cutoff`. Sums are float64 (the reference sums fp32: the kept set can differ only
    where the running sum is within rounding of top_p). A row's cutoff does not depend on the
    other rows. The host waits for the device once (which rows need the histogram).
    """
    n, V = gaps.shape
    target = top_p.to(gaps.device)[:, None] * _mass(weights)
    values = gaps.topk(min(V, _NUCLEUS_TOPK), dim=1).values  # [n, k], most probable first
    running = values.double().exp().cumsum(1)
    first = (running < target).sum(1, keepdim=True)
    cutoff = values.gather(1, first.clamp(max=values.shape[1] - 1))
    wide = (first >= values.shape[1])[:, 0].nonzero()[:, 0].tolist()  # the rows whose nucleus is wider
    if wide:
        index = torch.tensor(wide, device=gaps.device)
        rows = (
            (gaps, weights, target) if len(wide) == n else (t.index_select(0, index) for t in (gaps, weights, target))
        )
        cutoff.index_copy_(0, index, _histogram_cutoff(*rows))
    return cutoff


def _mass(weights: Tensor) -> Tensor:
    """Each row's sum [n, 1] (float64) of weights [n, V]: fp32 sums of 4096-token pieces, added in
    float64. A piece's sum is one thread's, whatever the batch (a sum over a whole row may be
    split over threads when the row is alone), so a row's cutoff does not depend on the other
    rows; and it costs a tenth of `sum(dtype=torch.float64)`, which converts the whole row."""
    return torch.stack([piece.sum(1) for piece in weights.split(4096, dim=1)], 1).double().sum(1, keepdim=True)


def _histogram_cutoff(gaps: Tensor, weights: Tensor, target: Tensor) -> Tensor:
    """`_nucleus_cutoff` of rows [n, V] whose nucleus is wide (a flat row: a random model's holds
    thousands of tokens), for target [n, 1] = top_p x the row's mass: the mass of each bin
    (`_BINS`), summed over the bins in float64, names the bin where the running sum reaches the
    target; only that bin's tokens (a few dozen) are sorted, and the running sum goes on through
    them from the mass of the bins above. The host waits for the device once (the size of the
    largest such bin)."""
    n, V = gaps.shape
    bins = (gaps * -_BINS_PER_NAT).clamp_(max=_BINS - 1).long()  # [n, V]; bin 0 holds the maximum
    mass = torch.zeros(n, _BINS, dtype=weights.dtype, device=gaps.device).scatter_add_(1, bins, weights)
    cum = mass.double().cumsum(1)  # [n, BINS]
    j = torch.searchsorted(cum, target).clamp_(max=_BINS - 1)  # [n, 1]: the bin where the sum reaches it
    above = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), 0.0)  # the mass of the bins before
    inbin = bins == j
    count = torch.count_nonzero(inbin, dim=1)[:, None]
    values = torch.where(inbin, gaps, -math.inf).topk(max(1, int(count.max())), dim=1).values  # descending
    running = above + values.double().exp().cumsum(1)
    first = torch.minimum((running < target).sum(1, keepdim=True), (count - 1).clamp_(min=0))
    return values.gather(1, first)


def _top_k_keep(gaps: Tensor, top_k: Sequence[int]) -> Tensor | None:
    """Step 5: [n, V] True at the top_k[b] most probable tokens of row b (all where top_k is 0 or
    at least V); None when no row has a top_k. Exactly k tokens, ties at the k-th broken by
    the order of `torch.topk(row, max(k, 256))` (as `_draw_compact` reads them); one topk per
    distinct size, so that the ties a row keeps do not depend on the other rows (a topk of
    another size may order tied tokens differently)."""
    n, V = gaps.shape
    groups: dict[int, list[int]] = {}
    for b, k in enumerate(top_k):
        if 0 < k < V:
            groups.setdefault(int(k), []).append(b)
    if not groups:
        return None
    keep = torch.ones(n, V, dtype=torch.bool, device=gaps.device)
    for k, rows in groups.items():
        index = torch.tensor(rows, device=gaps.device)
        ids = gaps.index_select(0, index).topk(min(V, max(k, _NUCLEUS_TOPK)), dim=1).indices[:, :k]  # [m, k]
        keep.index_copy_(
            0, index, torch.zeros(len(rows), V, dtype=torch.bool, device=gaps.device).scatter_(1, ids, True)
        )
    return keep


def _kept(gaps: Tensor, top_p: Sequence[float], top_k: Sequence[int], weights: Tensor | None = None) -> Tensor | None:
    """Steps 4-5 for gaps [n, V] (logits minus each row's maximum): [n, V] True at the tokens
    top-p and top-k keep; None when they keep everything. weights: exp(gaps), if at hand."""
    n = gaps.shape[0]
    keep = _top_k_keep(gaps, top_k)
    cut = [b for b in range(n) if top_p[b] < 1]
    if not cut:
        return keep
    every = len(cut) == n
    rows = gaps if every else gaps[cut]
    weights = rows.exp() if weights is None else weights if every else weights[cut]
    cutoff = _nucleus_cutoff(rows, weights, torch.tensor([top_p[b] for b in cut], dtype=torch.float64))
    if not every:
        index = torch.tensor(cut, device=gaps.device)
        cutoff = torch.full((n, 1), -math.inf, device=gaps.device).index_copy_(0, index, cutoff)
    return gaps >= cutoff if keep is None else keep.logical_and_(gaps >= cutoff)


def _tempered_weights(logits: Tensor, temperature, top_p, top_k, top: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Steps 3-6 for logits [n, V] (fp32; top: their maxima [n, 1], if at hand): (weights [n, V],
    top). Row b's weights are proportional to its sampling distribution, exp(gap / T) at the kept
    tokens and 0 elsewhere, 1 at the most probable token.

    Step 6 is softmax(log p / T) over the kept tokens, computed from the gaps to the maximum (the
    same distribution, log p and the gaps differ by a constant). A T below fp32's smallest normal
    number (~1.2e-38) is taken as that number, where every gap but 0 / T is -inf: the T -> 0
    limit, the most probable token with its exact ties.
    """
    n, V = logits.shape
    temperature, top_p, top_k = _listed(temperature, n), _listed(top_p, n), _listed(top_k, n)
    _check_temperature(temperature)
    if top is None:
        top = logits.amax(1, keepdim=True)
    gaps = logits - torch.where(top > -math.inf, top, 0.0)  # (a row with every token banned: all -inf)
    if all(t == 1 for t in temperature):
        weights = gaps.exp()
    else:
        tiny = torch.finfo(torch.float32).tiny
        t = torch.tensor([max(t, tiny) for t in temperature], dtype=torch.float32, device=logits.device)
        weights = gaps.div(t[:, None]).exp_()
    keep = _kept(gaps, top_p, top_k, weights if all(t == 1 for t in temperature) else None)
    if keep is not None:
        weights.masked_fill_(keep.logical_not_(), 0.0)
    return weights, top


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
    rows = logits.float().reshape(-1, logits.shape[-1])
    weights, _ = _tempered_weights(rows, temperature, top_p, top_k)
    return (weights / weights.sum(1, keepdim=True)).reshape(logits.shape)


def sample_rows(logits: Tensor, temperature, top_p, top_k, generators: Sequence[torch.Generator | None]) -> list[int]:
    """Steps 3-7 for logits [B, V], row b drawn with generators[b]; the law of `rwkv_probs`."""
    return _draw_rows(logits.float(), temperature, top_p, top_k, generators).tolist()


def _draw_rows(logits: Tensor, temperature, top_p, top_k, generators, top: Tensor | None = None) -> Tensor:
    """Steps 3-7 for fp32 logits [n, V]: the tokens [n] (on the logits' device; the host waits
    for the device a few times, never once a row); -1 for a row with no token left to draw
    (all -inf). top: the rows' maxima [n, 1], if at hand.

    Step 7 is one uniform u in (0, 1] from each row's generator (`torch.rand`) and the inverse of
    the distribution's running sum in token-id order: the token where the sum of the kept
    weights first reaches u times their total. One random number a row, O(V), no sort; a row
    draws the same token alone and in any batch. The rows whose kept tokens lie among their 256
    most probable draw among those (`_draw_compact`), the others over the whole row (`_draw_full`,
    `_draw_handed`).
    """
    n, V = logits.shape
    temperature, top_p, top_k = _listed(temperature, n), _listed(top_p, n), _listed(top_k, n)
    _check_temperature(temperature)
    device = logits.device
    if top is None:
        top = logits.amax(1, keepdim=True)
    u = [torch.rand(1, generator=g, device=device if g is None else g.device).to(device) for g in generators]
    u = 1 - torch.cat(u)[:, None]  # [n, 1], in (0, 1]
    tokens = torch.full((n,), -1, dtype=torch.long, device=device)
    rest = list(range(n))
    small = [b for b in range(n) if top_p[b] < 1 or 0 < top_k[b] <= min(V, _NUCLEUS_TOPK)]
    if small:
        index = torch.tensor(small, device=device)
        params = ([temperature[b] for b in small], [top_p[b] for b in small], [top_k[b] for b in small])
        every = len(small) == n
        rows = (logits, top, u) if every else (logits[small], top[small], u[small])
        got, done, handed = _draw_compact(*rows, *params)
        tokens.index_copy_(0, index, got)
        if handed is not None:  # the wide nuclei: drawn over the whole row, from what was computed
            local, handed_tokens = handed
            tokens.index_copy_(0, torch.tensor([small[j] for j in local], device=device), handed_tokens)
        rest = [b for b in range(n) if not (top_p[b] < 1 or 0 < top_k[b] <= min(V, _NUCLEUS_TOPK))]
    if rest:
        index = torch.tensor(rest, device=device)
        params = ([temperature[b] for b in rest], [top_p[b] for b in rest], [top_k[b] for b in rest])
        tokens.index_copy_(0, index, _draw_full(logits[rest], top[rest], u[rest], *params))
    return torch.where(top[:, 0] > -math.inf, tokens, -1)


def _draw_full(logits: Tensor, top: Tensor, u: Tensor, temperature, top_p, top_k) -> Tensor:
    """`_draw_rows` over whole rows [n, V], given their maxima and uniform numbers [n, 1]."""
    weights, _ = _tempered_weights(logits, temperature, top_p, top_k, top)
    cum = weights.cumsum_(1)
    return torch.searchsorted(cum, u * cum[:, -1:])[:, 0]


def _draw_compact(logits: Tensor, top: Tensor, u: Tensor, temperature, top_p, top_k):
    """`_draw_rows` for rows [m, V] whose kept tokens may all lie among their k = 256 most probable
    (top_k <= k, or top_p < 1): (the tokens [m], the rows drawn so, and None or (the other rows,
    their tokens)). The rows drawn so keep what `_kept` keeps (the same topk, the same running
    sums to the bit); their weights, ordered by token id, have the same running sums as the whole
    row's, whose other weights are 0: the same token as `_draw_full`, for the cost of one topk
    and, with top_p, one pass for the mass. The other rows (top_p's cutoff beyond the k-th token,
    or tied with it) are drawn over the whole row by `_draw_handed`, from the gaps, weights, mass
    and cutoff computed here: the same tokens as `_draw_full`."""
    m, V = logits.shape
    k = min(V, _NUCLEUS_TOPK)
    device = logits.device
    gaps = logits - torch.where(top > -math.inf, top, 0.0)
    values, ids = gaps.topk(k, dim=1)  # [m, k], most probable first
    limit = torch.tensor([t if 0 < t <= k else k for t in top_k], device=device)[:, None]
    keep = torch.arange(k, device=device)[None, :] < limit
    done = torch.ones(m, dtype=torch.bool, device=device)
    cut = [j for j in range(m) if top_p[j] < 1]
    if cut:
        every = len(cut) == m
        rows = gaps if every else gaps[cut]
        p = torch.tensor([top_p[j] for j in cut], dtype=torch.float64, device=device)[:, None]
        exp = rows.exp()
        target = p * _mass(exp)  # as _nucleus_cutoff
        v = values if every else values[cut]
        running = v.double().exp().cumsum(1)
        first = (running < target).sum(1, keepdim=True)
        cutoff = v.gather(1, first.clamp(max=k - 1))
        # Beyond the k-th token (not reached, or a tie with the k-th): drawn here only where
        # top_k <= k cuts first (top_k's tokens are then all top-p keeps).
        beyond = ((first >= k) | (v[:, -1:] >= cutoff)) & (k < V)
        by_k = limit[cut] < k if k < V else torch.ones_like(beyond)
        index = torch.tensor(cut, device=device)
        done.index_copy_(0, index, (~beyond | by_k)[:, 0])
        keep_p = torch.full((m, 1), -math.inf, device=device)
        keep_p.index_copy_(0, index, torch.where(beyond, -math.inf, cutoff))
        keep &= values >= keep_p
    tiny = torch.finfo(torch.float32).tiny
    t = torch.tensor([max(x, tiny) for x in temperature], dtype=torch.float32, device=device)[:, None]
    weights = torch.where(keep, values if all(x == 1 for x in temperature) else values / t, -math.inf).exp_()
    order = ids.argsort(dim=1)  # by token id
    cum = weights.gather(1, order).cumsum_(1)
    j = torch.searchsorted(cum, u * cum[:, -1:])
    tokens = ids.gather(1, order.gather(1, j))[:, 0]
    done = done.nonzero()[:, 0].tolist()
    if len(done) == m:
        return tokens, done, None
    drawn = set(done)
    at = [i for i, j in enumerate(cut) if j not in drawn]  # (every row not drawn is a cut row)
    local = [cut[i] for i in at]
    pick = torch.tensor(at, device=device)
    wide = (first.index_select(0, pick) >= k)[:, 0].tolist()
    handed = _draw_handed(
        gaps.index_select(0, torch.tensor(local, device=device)),
        exp.index_select(0, pick),
        target.index_select(0, pick),
        cutoff.index_select(0, pick),
        wide,
        u.index_select(0, torch.tensor(local, device=device)),
        [temperature[j] for j in local],
        [top_k[j] for j in local],
    )
    return tokens, done, (local, handed)


def _draw_handed(gaps, exp, target, cutoff, wide: list[bool], u, temperature, top_k) -> Tensor:
    """`_draw_full` for top_p rows [n, V] whose nucleus reaches beyond their 256 most probable
    tokens, from their gaps, exp(gaps), targets (top_p x mass) [n, 1] and the cutoff among the
    top 256 [n, 1], which holds where the nucleus only ties beyond them (`wide` False); the wide
    rows' cutoff comes from `_histogram_cutoff`. The same values as `_tempered_weights`."""
    rows = [b for b, w in enumerate(wide) if w]
    if rows:
        index = torch.tensor(rows, device=gaps.device)
        picked = (t.index_select(0, index) for t in (gaps, exp, target))
        cutoff = cutoff.index_copy(0, index, _histogram_cutoff(*picked))
    keep = gaps >= cutoff
    by_k = _top_k_keep(gaps, top_k)
    if by_k is not None:
        keep &= by_k
    if all(t == 1 for t in temperature):
        weights = exp
    else:
        tiny = torch.finfo(torch.float32).tiny
        t = torch.tensor([max(t, tiny) for t in temperature], dtype=torch.float32, device=gaps.device)
        weights = gaps.div(t[:, None]).exp_()
    cum = weights.masked_fill_(keep.logical_not_(), 0.0).cumsum_(1)
    return torch.searchsorted(cum, u * cum[:, -1:])[:, 0]


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
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            if self.params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.params.seed)

    def adjusted_logits(self, logits: Tensor) -> Tensor:
        """Steps 1-2: logits [V] with bias, bans and penalties applied (does not update counts)."""
        out = logits.to(torch.float32, copy=True)
        _adjust_rows([self], out[None])
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
        _adjust_rows(samplers, adjusted)
        constrained = [
            (b, s.constraint) for b, s in enumerate(samplers) if s.constraint is not None and s.constraint.active
        ]
        if constrained:
            from .structured import apply_masks

            apply_masks(adjusted, constrained)
        return adjusted

    @staticmethod
    def sample_batch(samplers: Sequence[Sampler], logits: Tensor) -> list[int]:
        """One token for each row of logits [B, V], row b sampled by samplers[b].

        Batched whatever the rows' parameters: the greedy rows' tokens are one arg-max over the
        batch, the drawn rows' one `_draw_rows` (one random number each); the host waits for the
        device a few times a step, never once a row: the finiteness check, the rows `_draw_rows`
        draws compactly, the wide nuclei and their histogram (only where there are such), the tokens.
        """
        if logits.dim() != 2 or logits.shape[0] != len(samplers):
            raise InputError(f"sample_batch: logits {tuple(logits.shape)} do not match {len(samplers)} samplers")
        if not samplers:
            return []
        adjusted = Sampler.prepare(samplers, logits)
        drawn = [b for b, s in enumerate(samplers) if not s.params.greedy]
        if len(drawn) < len(samplers):  # the greedy rows' tokens: the first of tied maxima
            top, tokens = adjusted.max(dim=1, keepdim=True)
            tokens = torch.where(top > -math.inf, tokens, -1)[:, 0]
        else:  # (the maxima alone cost a tenth of a max with its indices)
            top = adjusted.amax(dim=1, keepdim=True)
        if drawn:
            every = len(drawn) == len(samplers)
            params = [samplers[b].params for b in drawn]
            got = _draw_rows(
                adjusted if every else adjusted[drawn],
                temperature=[p.temperature for p in params],
                top_p=[p.top_p for p in params],
                top_k=[p.top_k for p in params],
                generators=[samplers[b].generator for b in drawn],
                top=top if every else top[drawn],
            )
            tokens = got if every else tokens.index_copy_(0, torch.tensor(drawn, device=tokens.device), got)
        out = tokens.tolist()
        if out and min(out) < 0:
            raise InputError("every token is banned at this step (bias, bans, min_tokens and grammar together)")
        for s, t in zip(samplers, out):
            s.accept(t)
        return out


def _adjust_rows(samplers: Sequence[Sampler], out: Tensor) -> None:
    """Steps 1-2 in place on fp32 logits [B, V], row b by samplers[b]: the bias, the stop tokens'
    ban under min_tokens and the penalties of all rows are gathered (each sampler keeps them
    sparse, on the host) into one index of the flattened logits each and written by one indexed
    operation each, so a step costs three device operations whatever the number of rows. The
    same values as adding the dense vectors of `bias_vector` and `apply_penalties` row by row."""
    V = out.shape[1]
    flat = out.view(-1)
    bias: list[tuple[int, Tensor, Tensor]] = []
    stops: list[tuple[int, Tensor]] = []
    penalties: list[tuple[int, Tensor, Tensor, float, float]] = []
    for b, s in enumerate(samplers):
        s._ready(out.device)
        p = s.params
        if s._bias is not None:
            bias.append((b, s._bias_ids, s._bias))
        if s.generated < p.min_tokens and len(s._stop_ids):
            stops.append((b, s._stop_ids))
        if s._position and (p.presence_penalty or p.frequency_penalty):
            penalties.append((b, s._seen, s._count, p.presence_penalty, p.frequency_penalty))
    if bias:
        ids, values = _flat_ids(bias, V, out.device), torch.cat([v for _, _, v in bias]).to(out.device)
        flat.index_put_((ids,), values, accumulate=True)
    if stops:
        flat.index_fill_(0, _flat_ids(stops, V, out.device), -math.inf)
    if penalties:
        lengths = torch.tensor([len(ids) for _, ids, *_ in penalties])
        presence = torch.tensor([e[3] for e in penalties], dtype=torch.float32).repeat_interleave(lengths)
        frequency = torch.tensor([e[4] for e in penalties], dtype=torch.float32).repeat_interleave(lengths)
        penalty = presence + torch.cat([e[2] for e in penalties]) * frequency
        flat.index_put_((_flat_ids(penalties, V, out.device),), (-penalty).to(out.device), accumulate=True)


def _flat_ids(entries: list[tuple], V: int, device) -> Tensor:
    """The ids of entries (row, ids [m], ...) as indices into the flattened [B, V] logits."""
    lengths = torch.tensor([len(e[1]) for e in entries])
    rows = torch.tensor([e[0] for e in entries]).repeat_interleave(lengths)
    return (torch.cat([e[1] for e in entries]) + rows * V).to(device)
