"""Text generation: prefill a prompt, then sample and feed one token at a time.

High level:

    gen = rwkv_engine.generate(model, tokenizer, "The capital of France is", params)
    for chunk in gen:                  # text chunks as soon as they are safe to show
        print(chunk, end="", flush=True)
    gen.state                          # state after the prompt and every token in gen.tokens
    gen.stats                          # GenerationStats: token counts, tok/s, finish_reason

`generate` returns a `Generation`, an iterator of `str`. Nothing runs until the first `next()`.
After it is exhausted, `gen.tokens` are the generated token ids (a stop token is not included),
`gen.text` is the text that was yielded (stop strings excluded), `gen.state` is the state after
the prompt and all of `gen.tokens` (`model.forward(prompt + gen.tokens)` from the initial state),
`gen.prompt_state` the state after the prompt alone, and `gen.stats.finish_reason` is "stop" (a
stop token or stop string) or "length" (max_tokens). A generation abandoned early (`break`,
Ctrl-C) keeps the same invariant for the tokens it got to, with finish_reason None.

Each token is fed to the model *before* its text is yielded, so the state always covers every
piece of text a caller has seen.

Low level, for a server that batches many sequences through one `model.forward([B, T])`:
one `Sampler` (rwkv_engine.sampling) and one `TextStream` per sequence.

    samplers = [Sampler(p, V) for p in params]; streams = [TextStream(tok, p) for p in params]
    logits, state = model.forward(prompt_batch)                 # [B, V]
    while live rows:
        tokens = Sampler.sample_batch(samplers, logits)          # one id per row
        for b, t in enumerate(tokens):
            if streams[b].is_stop_token(t): streams[b].push(t)   # finished, do not feed t
        logits, state = model.forward(tokens of live rows as [B', 1], state of live rows)
        texts = [streams[b].push(t) for live rows]               # send; drop rows with .done
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .errors import InputError
from .sampling import Sampler, SamplingParams
from .speculative import DEFAULT_MAX_DRAFT, Drafter, SpeculativeDecoder, SpeculativeStats, drafter_for
from .structured import constraint_for

__all__ = ["generate", "Generation", "GenerationStats", "TextStream", "encode_prompt"]


@dataclass
class GenerationStats:
    """What one generation did. Rates are 0.0 when nothing was timed."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str | None = None  # "stop" | "length" | None (not finished)
    # Passes, drafted and accepted tokens of a speculative generation (None: plain decoding).
    speculative: SpeculativeStats | None = None

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


class TextStream:
    """Turns one sequence's sampled token ids into text that is safe to show, and decides when it ends.

    `push(token)` returns the new text (possibly ""). It is UTF-8 safe (an incomplete multi-byte
    character is held until complete) and never returns any part of a stop string: text that
    could be the start of a stop string is held back until the next tokens decide. The stream
    ends (`done`, `finish_reason`) on a stop token ("stop"; the token is not recorded), a stop
    string ("stop"; it and everything after it is dropped) or after max_tokens ("length").
    Before `min_tokens` tokens were generated no stop string ends it (as vLLM: a stop string is
    matched once the stream has min_tokens tokens, where it ends in the text of the token that
    made that count or of a later one); the sampler keeps stop tokens out until then.
    """

    def __init__(self, tokenizer, params: SamplingParams):
        from .tokenizer import IncrementalDetokenizer

        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = tuple(params.stop)
        self._max_tokens = params.max_tokens
        self._min_tokens = params.min_tokens
        self._held = ""
        self.tokens: list[int] = []
        self._pieces: list[str] = []  # what was emitted; `text` joins them when asked
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far. Kept as pieces and joined here, because `text += out` on an
        attribute copies the whole text at every token: O(n^2) over a long answer."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def is_stop_token(self, token: int) -> bool:
        return token in self._stop_ids

    def push(self, token: int) -> str:
        if self.done:
            raise InputError("TextStream.push after the stream has finished")
        if token in self._stop_ids:
            return self._emit(self._detok.flush(), final="stop")
        self.tokens.append(token)
        piece = self._detok.push(token)
        if self._max_tokens is not None and len(self.tokens) >= self._max_tokens:
            return self._emit(piece + self._detok.flush(), final="length")
        return self._emit(piece, final=None)

    def finish(self, reason: str) -> str:
        """End the stream from outside (e.g. max_tokens == 0, a cancelled request); returns held text."""
        if self.done:
            return ""
        return self._emit(self._detok.flush(), final=reason)

    def _emit(self, piece: str, final: str | None) -> str:
        text = self._held + piece
        armed = len(self.tokens) >= self._min_tokens
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1) if armed else -1
        if cut >= 0:
            out, self._held, self.finish_reason = text[:cut], "", "stop"
        elif final is not None:
            out, self._held, self.finish_reason = text, "", final
        else:
            keep = self._partial_stop_suffix(text)
            out, self._held = text[: len(text) - keep], text[len(text) - keep :]
        if out:
            self._pieces.append(out)
        return out

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def encode_prompt(tokenizer, prompt: str | Sequence[int] | torch.Tensor, vocab_size: int) -> list[int]:
    """Token ids of a prompt given as text or ids, checked against the vocabulary."""
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
    else:
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point:
                raise InputError(f"prompt tensor must be 1-D integer ids, got {prompt.dtype} {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InputError(f"prompt token ids must be integers, got {t!r}")
    if not ids:
        raise InputError("the prompt is empty: there is nothing to continue")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InputError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})")
    return ids


