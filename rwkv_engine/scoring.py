"""Log-likelihoods of given text under a model: what perplexity and evaluation measure.

    nll, n = sequence_nll(model, ids)                      # sum of -log p(ids[i+1] | ids[:i+1])
    scores = continuation_scores(model, context, conts)    # [(sum log p(cont | context), greedy)]

Every log-probability is the `log_softmax` of the model's raw fp32 logits. Long sequences are read
in pieces of `chunk` tokens with the state carried, so memory stays bounded for any length.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .state import State

LOGIT_ROWS = 4096  # at most this many [V] logit rows in one batched continuation forward


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), target is the argmax) per position; logits [..., V], targets [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), logits.argmax(dim=-1) == targets


@torch.inference_mode()
def sequence_nll(model, ids: Sequence[int], chunk: int = 512) -> tuple[float, int]:
    """(sum of -log p(ids[i+1] | ids[:i+1]) over i, tokens scored): ids[0] is context only."""
    nll, n, state = 0.0, 0, None
    for start in range(0, len(ids) - 1, chunk):
        inp = list(ids[start : start + chunk])
        target = torch.tensor(ids[start + 1 : start + 1 + len(inp)])
        logits, state = model.forward(inp, state, all_logits=True)
        nll += F.cross_entropy(logits[: len(target)], target, reduction="sum").item()
        n += len(target)
    return nll, n


@torch.inference_mode()
def continuation_scores(
    model, context: Sequence[int], continuations: Sequence[Sequence[int]]
) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), every token the argmax) for each continuation.

    The context is prefilled once; its last logits score each continuation's first token and its
    state is forked for the rest, which run as one batch per continuation length."""
    if not context or not all(continuations):
        raise ValueError("the context and every continuation must hold at least one token")
    logits, state = model.forward(list(context))
    first, first_greedy = token_logprobs(
        logits.expand(len(continuations), -1), torch.tensor([c[0] for c in continuations])
    )
    scores = [(float(first[j]), bool(first_greedy[j])) for j in range(len(continuations))]
    by_len: dict[int, list[int]] = defaultdict(list)
    for j, cont in enumerate(continuations):
        if len(cont) > 1:
            by_len[len(cont)].append(j)
    for n, members in by_len.items():
        rows = max(1, LOGIT_ROWS // (n - 1))
        for k in range(0, len(members), rows):
            part = members[k : k + rows]
            tokens = torch.tensor([list(continuations[j]) for j in part])  # [B, n]
            out, _ = model.forward(tokens[:, :-1], State.cat([state] * len(part)), all_logits=True)
            lp, greedy = token_logprobs(out, tokens[:, 1:])  # [B, n-1]
            for row, j in enumerate(part):
                total, ok = scores[j]
                scores[j] = (total + float(lp[row].double().sum()), ok and bool(greedy[row].all()))
    return scores
