"""The server assembled from typed settings: the model, the engine, the app over them.

    from rwkv_engine.serve.server import Config, ModelSpec, build
    engine, app, settings = build(Config(ModelSpec("out-q8")))

What `rwkv-engine serve` runs (with `launch.serve` around it), what every Ray replica and Ray
batch worker runs (serve/ray.py), and what `rwkv-engine batch` runs in its own process. The
command lines only turn their flags into these objects (cli/serve.py, cli/batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .engine import EngineConfig

__all__ = ["ChatSettings", "Config", "EngineConfig", "Limits", "ModelSpec", "ServerSettings", "build", "served_name"]


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

        from ..memory import huge_pages_default

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


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_prompt_tokens: int = 16384
    max_tokens: int = 4096  # also the default max_tokens of a chat request
    max_body_bytes: int = 4 << 20


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
class ChatSettings:
    """How chat requests become prompts (docs/server.md, "Chat templates and thinking")."""

    template: str = "auto"  # a built-in name (world, g1), a .jinja file, or auto (templates.resolve)
    think: bool = False  # the default of requests that say nothing about thinking

    def resolve(self, model, asked: str, log=None):
        """The template, resolved for the loaded `model` (asked for as `asked`: a path or a Hub id);
        `log(line)` is told which and why."""
        from ..templates import resolve

        path = str(model.path) if getattr(model, "path", None) else asked
        template = resolve(self.template, path, model.config.version, asked)
        if log is not None:
            log(
                f"chat template: {template.name} ({template.source}); thinking {'on' if self.think else 'off'} by default"
            )
        return template


@dataclass(frozen=True)
class Config:
    model: ModelSpec
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: Limits = field(default_factory=Limits)
    server: ServerSettings = field(default_factory=ServerSettings)
    chat: ChatSettings = field(default_factory=ChatSettings)

    @property
    def model_name(self) -> str:
        return self.server.served_model_name or served_name(self.model.model)


def served_name(model: str) -> str:
    """The default model id of the API: a checkpoint's file stem, a directory's name, or a Hub id."""
    path = Path(model)
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return model


def build(config: Config, progress: bool | None = None):
    """(engine, app, app settings): the model loaded, and the engine and app over it."""
    from .app import AppSettings, create_app
    from .engine import Engine
    from .security import allowed_hosts

    model, tokenizer = config.model.load(progress)
    template = config.chat.resolve(model, config.model.model, log=_log(config.engine.name))
    engine = Engine(model, tokenizer, config.engine)
    server, limits = config.server, config.limits
    settings = AppSettings(
        model_name=config.model_name,
        api_key=server.api_key,
        max_prompt_tokens=limits.max_prompt_tokens,
        max_tokens_cap=limits.max_tokens,
        max_body_bytes=limits.max_body_bytes,
        state_dir=server.state_dir,
        allowed_hosts=allowed_hosts(server.host, list(server.allowed_hosts)),
        cors_origins=tuple(server.cors_origins),
        body_timeout=server.body_timeout,
        chat_template=template,
        think=config.chat.think,
    )
    return engine, create_app(engine, settings), settings


def _log(name: str):
    import sys

    return lambda line: print(f"{name}: {line}", file=sys.stderr, flush=True)
