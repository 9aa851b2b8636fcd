"""The prompt-state cache: the state after a prompt prefix, so a prompt that starts with a cached
prefix resumes from it instead of reading it again.

Entries are keyed by (start key, token-id prefix): the start key names the state the prefix was
read from ("" is the fresh state; a saved state file has its own). The engine puts the state
after every full prefill chunk; `lookup` returns the longest cached prefix at which a cold
prefill of the prompt would cut (`models.model.prefill_cuts`), so a resumed prefill runs the very
same forward calls on the very same state as a cold one: the cache changes how fast an answer
starts, never what it is.

The states live in host RAM, in an LRU map bounded in bytes (`PromptCache`). With a `store`
(serve/state_store.py, `--state-store`), a second tier on disk, shared across restarts and
replicas, sits behind the same two calls: `put` also queues the state for the disk (written off
the engine thread), and `lookup` asks the store after each in-memory miss, so a conversation
resumes from its cached prefix after a restart with the same answer as a cold prefill.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ..models.model import prefill_cuts
from ..state import State
from .state_store import StateStore


def host_copy(state: State) -> State:
    """A GPU state copied to pinned host memory (the cache lives in host RAM; `model.forward`
    moves a state from there to its device, a DMA from pinned pages); other states as they are."""
    if state.device.type != "cuda":
        return state
    pinned = {}
    for k, v in state.items():
        pinned[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v)
    return State(pinned, state.signature)


class PromptCache:
    """LRU map (start key, token-id prefix) -> State after that prefix, bounded in bytes; with a
    `store`, every state put is also written to disk, and a prefix missing in memory is looked
    for there."""

    def __init__(self, capacity_bytes: int, store: StateStore | None = None):
        self.capacity = capacity_bytes
        self.store = store
        self.nbytes = 0
        self._entries: OrderedDict[tuple[str, bytes], State] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(key: tuple[str, bytes], state: State) -> int:
        return state.nbytes + len(key[1]) + len(key[0])

    def put(self, start_key: str, prefix: Sequence[int], state: State) -> None:
        key = (start_key, array("q", prefix).tobytes())
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        state = host_copy(state)
        if self.store is not None:
            self.store.put(start_key, prefix, state)
        self._remember(key, state)

    @property
    def enabled(self) -> bool:
        """Whether a put keeps anything (memory capacity, or a store)."""
        return bool(self.capacity) or self.store is not None

    def _remember(self, key: tuple[str, bytes], state: State) -> None:
        size = self._size(key, state)
        if size > self.capacity:
            return
        while self._entries and self.nbytes + size > self.capacity:
            old_key, old = self._entries.popitem(last=False)
            self.nbytes -= self._size(old_key, old)
        self._entries[key] = state
        self.nbytes += size

    def lookup(self, start_key: str, ids: Sequence[int], chunk: int) -> tuple[int, State | None]:
        """(k, state after ids[:k]) for the longest cached k at which a cold prefill of `ids` in
        pieces of `chunk` cuts (`prefill_cuts`), or (0, None)."""
        if not self._entries and self.store is None:
            return 0, None
        raw = array("q", ids).tobytes()
        width = raw and len(raw) // len(ids)
        for k in reversed(prefill_cuts(len(ids), chunk)):
            key = (start_key, raw[: k * width])
            state = self._entries.get(key)
            if state is not None:
                self._entries.move_to_end(key)
                return k, state
            if self.store is not None and (state := self.store.get(start_key, ids[:k])) is not None:
                self._remember(key, state)
                return k, state
        return 0, None

    def get(self, start_key: str, prefix: Sequence[int]) -> State | None:
        """The state after exactly `prefix`, or None (a reranked document's prefix: embedding.Reranking)."""
        key = (start_key, array("q", prefix).tobytes())
        state = self._entries.get(key)
        if state is not None:
            self._entries.move_to_end(key)
        return state

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
