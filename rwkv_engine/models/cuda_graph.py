"""The one-token decode step as CUDA graph replays, one graph per batch bucket.

At batch 1 a decode step of the 1.5B shape is a few hundred small kernels; launched one by one
from Python they cost more than the weights take to stream. A CUDA graph launches them all at
once. A graph has fixed shapes and addresses, so each bucket (BUCKETS) has static buffers: token
ids [b], every state field [b, L, ...] in and out (the first b rows of buffers the buckets share),
and the logits [b, V]; a batch of B rows is padded to the smallest bucket that holds it (the
padding rows compute garbage nobody reads: every row of the step is independent of the others),
copied in, replayed, and its B rows copied out. So a row gets the same bits as the same sequence in any other batch of its bucket.

    graphs = DecodeGraphs(model)              # capture=False: the same bookkeeping, run eagerly
    logits, state = graphs(ids, state)        # ids LongTensor [B] on the model's device

The step is `RWKV.run_blocks`, the PyTorch modules that are the specification (the WKV dispatch
picks the fused GPU kernels on CUDA); a graph is captured the first time its bucket is used. On
the CPU the fused native step (models/native_step.py) is the decode path; `capture=False` runs
this class's bookkeeping there so the tests exercise it.
"""

from __future__ import annotations

import torch

from ..state import State

Tensor = torch.Tensor

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(rows: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The smallest bucket that holds `rows` rows (rows <= buckets[-1])."""
    for b in buckets:
        if rows <= b:
            return b
    raise ValueError(f"{rows} rows is more than the largest bucket ({buckets[-1]})")


def step(model, ids: Tensor, fields: dict[str, Tensor], out: dict[str, Tensor]) -> Tensor:
    """One token per row through the model: ids [b] -> logits [b, V] fp32; the new state fields
    written into `out` (the same names and shapes as `fields`, which are only read)."""
    x = model.emb(ids[:, None]).float()
    layers = [{k: v[:, i] for k, v in fields.items()} for i in range(model.config.n_layer)]

    def keep(i: int, new: dict[str, Tensor]) -> None:
        for k, v in new.items():
            out[k][:, i].copy_(v)

    x = model.run_blocks(x, layers, keep, ids[:, None])  # (the ids: RWKV-7a's per-token tables)
    return model._logits(x[:, -1])


class _Bucket:
    """The static buffers of one bucket (the first `rows` rows of the shared ones) and, on CUDA,
    its captured graph."""

    def __init__(self, model, rows: int, capture: bool, pool, shared: tuple[dict, dict]):
        self.rows = rows
        self.ids = torch.zeros(rows, dtype=torch.long, device=model.device)
        self.state_in = {k: v[:rows] for k, v in shared[0].items()}
        self.state_out = {k: v[:rows] for k, v in shared[1].items()}
        self.graph = None
        self.model = model
        if capture:
            self._capture(pool)
        else:
            self.logits = None

    def _capture(self, pool) -> None:
        model = self.model
        side = torch.cuda.Stream(device=model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):  # warm-up off the capture: lazy init, kernel autotuning, cuBLAS workspaces
            for _ in range(2):
                step(model, self.ids, self.state_in, self.state_out)
        torch.cuda.current_stream(model.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step(model, self.ids, self.state_in, self.state_out)

    def run(self) -> Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return step(self.model, self.ids, self.state_in, self.state_out)


class DecodeGraphs:
    """A model's one-token step for up to BUCKETS[-1] rows a call (more: in several calls)."""

    def __init__(self, model, capture: bool | None = None, buckets: tuple[int, ...] = BUCKETS):
        self.model = model
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.buckets = tuple(sorted(buckets))
        self._buckets: dict[int, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None  # buckets share memory
        # State buffers in / out, shared by the buckets: rows of the largest one used so far (a
        # state row of a 7B model is 33 MB; per-bucket buffers would hold every size at once).
        self._shared: tuple[dict, dict] | None = None

    def captured(self) -> list[int]:
        """The buckets built so far."""
        return sorted(self._buckets)

    def bucket(self, rows: int) -> _Bucket:
        b = bucket_for(rows, self.buckets)
        if self._shared is None or next(iter(self._shared[0].values())).shape[0] < b:
            # Larger buffers: the graphs captured on the old ones are dropped (recaptured on use).
            self._buckets.clear()
            self._shared = None
            state_in = dict(self.model.new_state(b).items())
            self._shared = (state_in, {k: torch.empty_like(v) for k, v in state_in.items()})
        if b not in self._buckets:
            self._buckets[b] = _Bucket(self.model, b, self.capture, self._pool, self._shared)
        return self._buckets[b]

    @torch.no_grad()
    def __call__(self, ids: Tensor, state: State) -> tuple[Tensor, State]:
        """ids LongTensor [B] (on the model's device) and the state of B rows -> (logits [B, V],
        the new state); `state` is not modified."""
        B = ids.shape[0]
        most = self.buckets[-1]
        if most < B:  # whole largest buckets, then the rest
            parts = [self(ids[i : i + most], state[i : i + most]) for i in range(0, B, most)]
            fields = state.fields
            return (
                torch.cat([p[0] for p in parts]),
                State({k: torch.cat([getattr(p[1], k) for p in parts]) for k in fields}, state.signature),
            )
        g = self.bucket(B)
        g.ids[:B].copy_(ids)
        for k, t in state.items():
            g.state_in[k][:B].copy_(t)
        logits = g.run()
        new = {k: v[:B].clone() for k, v in g.state_out.items()}
        return logits[:B].clone(), State(new, state.signature)
