"""Every command's settings in one home, free of torch (`--help` and flag errors stay instant).

Each setting is a field of a dataclass whose default is *the* default: the command-line flags
read theirs from here (`default=EngineConfig.max_queue`, as vLLM's flags read `EngineArgs`), so
a default is written once and a new setting touches its field and its flag.

* `ModelSpec`: what to load (`rwkv_engine.load`, `load_tokenizer`); every command that runs a
  model builds one from the model flags.
* Speculative decoding: the kinds, the longest pass, the default draft length and its check.
* Chat templates: `ChatSettings` (which template renders a conversation, and whether a
  reasoning model thinks by default), shared by serve, batch, chat and eval.
* The server: `EngineConfig` (the scheduler), `Limits` (what one request may ask for),
  `RequestDefaults` (what it gets for fields it leaves out), `ServerSettings` (the HTTP side),
  and `Config`, all of them, which `serve.server.build` turns into an engine and an app
  (`rwkv-engine serve`, `batch`, the Ray replicas).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError
from .sampling_params import SamplingParams

# --- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """What to load, as `rwkv_engine.load` and `load_tokenizer` take it.

    huge_pages: the huge-page mode (memory.huge_pages_available: "1", "0" or "private") when the
    user's RWKV_ENGINE_HUGE_PAGES does not set one; None = on.
    """

    model: str  # a checkpoint file, a model directory or a Hub id
    device: str = "cpu"
    dtype: str = "auto"
    quantization: str | None = None
    group_size: int | None = None
    tokenizer: str | None = None
    huge_pages: str | None = None

    def load(self, progress: bool | None = True):
        """(model, tokenizer). progress: as `rwkv_engine.load`'s."""
        import rwkv_engine

        from .memory import huge_pages_default

        with huge_pages_default(self.huge_pages):
            model = rwkv_engine.load(
                self.model,
                device=self.device,
                dtype=self.dtype,
                progress=progress,
                quantization=self.quantization,
                group_size=self.group_size,
            )
        return model, rwkv_engine.load_tokenizer(model, self.tokenizer)


def served_name(model: str) -> str:
    """The default model id of the API: a checkpoint's file stem, a directory's name, or a Hub id."""
    path = Path(model)
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return model


# --- chat templates ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatSettings:
    """How a conversation becomes a prompt (docs/server.md, "Chat templates and thinking")."""

    template: str = "auto"  # a built-in name (world, g1), a .jinja file, or auto (templates.resolve)
    think: bool = False  # whether a reasoning model thinks when a request (or the chat) does not say

    def resolve(self, model, asked: str, log=None):
        """The `templates.ChatTemplate`, resolved for the loaded `model` (asked for as `asked`: a path
        or a Hub id); `log(line)` is told which and why."""
        from .templates import resolve

        path = str(model.path) if getattr(model, "path", None) else asked
        template = resolve(self.template, path, model.config.version, asked)
        if log is not None:
            log(
                f"chat template: {template.name} ({template.source}); thinking {'on' if self.think else 'off'} by default"
            )
        return template


# --- speculative decoding ---------------------------------------------------------------------

SPECULATIVE_KINDS = ("lookup", "draft")
# Most tokens one pass carries (not-yet-fed tokens + drafts): the per-row GEMV's limit,
# kernels.native.GEMV_MAX_ROWS (written here as a number because the kernels import torch;
# tests/test_speculative.py checks the two agree). A pass of up to GEMV_ROWS_PER_READ = 8 tokens
# reads each weight once (twice up to 16), so by default a pass is the last decided token + at
# most DEFAULT_MAX_DRAFT drafts = 8 tokens.
MAX_PASS_TOKENS = 16
DEFAULT_MAX_DRAFT = 7
DEFAULT_DRAFT_QUANTIZATION = "q4"  # of the target's own twin, the draft when none is named


