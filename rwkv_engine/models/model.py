"""The RWKV model: embedding, blocks of time mix + channel mix, heads; prefill and decode.

One class serves every version; the version picks the time-mix module, and the checkpoint's
tensors pick the heads: the LM head, EmbeddingRWKV's task heads or a reranker's score head
(models/heads.py). The residual stream, the LayerNorms and the recurrent state are fp32; the big
matrices (nn.Linear, swappable for quantized modules) run in the model dtype. With fp16 weights the loader divides each block's output
matrices by 2**(layer // rescale_every) and the forward halves the residual every
`rescale_every` blocks, so fp16 matmul outputs stay in range; the LayerNorms make it exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import InputError, StateError
from ..kernels.native import GEMV_MAX_ROWS
from ..state import State
from . import native_step
from .cuda_graph import DecodeGraphs
from .heads import ScoreHead, TaskHead
from .layers import LORA_DTYPES, ChannelMix, Embedding
from .native_step import DecodeStep
from .rwkv4 import TimeMix4
from .rwkv5 import TimeMix5
from .rwkv6 import TimeMix6
from .rwkv7 import ChannelMix7a, TimeMix7

Tensor = torch.Tensor

# A time mix with `shares_context` is built with its layer index and gets the per-forward context
# (values one layer passes to later ones for the same tokens, e.g. RWKV-7's v_first; not state).
TIME_MIX = {4: TimeMix4, 5: TimeMix5, 6: TimeMix6, 7: TimeMix7}

# Tokens per prefill step for one sequence; memory of a forward is bounded by this, not by T.
PREFILL_CHUNK = 512


def prefill_end(start: int, total: int, chunk: int, rows: int = 1) -> int:
    """End of the prefill piece that begins at token `start` of `total`, `chunk` tokens a piece.

    A piece is `chunk` tokens, except that a rest that would be left for a last piece of at most
    GEMV_MAX_ROWS rows (`rows` rows per token) joins this one. Why: a linear over at most
    GEMV_MAX_ROWS rows runs the per-row GEMV, a longer one the GEMM (and very short pieces take
    the recurrent WKV), which round differently. With no short last piece, every piece of a
    prompt longer than GEMV_MAX_ROWS tokens runs the GEMM (whose rows do not depend on how many
    there are, for more than 11 with the MKL of PyTorch's CPU builds) and the chunked WKV (which
    sums in an order independent of the number of chunks; RWKV-7's on the CPU is the native
    recurrence, the same per token however the prompt is cut). So a prompt prefilled in pieces of a
    multiple of 32 tokens (the WKV chunk; the server's --prefill-chunk) gives bit for bit the
    logits and state of one `forward` over it (pieces of PREFILL_CHUNK): a sequence served gets
    the tokens it gets alone.

    That rests on the GEMMs, and two of them break it (measured on a Xeon family 6 model 167, 2
    threads): oneDNN's bf16 GEMM (16-bit models on CPUs with AVX512-BF16 / AMX) rounds a row
    differently with the row count even with the rows padded to GEMM_ROW_STEP (a 0.1B bf16 prompt
    of 200 tokens: logits up to 0.09 apart between one piece and pieces of 128, 64 or 32), and
    MKL's fp32 GEMM limited to AVX2 (as on an AVX2-only CPU) does too (the LoRA factors: up to
    8e-5). There a prompt's bits depend on where it is cut; fp32 GEMMs with AVX-512 MKL and the
    integer K-quant / int8 / int4 kernels keep them. docs/server.md, "Batched = alone".
    """
    end = min(start + chunk, total)
    return total if total - end <= GEMV_MAX_ROWS // max(rows, 1) else end


# The chunked WKV kernels' chunk (kernels/wkv5.py, wkv7.py): a piece cut short of its chunk ends
# at a multiple of this from where it started, so it is cut where a whole prefill's WKV cuts too.
WKV_CHUNK = 32


def prefill_piece_end(start: int, total: int, chunk: int, budget: int) -> int:
    """End of the next prefill piece of a prompt of `total` tokens read from `start`, reading at
    most `budget` tokens; `start` itself when no piece fits.

    The piece ends at the prompt's next cut on its grid of `chunk` tokens (the cuts of
    `prefill_cuts`, where the prompt-state cache keeps states; `prefill_end` from a cut), or,
    when that is past the budget, at the most whole WKV_CHUNKs from `start` that fit and leave
    more than GEMV_MAX_ROWS tokens. Every piece but a whole rest is longer than GEMV_MAX_ROWS, so
    a prompt read in such pieces gets the bits of one `forward` over it (`prefill_end`), however
    the budget cut it, for a chunk that is a multiple of WKV_CHUNK."""
    end = prefill_end(start - start % chunk, total, chunk)
    if end - start <= budget:
        return end
    end = start + budget - budget % WKV_CHUNK
    while end > start and total - end <= GEMV_MAX_ROWS:
        end -= WKV_CHUNK
    return end if end - start > GEMV_MAX_ROWS else start


def prefill_cuts(total: int, chunk: int) -> list[int]:
    """Where a prefill of `total` tokens in pieces of `chunk` (`prefill_end`) cuts, in order: the
    positions whose state a resumed prefill may start from and give the same bits as a cold one
    (the server's prompt-state cache keeps the states at these cuts)."""
    cuts, end = [], prefill_end(0, total, chunk)
    while end < total:
        cuts.append(end)
        end = prefill_end(end, total, chunk)
    return cuts


def decode_rows(
    model, tokens: Tensor, batch: State, all_logits: bool = False, out: State | None = None
) -> tuple[Tensor, State]:
    """`model.forward(tokens [B, T], batch, all_logits)`, on the CPU in groups of at most
    GEMV_MAX_ROWS rows x tokens: each group runs the native step, so every row's logits and state
    are those of its sequence alone (one forward of more rows would take the batched GEMM, whose
    rounding depends on the batch). T > 1: a speculative verify pass of the rows' pending tokens
    and drafts. The prefill half of the same rule is `prefill_end`. out: a state of B rows the
    new state is written into (`RWKV.forward_into`; returned), else it is new tensors."""
    B, T = tokens.shape
    G = max(1, GEMV_MAX_ROWS // T)

    def run(rows: slice | None) -> tuple[Tensor, State]:  # one forward of `rows` (None: all)
        t, b = (tokens, batch) if rows is None else (tokens[rows], batch[rows])
        if out is None:
            return model.forward(t, state=b, all_logits=all_logits)
        o = out if rows is None else out[rows]
        return model.forward_into(t, b, o, all_logits), o

    if B <= G or model.device.type != "cpu":
        return run(None)
    parts = [run(slice(i, i + G)) for i in range(0, B, G)]
    return torch.cat([p[0] for p in parts]), out if out is not None else State.cat([p[1] for p in parts])


def check_tokens(tokens, vocab_size: int, device) -> tuple[Tensor, bool]:
    """tokens -> (LongTensor [B, T] on `device`, whether the input was 1-D); InputError if they are not ids < vocab_size."""
    if isinstance(tokens, Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
            raise InputError(f"tokens must be integers, got a tensor of {tokens.dtype}")
        t = tokens.to(dtype=torch.long)
    else:
        try:
            t = torch.as_tensor(list(tokens), dtype=torch.long)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise InputError(f"tokens must be a list of ints or an integer tensor ({e})") from None
        if t.dim() != 1:
            raise InputError("tokens as a list must be flat: a list of ints")
    if t.dim() not in (1, 2):
        raise InputError(f"tokens must have shape [T] or [B, T], got {list(t.shape)}")
    if t.numel() == 0:
        raise InputError("tokens is empty: give at least one token")
    V = vocab_size
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= V:
        bad = lo if lo < 0 else hi
        raise InputError(f"token id {bad} is outside the vocabulary [0, {V})")
    one_d = t.dim() == 1
    return (t[None] if one_d else t).to(device), one_d


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_id: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        time_mix = TIME_MIX[cfg.family]
        self.shares_context = getattr(time_mix, "shares_context", False)
        self.att = time_mix(cfg, dtype, layer_id) if self.shares_context else time_mix(cfg, dtype)
        if cfg.deep_embed:
            self.ffn = ChannelMix7a(cfg, dtype)
        else:
            self.ffn = ChannelMix(cfg.n_embd, cfg.ffn_dim, dtype, receptance=cfg.family != 7)
        self.ffn_context = getattr(self.ffn, "shares_context", False)

    def forward(self, x: Tensor, st: dict[str, Tensor], ctx: dict | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """x [B, T, C] fp32; st: this layer's state fields [B, ...] -> (x, new fields).

        ctx: the per-forward context shared by the layers (see TIME_MIX), one dict per chunk of tokens.
        """
        att_state = {k: v for k, v in st.items() if k not in ("att_x_prev", "ffn_x_prev")}
        extra = (ctx,) if self.shares_context else ()
        dx, att_x_prev, att_state = self.att(self.ln1(x), st["att_x_prev"], att_state, *extra)
        x = x + dx
        dx, ffn_x_prev = self.ffn(self.ln2(x), st["ffn_x_prev"], *((ctx,) if self.ffn_context else ()))
        return x + dx, {"att_x_prev": att_x_prev, **att_state, "ffn_x_prev": ffn_x_prev}


class RWKV(nn.Module):
    """An RWKV language model. Build it with `rwkv_engine.load`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, rescale_every: int = 0):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.rescale_every = rescale_every
        self.path: Path | None = None
        # Set by the loader: which rule chose `dtype`, the quantization scheme (None: the
        # checkpoint's matrices as they are) and {linear name: how it is stored}.
        self.dtype_reason: str | None = None
        self.quantization = None
        self.quantization_report: dict[str, str] = {}
        # LayerNorm ln0 folded in; _weight skips nn.Embedding's random init (seconds of CPU at start-up)
        self.emb = Embedding(cfg.vocab_size, cfg.n_embd, _weight=torch.empty(cfg.vocab_size, cfg.n_embd, dtype=dtype))
        self.blocks = nn.ModuleList(Block(cfg, dtype, i) for i in range(cfg.n_layer))
        self.ln_out = nn.LayerNorm(cfg.n_embd)
        # The heads the checkpoint has (ModelConfig): the LM head, EmbeddingRWKV's task heads
        # (embedding.py pools the hidden states into them), a reranker's score head.
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False, dtype=dtype) if cfg.lm_head else None
        self.task_heads = nn.ModuleDict({t: TaskHead(cfg.n_embd, cfg.task_dim) for t in cfg.task_heads})
        self.score_head = ScoreHead(cfg.n_embd) if cfg.score_head else None
        self._state_shapes = {
            "att_x_prev": ((cfg.n_embd,), 0.0),
            **TIME_MIX[cfg.family].state_shapes(cfg),
            "ffn_x_prev": ((cfg.n_embd,), 0.0),
        }
        # Learned starting values [L, ...] of some state fields (a state-tuned checkpoint's time_state).
        self.initial_state: dict[str, Tensor] = {}
        # Forwards of at most GEMV_MAX_ROWS rows x tokens on the CPU (decode steps, speculative
        # verify passes, short prompts) go through the fused native step (models/native_step.py)
        # where it can run; False: always the PyTorch modules.
        self.native_decode = True
        self._native_step: tuple[int, DecodeStep | None] | None = None  # (generation, step)
        # One-token steps as CUDA graph replays (models/cuda_graph.py): None = on CUDA only,
        # False = never, True = also elsewhere (the same bookkeeping run eagerly: for tests).
        self.graph_decode: bool | None = None
        self._graphs: tuple[int, DecodeGraphs] | None = None  # (generation, graphs)
        self.layer_observer: Callable[[int, Tensor, dict[str, Tensor]], None] | None = None  # see run_blocks

    @property
    def device(self) -> torch.device:
        return self.ln_out.weight.device  # (the embedding may be a GGUF's blocks: quant/ggml_embedding.py)

    def lora_names(self) -> list[str]:
        """The state-dict names of the small LoRA matrices (RWKV-6/7: each time mix's `LORA`).

        They keep the checkpoint's type (bf16 / fp16 / fp32, see `set_lora_dtype`); the modules
        and the fused step compute with them in fp32, so a 16-bit one gives the same results as
        its exact fp32 copy at half the memory.
        """
        return [
            f"{name}.{leaf}"
            for name, m in self.named_modules()
            for leaf in getattr(m, "LORA", ())
            if getattr(m, leaf, None) is not None
        ]

    def set_lora_dtype(self, dtype: torch.dtype | Mapping[str, torch.dtype]) -> None:
        """Store the LoRA matrices in `dtype` (fp32, bf16 or fp16), or each in its own ({name:
        dtype}, names as `lora_names`; the loaders give each the type it has in the file)."""
        for name in self.lora_names():
            dt = dtype.get(name, torch.float32) if isinstance(dtype, Mapping) else dtype
            if dt not in LORA_DTYPES:
                raise ValueError(f"LoRA matrices are fp32, bf16 or fp16, not {dt}")
            module, _, leaf = name.rpartition(".")
            m = self.get_submodule(module)
            if getattr(m, leaf).dtype != dt:
                setattr(m, leaf, nn.Parameter(getattr(m, leaf).to(dt), requires_grad=False))

    def __repr__(self) -> str:
        c = self.config
        return (
            f"RWKV(version={c.version}, n_layer={c.n_layer}, n_embd={c.n_embd}, vocab_size={c.vocab_size}, "
            f"dtype={str(self.dtype).replace('torch.', '')}, device={self.device})"
        )

    # --- state ------------------------------------------------------------------------------

    def new_state(self, batch_size: int = 1) -> State:
        """The initial state of `batch_size` sequences."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        L = self.config.n_layer
        tensors = {
            name: torch.full((batch_size, L, *shape), init, dtype=torch.float32, device=self.device)
            for name, (shape, init) in self._state_shapes.items()
        }
        for name, init in self.initial_state.items():
            if init.device != self.device:  # kept apart from the parameters: .to() does not move it
                init = self.initial_state[name] = init.to(self.device)
            tensors[name].copy_(init.expand_as(tensors[name]))
        return State(tensors, self.config.state_signature())

    def _check_state(self, state: State, batch_size: int) -> None:
        if not isinstance(state, State):
            raise StateError(f"state must be an rwkv_engine.State, got {type(state).__name__}")
        if state.signature != self.config.state_signature():
            raise StateError(
                f"state belongs to another model ({state.signature}); this model is {self.config.state_signature()}"
            )
        if state.batch_size != batch_size:
            raise StateError(f"state has batch size {state.batch_size} but the tokens have {batch_size} rows")

    # --- forward ----------------------------------------------------------------------------

    def _check_tokens(self, tokens) -> tuple[Tensor, bool]:
        return check_tokens(tokens, self.config.vocab_size, self.device)

    def _logits(self, x: Tensor) -> Tensor:
        return self.head(self.ln_out(x).to(self.dtype)).float()

    def require_lm_head(self) -> None:
        """InputError unless the model has a language-model head (what logits, generation, export need)."""
        if self.head is None:
            kind = "a reranker" if self.config.score_head else "an embedding model (EmbeddingRWKV)"
            raise InputError(
                f"this is {kind}: it has no language-model head, so it gives no logits and cannot generate; "
                "it embeds (rwkv_engine.embed, rwkv-engine embed) and reranks"
            )

    @torch.no_grad()
    def forward(self, tokens, state: State | None = None, all_logits: bool = False) -> tuple[Tensor, State]:
        """Run the model over `tokens`, starting from `state` (a fresh one if None).

        tokens: list[int] | LongTensor [T] | LongTensor [B, T].
        Returns (logits, new_state). logits are fp32: [V] for a 1-D input and [B, V] for [B, T]
        (the last position), or [T, V] / [B, T, V] with all_logits=True. The given state is
        never modified. Any length runs in bounded memory: the sequence is processed in chunks
        of PREFILL_CHUNK tokens (see `prefill_end`) with the state carried between them.
        """
        return self._forward(tokens, state, all_logits)

    def _forward(self, tokens, state: State | None, all_logits: bool, out: State | None = None) -> tuple[Tensor, State]:
        """`forward`; out: where the native step writes the new state (`forward_into`; the
        other paths return new tensors)."""
        self.require_lm_head()
        ids, one_d = self._check_tokens(tokens)
        B, T = ids.shape
        state, owned = self._start_state(state, B)
        native = self.native_decode and self.layer_observer is None  # the fused step shows no layers
        if T == 1 and self.layer_observer is None and self._graph_decode():
            logits, new_state = self._decode_graphs()(ids[:, 0], state)
            logits = logits[:, None] if all_logits else logits
            return (logits[0] if one_d else logits), new_state
        if B * T <= GEMV_MAX_ROWS and native and self.device.type == "cpu":
            step = self._decode_step()
            if step is not None:
                return self._forward_native(step, ids, state, all_logits, one_d, out)
        outs = []
        last = None

        def take(start: int, x: Tensor) -> None:
            nonlocal last
            if all_logits:
                outs.append(self._logits(x))
            last = x

        new_state = self._prefill(ids, state, take, owned)
        logits = torch.cat(outs, dim=1) if all_logits else self._logits(last[:, -1])
        return (logits[0] if one_d else logits), new_state

    @torch.no_grad()
    def hidden(self, tokens, state: State | None = None) -> tuple[Tensor, State]:
        """The final hidden states (after ln_out, fp32) of every position, and the new state.

        tokens as `forward`'s; returns ([T, C] or [B, T, C], new_state). What the LM head reads,
        and what embeddings are pooled from (rwkv_engine/embedding.py, which reduces each piece
        as it comes instead of keeping all of them). The given state is never modified.
        """
        ids, one_d = self._check_tokens(tokens)
        state, owned = self._start_state(state, ids.shape[0])
        pieces = []
        new_state = self._prefill(ids, state, lambda start, x: pieces.append(self.final_norm(x)), owned)
        out = torch.cat(pieces, dim=1)
        return (out[0] if one_d else out), new_state

    @torch.no_grad()
    def prefill(self, tokens, state: State | None = None, each: Callable[[int, Tensor], None] | None = None) -> State:
        """The state after `tokens` (from `state`, a fresh one if None), no head computed: what a
        model without an LM head (an embedder) gives for a prefix, e.g. a document a reranker
        will read. each(start, x), when given, receives every piece's last-block output x [B, t, C]
        (fp32, before ln_out; positions start .. start + t) as it comes: embedding.py pools them."""
        ids, _ = self._check_tokens(tokens)
        state, owned = self._start_state(state, ids.shape[0])
        return self._prefill(ids, state, each or (lambda start, x: None), owned)

    def final_norm(self, x: Tensor) -> Tensor:
        """The last block's output x [..., C] -> the final hidden state (ln_out), fp32."""
        return self.ln_out(x).float()

    def _start_state(self, state: State | None, batch_size: int) -> tuple[State, bool]:
        """(the state a call starts from, whether it is the call's own): a fresh one for None, a
        copy on this device, or the caller's, which is never modified."""
        if state is None:
            return self.new_state(batch_size), True
        self._check_state(state, batch_size)
        if state.device != self.device:
            return state.to(self.device), True
        return state, False

    def _prefill(self, ids: Tensor, state: State, take: Callable[[int, Tensor], None], owned: bool = False) -> State:
        """ids [B, T] through the block stack in pieces (`prefill_end`), the state carried;
        take(start, x) gets each piece's last-block output x [B, t, C] (fp32, before ln_out) as it
        comes, so memory stays bounded by the piece for any T. Returns the new state. owned: the
        state is this call's own (`_start_state`), so the new state is written over it."""
        B, T = ids.shape
        L = self.config.n_layer
        # The new state is written layer by layer into tensors allocated once: per-layer state
        # tensors living between the big temporaries fragment the heap and raise the peak RSS.
        # A block reads its layer's fields before they are overwritten (`keep` runs after it), so
        # a state of the call's own needs no second copy (12.6 MB on the 1.5B RWKV-7 shape).
        new = dict(state.items()) if owned else {k: torch.empty_like(v) for k, v in state.items()}
        layers = [{k: v[:, i] for k, v in state.items()} for i in range(L)]
        chunk = max(16, PREFILL_CHUNK // B)

        def keep(i: int, fields: dict[str, Tensor]) -> None:
            for k, v in fields.items():
                new[k][:, i].copy_(v)
            layers[i] = {k: new[k][:, i] for k in fields}

        start = 0
        while start < T:
            end = prefill_end(start, T, chunk, B)
            take(start, self.run_blocks(self.emb(ids[:, start:end]).float(), layers, keep, ids[:, start:end]))
            start = end
        return State(new, state.signature)

    def run_blocks(
        self,
        x: Tensor,
        layers: list[dict[str, Tensor]],
        emit: Callable[[int, dict[str, Tensor]], None],
        ids: Tensor | None = None,
    ) -> Tensor:
        """The embedded tokens x [B, T, C] fp32 through every block -> the last block's output.

        layers[i]: block i's state fields [B, ...]; emit(i, fields) receives its new ones. This is
        the one block loop: `forward` and the exported program (rwkv_engine/export) both run it.
        `layer_observer`, when set, is called as observer(i, x, fields) after each block with its
        output in the units of an unscaled model (the fp16 rescale undone; `rwkv-engine verify`).
        """
        ctx: dict[str, Tensor] = {} if ids is None else {"ids": ids}  # the token ids: RWKV-7a's tables
        if ids is None and self.config.deep_embed:
            raise InputError("an RWKV-7a (DeepEmbed) model needs the token ids of its input (run_blocks ids=)")
        for i, block in enumerate(self.blocks):
            x, fields = block(x, layers[i], ctx)
            if self.layer_observer is not None:
                scale = 2.0 ** (i // self.rescale_every) if self.rescale_every else 1.0
                self.layer_observer(i, x * scale, fields)
            emit(i, fields)
            del fields
            if self.rescale_every and (i + 1) % self.rescale_every == 0:
                x = x / 2
        return x

    def _decode_step(self) -> DecodeStep | None:
        """The fused native step for the model's current tensors (rebuilt when one is replaced)."""
        gen = native_step.generation()
        if self._native_step is None or self._native_step[0] != gen:
            self._native_step = (gen, DecodeStep.build(self))
        return self._native_step[1]

    def reset_decode_step(self) -> None:
        """Forget the fused decode step and the decode graphs; the next one-token forward builds
        them from the current tensors."""
        self._native_step = None
        self._graphs = None

    def _graph_decode(self) -> bool:
        return self.graph_decode is True or (self.graph_decode is None and self.device.type == "cuda")

    def _decode_graphs(self) -> DecodeGraphs:
        """The decode graphs for the model's current tensors (recaptured when one is replaced)."""
        gen = native_step.generation()
        if self._graphs is None or self._graphs[0] != gen:
            self._graphs = (gen, DecodeGraphs(self))
        return self._graphs[1]

    def _apply(self, *args, **kwargs):  # .to(), .float(), ...: tensors may be converted in place
        self.reset_decode_step()
        return super()._apply(*args, **kwargs)

    def _forward_native(
        self, step: DecodeStep, ids: Tensor, state: State, all_logits: bool, one_d: bool, out: State | None = None
    ):
        """forward() of a few tokens per row through `step`; the same results as the block loop.
        out: where the new state goes (`forward_into`), else new tensors."""
        x = self.emb(ids).float().contiguous()  # [B, T, C]
        fields = state.fields
        ins = [t.contiguous() for _, t in state.items()]
        outs = [torch.empty_like(t) for t in ins] if out is None else [getattr(out, k) for k in fields]
        logits = step(x, ins, outs, all_logits)  # [B, T, V] or [B, V]
        return (logits[0] if one_d else logits), (
            State(dict(zip(fields, outs)), state.signature) if out is None else out
        )

    @torch.no_grad()
    def forward_into(self, tokens: Tensor, state: State, out: State, all_logits: bool = False) -> Tensor:
        """`forward(tokens [B, T], state, all_logits)` that writes the new state into `out` (the
        fields of `state`, B rows each, contiguous, sharing no memory with `state`) and returns
        the logits. A server's decode batch steps between two buffers of its own this way,
        instead of a new batch-sized state every step (`serve/decode.py`). The native step writes
        into `out` itself; the other paths' new state is copied into it."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            raise InputError("forward_into takes tokens as a LongTensor [B, T]")
        if set(out.fields) != set(state.fields) or out.signature != state.signature:
            raise StateError("forward_into: out must have the fields of the state")
        for k, t in state.items():
            o = getattr(out, k)
            if o.shape != t.shape or o.dtype != t.dtype or o.device != t.device or not o.is_contiguous():
                raise StateError(f"forward_into: out.{k} must be contiguous, {tuple(t.shape)} {t.dtype} on {t.device}")
        logits, new = self._forward(tokens, state, all_logits, out)
        if new is not out:
            for k, t in new.items():
                getattr(out, k).copy_(t)
        return logits