class Generation:
    """Iterator of the text chunks of one completion; see the module docstring."""

    def __init__(
        self,
        model,
        tokenizer,
        prompt,
        params: SamplingParams,
        state=None,
        generator: torch.Generator | None = None,
        speculative: str | Drafter | None = None,
        max_draft: int = DEFAULT_MAX_DRAFT,
    ):
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab_size = model.config.vocab_size
        self.model = model
        self.params = params
        self.prompt_tokens = encode_prompt(tokenizer, prompt, vocab_size)
        self.sampler = Sampler(params, vocab_size, generator, constraint_for(params, tokenizer, vocab_size))
        self.stream = TextStream(tokenizer, params)
        self._state = state
        self._decoder: SpeculativeDecoder | None = None
        self._drafter = None if speculative is None else drafter_for(speculative, model, params)
        self._max_draft = max_draft
        self.prompt_state = None
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_tokens))
        if self._drafter is not None:
            self.stats.speculative = SpeculativeStats()
        self._steps = self._run()

    @property
    def state(self):
        """The state after the prompt and every token in `tokens` (speculative decoding feeds the
        decided tokens that its last pass did not cover when this is read)."""
        return self._decoder.state if self._decoder is not None else self._state

    @state.setter
    def state(self, value) -> None:
        self._state = value

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._steps)

    def close(self) -> None:
        self._steps.close()

    def read(self) -> str:
        """Run to the end; the whole generated text."""
        for _ in self:
            pass
        return self.text

    @property
    def tokens(self) -> list[int]:
        return self.stream.tokens

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def finish_reason(self) -> str | None:
        return self.stats.finish_reason

    def _run(self) -> Iterator[str]:
        stats, stream = self.stats, self.stream
        t0 = time.perf_counter()
        logits, state = self.model.forward(self.prompt_tokens, state=self.state)
        self.state = self.prompt_state = state
        if self._drafter is not None and self.params.max_tokens != 0:  # a draft model reads the prompt: prefill
            self._drafter.prepare(self.prompt_tokens)
        t1 = time.perf_counter()
        stats.prefill_seconds = t1 - t0
        if self.params.max_tokens == 0:
            stream.finish("length")
            stats.finish_reason = stream.finish_reason
            return
        if self._drafter is not None:
            yield from self._run_speculative(logits, t1)
            return
        while True:
            token = self.sampler(logits)
            if not stream.is_stop_token(token):
                logits, state = self.model.forward([token], state=self.state)
                self.state = state
            text = self._push(token, t1)
            if text:
                yield text
            if stream.done:
                return

    def _push(self, token: int, t1: float) -> str:
        """Feed a decided token to the text stream and the stats; the new text."""
        stats, stream = self.stats, self.stream
        text = stream.push(token)
        stats.generated_tokens = len(stream.tokens)
        stats.decode_seconds = time.perf_counter() - t1
        stats.finish_reason = stream.finish_reason
        return text

    def _run_speculative(self, logits, t1: float) -> Iterator[str]:
        stats, stream = self.stats, self.stream
        dec = SpeculativeDecoder(
            self.model,
            self._drafter,
            self.sampler,
            self.prompt_tokens,
            self._state,
            logits,
            max_draft=self._max_draft,
            stats=stats.speculative,
        )
        dec.limit = self.params.max_tokens
        self._decoder = dec
        for token in dec.tokens(frozenset(self.params.stop_token_ids)):
            text = self._push(token, t1)
            if text:
                yield text
            if stream.done:
                return


def generate(
    model,
    tokenizer,
    prompt,
    params: SamplingParams | None = None,
    state=None,
    generator: torch.Generator | None = None,
    speculative: str | Drafter | None = None,
    max_draft: int = DEFAULT_MAX_DRAFT,
) -> Generation:
    """Generate a continuation of `prompt` (text or token ids), starting from `state` (None = fresh).

    Returns a `Generation`: iterate it for text chunks; afterwards read `.state`, `.stats`,
    `.tokens`, `.text`. `generator` replaces the one seeded from `params.seed`.
    speculative: None (plain decoding), "lookup" (prompt lookup), "draft" (the model's q4 twin) or
    a `speculative.Drafter` (e.g. `DraftModel(small_model)`): speculative decoding, the same
    output as plain decoding (greedy: token for token; sampling: the same distribution) in
    fewer passes over the weights; at most `max_draft` tokens drafted per pass.
    """
    return Generation(
        model,
        tokenizer,
        prompt,
        params or SamplingParams(),
        state=state,
        generator=generator,
        speculative=speculative,
        max_draft=max_draft,
    )
