"""The decoding batch: the rows that decode together and their states, one `State` [B, ...].

A decode step feeds every row its tokens (`Row.feed`: one for a plain row, a speculating row's
pending tokens and drafts) in one pass per feed length (`passes`), each through
`models.model.decode_rows`, which keeps every row's bits those of its sequence alone. What the
rows decide from the passes' logits is the engine's; `move` then takes the states of the rows
whose state moves on, and `keep` drops the rows that ended.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..models.model import decode_rows
from ..state import State
from .work import Row


class Pass(NamedTuple):
    """One forward of the rows `idx` (indices into the batch) whose feeds have one length T:
    logits [n, V] for T = 1, [n, T, V] for a verify pass; the states after it [n, ...]."""

    idx: list[int]
    logits: torch.Tensor
    after: State


class DecodeBatch:
    """The decoding rows, row i of `state`."""

    def __init__(self, model):
        self.model = model
        self.rows: list[Row] = []
        self.state: State | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, entries: list[tuple[Row, State]]) -> None:
        """Add rows with the states they start from (one concatenation)."""
        states = [st for _, st in entries]
        self.state = State.cat(states if self.state is None else [self.state, *states])
        self.rows += [row for row, _ in entries]

    def keep(self, keep: list[int]) -> None:
        """Keep the rows `keep` (indices, in order), drop the others."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.state = self.state[keep] if keep else None

    def clear(self) -> list[Row]:
        """Drop every row; returns them."""
        rows, self.rows, self.state = self.rows, [], None
        return rows

    def passes(self, feeds: list[list[int] | None]) -> list[Pass]:
        """One forward per feed length over the rows with a feed (None: no pass for that row)."""
        lengths: dict[int, list[int]] = {}
        for i, feed in enumerate(feeds):
            if feed is not None:
                lengths.setdefault(len(feed), []).append(i)
        out = []
        for T, idx in lengths.items():
            tokens = torch.tensor([feeds[i] for i in idx], dtype=torch.long)
            states = self.state if len(idx) == len(self.rows) else self.state[idx]
            logits, after = decode_rows(self.model, tokens, states, all_logits=T > 1)
            out.append(Pass(idx, logits, after))
        return out

    def move(self, passes: list[Pass], moved: dict[int, tuple[State, int]]) -> None:
        """Take the new states of the rows in `moved` (row -> (a pass's states, its row there));
        a single pass that moved every row becomes the batch's state as it is."""
        if len(passes) == 1 and len(moved) == len(self.rows) == len(passes[0].idx):
            self.state = passes[0].after
            return
        for i, (after, j) in moved.items():  # the batch state is our own (cat / index copies)
            for name, t in self.state.items():
                t[i].copy_(getattr(after, name)[j])
