"""Log-probabilities of tokens, as the engine computes them and as the API shows them.

What they are: `log_softmax` (fp32) of the model's raw logits at the position that predicts
the token, the distribution of the model itself. The sampler's bias, bans, penalties,
temperature, top-p and top-k change which token is drawn, never these numbers (as vLLM reports
by default; OpenAI does the same for temperature). Each row is computed on its own, so a
request's log-probabilities do not depend on what else is in the batch.

`token_logprobs` computes them (engine thread); the rest turns them into OpenAI's two shapes:
chat `{"content": [{token, logprob, bytes, top_logprobs}]}` and legacy completions
`{tokens, token_logprobs, top_logprobs, text_offset}`.

Token text. A World token is a byte string and may be part of a UTF-8 character (emoji, CJK).
A token's `token` text is its bytes decoded with invalid or incomplete sequences replaced by
U+FFFD; chat's `bytes` are the exact bytes. A completion's `text_offset` is where the token's
text begins in the choice's text: the number of characters the tokens before it decode to
together (a character split over tokens counts once it is complete), so offsets index the text
as returned (up to a stop string, which cuts the text but not the tokens).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for, per token (vLLM's default cap)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the `top` most probable tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: Sequence[int]) -> list[TokenLogprob]:
    """logits [R, V] (raw, any float dtype); row r gives the log-probability of tokens[r] and
    its top[r] most probable tokens (most probable first)."""
    if not len(tokens):
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.as_tensor(list(tokens), dtype=torch.long, device=logp.device)[:, None]
    chosen = logp.gather(1, index)[:, 0].tolist()
    k = max(top, default=0)
    if k:
        values, ids = torch.topk(logp, k, dim=1)
        values, ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(int(t), lp, tuple(zip(ids[r][: top[r]], values[r][: top[r]])) if top[r] else ())
        for r, (t, lp) in enumerate(zip(tokens, chosen))
    ]


class TokenText:
    """Token id -> (text, exact bytes), as the module docstring defines them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        out = self._cache.get(token)
        if out is None:
            raw = self.tokenizer.decode_bytes([token])
            out = self._cache[token] = (raw.decode("utf-8", errors="replace"), raw)
        return out


def chat_content(text: TokenText, entries: Sequence[TokenLogprob]) -> list[dict]:
    """Chat's `logprobs.content` items for `entries`."""

    def item(token: int, logprob: float) -> dict:
        s, raw = text(token)
        return {"token": s, "logprob": logprob, "bytes": list(raw)}

    return [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]


class CompletionLogprobs:
    """The legacy completions `logprobs` object of one choice, built as its tokens arrive.

    `add(entries)` appends tokens (an entry of None: the first prompt token of an echo, which
    has no log-probability); `take()` returns what was added since the last take, as the
    `logprobs` of a streamed chunk (offsets keep counting from the start of the choice's text).
    `top_logprobs` maps token text to log-probability for the k most probable tokens, plus the
    chosen token if it is not among them (so up to k + 1 entries, as vLLM and OpenAI do).
    """

    def __init__(self, text: TokenText):
        self.text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0
        self._new: dict[str, list] = self._empty()

    @staticmethod
    def _empty() -> dict[str, list]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add_first(self, token: int) -> None:
        self._append(token, None, None)

    def add(self, entries: Sequence[TokenLogprob]) -> None:
        for e in entries:
            top = {}
            for t, lp in e.top:
                top.setdefault(self.text(t)[0], lp)
            if all(t != e.token for t, _ in e.top):
                top.setdefault(self.text(e.token)[0], e.logprob)
            self._append(e.token, e.logprob, top)

    def _append(self, token: int, logprob: float | None, top: dict | None) -> None:
        s, raw = self.text(token)
        new = self._new
        new["tokens"].append(s)
        new["token_logprobs"].append(logprob)
        new["top_logprobs"].append(top)
        new["text_offset"].append(self._chars)
        self._chars += len(self._decoder.decode(raw))

    def take(self) -> dict[str, list]:
        out, self._new = self._new, self._empty()
        return out