def check_max_draft(value, name: str = "the draft length") -> None:
    """InputError unless `value` is a draft length a pass can carry: an integer in [1, MAX_PASS_TOKENS - 1]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < MAX_PASS_TOKENS:
        raise InputError(f"{name} must be an integer in [1, {MAX_PASS_TOKENS - 1}], got {value!r}")


# --- the server -------------------------------------------------------------------------------

CPU_MAX_BATCH = 8
CUDA_MAX_BATCH = 64  # one CUDA graph replay (--max-batch auto where torch sees a GPU)
# Most choices (`n`) one request may ask for: OpenAI's limit. A request's choices hold at most
# `EngineConfig.rows_per_request` batch rows at once; the others take turns.
MAX_CHOICES = 128


@dataclass
class EngineConfig:
    """The scheduler's settings (serve/engine.py)."""

    max_batch: int = CPU_MAX_BATCH  # sequences decoded together (= batch rows); also prompts read at once
    max_queue: int = 64  # requests waiting beyond max_batch; more: QueueFull (HTTP 429)
    prefill_chunk: int = 256  # prompt tokens per prefill step (and cache granularity)
    # While rows decode, a turn's prefill takes about this many times a decode step's time (at
    # least one 32-token piece, at most prefill_chunk); 0: always prefill_chunk (serve/pace.py).
    prefill_share: float = 1.0
    # On the CPU, threads that read prompt pieces beside the decode steps (the others decode), while
    # both kinds of work wait; None: half the threads where there are at least two, 0: never
    # (prefill and decode take turns on all threads; serve/beside.py).
    prefill_threads: int | None = None
    state_cache_bytes: int = 1 << 30  # prompt-state cache capacity (0 = no cache)
    state_store: str | None = None  # a directory the prompt-cache states spill to (None: memory only)
    state_store_bytes: int = 8 << 30  # its capacity (least recently used files go first)
    speculative: str | None = None  # the requests' default: "lookup", "draft" or None (plain decoding)
    draft: str | None = None  # the draft model ("draft"): a checkpoint (or a loaded model); None: the twin
    draft_quantization: str = DEFAULT_DRAFT_QUANTIZATION  # of the twin draft
    max_draft: int = DEFAULT_MAX_DRAFT  # most tokens drafted per pass
    reranker: str | None = None  # an EmbeddingRWKV reranker checkpoint, for /v1/rerank; None: no rerank
    rerank_instruction: str | None = None  # the reranker's instruction; None: the one it was trained with
    name: str = "rwkv-engine serve"  # what its messages on stderr start with (the command running it)

    def __post_init__(self):
        for name in ("max_batch", "max_queue", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        share = self.prefill_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share < float("inf"):
            raise InputError(f"prefill_share must be a number >= 0, got {share!r}")
        threads = self.prefill_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
            raise InputError(f"prefill_threads must be an integer >= 0 (or None: automatic), got {threads!r}")
        for name in ("state_cache_bytes", "state_store_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"{name} must be >= 0, got {value!r}")
        if self.speculative not in (None, *SPECULATIVE_KINDS):
            raise InputError(
                f"speculative must be one of {', '.join(SPECULATIVE_KINDS)} or None, got {self.speculative!r}"
            )
        check_max_draft(self.max_draft, "max_draft")

    @property
    def rows_per_request(self) -> int:
        """The most batch rows one request's choices hold at once: half the batch (1 for a batch
        of 1), so that one request never takes every row; its other choices take turns."""
        return max(1, self.max_batch // 2)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_prompt_tokens: int = 16384
    max_tokens: int = 4096  # also the default max_tokens of a chat request
    max_body_bytes: int = 4 << 20
    max_embedding_inputs: int = 2048  # inputs of one /v1/embeddings request, documents of one rerank


@dataclass(frozen=True)
class RequestDefaults:
    """What the sampling fields a request leaves out take, on every endpoint: the OpenAI API's
    defaults (temperature 1, top_p 1, no penalties, top_k off), so a request gets what the API
    means, as from any other server of the same weights; `serve --top-p ...` sets others. (Our own
    `chat` and `generate` commands keep RWKV's usual presets: sampling_params.CHAT / COMPLETION.)
    A chat's max_tokens defaults to the server's `Limits.max_tokens`, a completion's to
    `completion_max_tokens` (OpenAI's 16)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    completion_max_tokens: int = 16
    embedding_task: str | None = None  # an EmbeddingRWKV task head ("retr", "cls", "sts"); None: "retr"


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP side. The defaults are those of a server on loopback with no key, which is also
    what an in-process client of the app (`rwkv-engine batch`) gets."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # the API's model id; None: from the model's path
    api_key: str | None = None  # resolved (security.api_key); None: no key
    state_dir: Path | None = None  # saved states requests may start from; None: none
    allowed_hosts: tuple[str, ...] = ()  # Host names besides the loopback ones; "*" = any
    cors_origins: tuple[str, ...] = ()
    header_timeout: float = 10.0
    write_timeout: float = 30.0  # a client that reads nothing of a queued answer this long is cut off
    body_timeout: float = 30.0
    max_connections: int = 512
    shutdown_timeout: int = 30
    log_level: str = "info"


@dataclass(frozen=True)
class Config:
    """A whole server: the model, the engine, the requests' limits and defaults, the HTTP side,
    and how chats are rendered."""

    model: ModelSpec
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: Limits = field(default_factory=Limits)
    server: ServerSettings = field(default_factory=ServerSettings)
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    chat: ChatSettings = field(default_factory=ChatSettings)

    @property
    def model_name(self) -> str:
        return self.server.served_model_name or served_name(self.model.model)
