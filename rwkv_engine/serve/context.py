"""What every route of the app shares: the engine, the settings, the tokenizer, the saved states."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import StateError
from ..sampling import SamplingParams
from ..state import State, load_state
from ..templates import ChatTemplate, builtin
from . import protocol as p
from .engine import Engine
from .errors import APIError
from .logprobs import TokenText


@dataclass
class AppSettings:
    """What the routes read (serve/server.py builds it from the typed server settings)."""

    model_name: str
    api_key: str | None = None
    max_prompt_tokens: int = 16384
    max_tokens_cap: int = 4096
    max_body_bytes: int = 4 << 20
    state_dir: Path | None = None
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host header (see security.Guard)
    cors_origins: tuple[str, ...] = ()
    body_timeout: float = 30.0
    chat_template: ChatTemplate = field(default_factory=lambda: builtin("world"))  # resolved (templates.resolve)
    think: bool = False  # whether a chat request that says nothing about it lets the model think


@dataclass
class ServingContext:
    """The shared state of the routes. The sampling presets and the end-of-text id come from
    app.py, which owns them."""

    engine: Engine
    settings: AppSettings
    chat_defaults: SamplingParams
    completion_defaults: SamplingParams
    completion_max_tokens: int
    eos_token_id: int
    created: int = field(default_factory=p.now)

    def __post_init__(self):
        self.tokenizer = self.engine.tokenizer
        self.model = self.engine.model
        self.metrics = self.engine.metrics
        self.token_text = TokenText(self.tokenizer)
        self.states = SavedStates(self.settings.state_dir, self.model)


class SavedStates:
    """The saved states requests may start from (extension `state`): files of `root`, loaded on
    first use and kept (the last 8) while their file is unchanged."""

    KEEP = 8

    def __init__(self, root: Path | None, model):
        self.root, self.model = root, model
        self.loaded: OrderedDict[tuple, State] = OrderedDict()

    async def get(self, name: str | None) -> tuple[State | None, str]:
        """The state `name` names, and its key for the prompt cache ((None, "") for no name)."""
        if name is None:
            return None, ""
        if self.root is None:
            raise APIError(400, "this server loads no saved states (start it with --state-dir DIR)", param="state")
        key, path = self._find(name)
        state = self.loaded.get(key)
        if state is None:
            state = await self._load(name, path)
            self.loaded[key] = state
            while len(self.loaded) > self.KEEP:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(key)
        return state, "file:" + ":".join(map(str, key))

    def _find(self, name: str) -> tuple[tuple, Path]:
        outside = APIError(400, "state must name a file inside the server's state directory", param="state")
        if "\x00" in name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise outside
        root = self.root.resolve()
        try:
            path = (root / name).resolve()
            if not path.is_relative_to(root):
                raise outside
            st = path.stat()
            if not path.is_file():
                raise OSError
        except (OSError, ValueError):
            raise APIError(400, f"no saved state named {name[:200]!r}", param="state", code="state_not_found") from None
        return (str(path), st.st_mtime_ns, st.st_size), path

    async def _load(self, name: str, path: Path) -> State:
        model = self.model
        try:  # a State.save file or a state-tuning (time_state) file, checked against the model
            state = await asyncio.to_thread(load_state, model, path)
        except StateError as e:  # (its message names the server's path: not for clients)
            why = str(e).split(": ", 1)[-1]
            raise APIError(400, f"state {name!r}: {why}", param="state") from None
        return state
