"""What every route of the app shares (`ServingContext`): the engine, the server's `Config`,
the tokenizer's texts and the saved states requests may start from (`SavedStates`)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path

from ..errors import StateError
from ..settings import Config
from ..state import State, load_state
from ..templates import ChatTemplate
from ..threads import releasing
from . import protocol as p
from .engine import Engine
from .errors import APIError
from .logprobs import TokenText


class ServingContext:
    """The shared state of the routes. Settings are read from `config` (rwkv_engine/settings.py),
    the one place they are written; nothing here copies them."""

    def __init__(self, engine: Engine, config: Config, template: ChatTemplate | None = None):
        self.engine, self.config = engine, config
        self.model_name = config.model_name
        # The chat template, resolved for the model (settings.ChatSettings.resolve).
        self.template = template or config.chat.resolve(engine.model, config.model.model)
        self.tokenizer, self.model, self.metrics = engine.tokenizer, engine.model, engine.metrics
        self.token_text = TokenText(self.tokenizer)
        self.states = SavedStates(config.server.state_dir, self.model)
        self.created = p.now()


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
            state = await asyncio.to_thread(releasing(load_state), model, path)
        except StateError as e:  # (its message names the server's path: not for clients)
            why = str(e).split(": ", 1)[-1]
            raise APIError(400, f"state {name!r}: {why}", param="state") from None
        return state
