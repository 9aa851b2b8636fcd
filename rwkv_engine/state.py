"""The recurrent state of a batch of sequences.

A `State` holds named tensors, each batch-first with the layer on the second axis:

    RWKV-4:   att_x_prev [B, L, C], att_num / att_den / att_max [B, L, A], ffn_x_prev [B, L, C]
    RWKV-5/6: att_x_prev [B, L, C], att_kv [B, L, H, N, N] (laid out [key][value]), ffn_x_prev [B, L, C]
    RWKV-7:   att_x_prev [B, L, C], att_kv [B, L, H, N, N] (also [key][value]: the transpose of the
              `rwkv` pip package's [value][key] RWKV-7 state, the same layout as fla's), ffn_x_prev [B, L, C]

Every tensor is fp32 whatever the weight dtype. `x_prev` is the post-LayerNorm input of the
previous token (token shift); att_num / att_den / att_max is RWKV-4's log-space WKV accumulator.
RWKV-7's v_first (layer 0's value of the same token) is not state: each forward recomputes it.
A state is tied to a model by its `signature` (version and sizes): using it with a model of a
different signature raises StateError.

States are values: the model's forward never modifies the state it is given. They can be
cloned, indexed by batch row, concatenated along the batch, moved, and saved to a safetensors
file (no pickle) that `State.load` reads back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import StateError

Tensor = torch.Tensor

_FORMAT = "rwkv-engine-state/1"


class State:
    def __init__(self, tensors: dict[str, Tensor], signature: str):
        if not tensors:
            raise StateError("a state needs at least one tensor")
        flat = [k for k, t in tensors.items() if not isinstance(t, Tensor) or t.dim() == 0]
        if flat:
            raise StateError(f"state tensor {flat[0]!r} has no batch axis (a state's tensors are [B, ...])")
        sizes = {t.shape[0] for t in tensors.values()}
        if len(sizes) != 1:
            raise StateError(f"state tensors disagree on the batch size: {sorted(sizes)}")
        self._tensors = dict(tensors)
        self.signature = signature

    # --- access -----------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Tensor:
        tensors = self.__dict__.get("_tensors")
        if tensors is not None and name in tensors:
            return tensors[name]
        raise AttributeError(f"State has no field {name!r}")

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def items(self):
        return self._tensors.items()

    @property
    def batch_size(self) -> int:
        return next(iter(self._tensors.values())).shape[0]

    def __len__(self) -> int:
        return self.batch_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self._tensors.values())).device

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self._tensors.items())
        return f"State({self.signature}, {shapes})"

    # --- value operations -------------------------------------------------------------------

    def clone(self) -> State:
        return State({k: v.clone() for k, v in self._tensors.items()}, self.signature)

    def to(self, device) -> State:
        return State({k: v.to(device) for k, v in self._tensors.items()}, self.signature)

    def __getitem__(self, index) -> State:
        """Rows of the batch: an int keeps a batch axis of 1; slices, lists and tensors select rows."""
        if isinstance(index, int):
            B = self.batch_size
            if not -B <= index < B:
                raise IndexError(f"state row {index} out of range for batch size {B}")
            index = slice(index % B, index % B + 1)
        return State({k: v[index] for k, v in self._tensors.items()}, self.signature)

    @staticmethod
    def cat(states: Sequence[State]) -> State:
        states = list(states)
        if not states:
            raise StateError("State.cat needs at least one state")
        first = states[0]
        for s in states[1:]:
            if s.signature != first.signature or set(s.fields) != set(first.fields):
                raise StateError(f"cannot concatenate states of different models: {first.signature} and {s.signature}")
        return State({k: torch.cat([s._tensors[k] for s in states]) for k in first.fields}, first.signature)

    def allclose(self, other: State, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
        return (
            self.signature == other.signature
            and set(self.fields) == set(other.fields)
            and all(torch.allclose(v, other._tensors[k], rtol=rtol, atol=atol) for k, v in self._tensors.items())
        )

    def check_usable(self, model, batch_size: int | None = 1, probe: bool = True) -> None:
        """StateError unless this state can start sequences of `model`: its signature, its batch
        size (None: any), the layout of `model.new_state` (field names, shapes, dtypes), finite
        values, and (`probe`) a model output from it that is finite (`_probe`). For a state from a
        file (a server's --state-dir, a saved chat, --state FILE): a wrong shape, a NaN or a value
        too large for the model's arithmetic would fail (or poison) the first forward instead.
        Without `probe`: a state this model computed, whose bytes are known to be unchanged (the
        server's --state-store files carry a checksum and the model's key)."""
        if self.signature != model.config.state_signature():
            raise StateError(f"the state belongs to another model ({self.signature})")
        if batch_size is not None and self.batch_size != batch_size:
            raise StateError(f"the state holds {self.batch_size} sequences, not {batch_size}")
        want = {k: (t.shape[1:], t.dtype) for k, t in model.new_state(1).items()}
        have = {k: (t.shape[1:], t.dtype) for k, t in self.items()}
        if have != want:
            raise StateError("the state does not have the fields, shapes and dtypes of this model's state")
        if not all(bool(t.isfinite().all()) for t in self._tensors.values()):
            raise StateError("the state holds NaN or infinite values")
        if probe:
            self._probe(model)

    def _probe(self, model) -> None:
        """StateError unless the model's forward from this state stays finite.

        Finite values are not enough: every tensor at 3e38 is finite, and the first product
        with it overflows. No bound written here could say which values are too large: that
        depends on the version's math (a matrix-valued wkv state is read through a sum over
        the head size, then a group norm that squares it; RWKV-4's is in log space), on the
        weights (the receptance that reads the state), on the dtype (an fp16 model overflows at
        65504) and on the kernels. Even a reachable range is not the test, since a state whose
        decay is near 1 grows without bound over a long text, and stays usable. So the model
        itself is the judge: a short forward from the state (GEMV_MAX_ROWS + 1 tokens spread
        over the vocabulary, every position's logits and the state after them) must be finite.

        That length takes the prompt path (the GEMM and the chunked WKV), which holds no buffers
        between calls, never the one-token decode step or its CUDA graphs, whose buffers the
        server's engine thread reuses: so a server may run this on another thread. It costs one
        short prefill per state file (the server keeps loaded states). A state that passes and
        overflows only later, on some other text, still meets the sampler's guard
        (ModelOutputError) as the model's own overflow would."""
        from .kernels.native import GEMV_MAX_ROWS

        T, V = GEMV_MAX_ROWS + 1, model.config.vocab_size
        ids = torch.linspace(0, V - 1, T).long().expand(self.batch_size, T)
        with torch.no_grad():
            logits, after = model.forward(ids, self, all_logits=True)
        if not (logits.isfinite().all() and all(t.isfinite().all() for _, t in after.items())):
            peak = max(float(t.abs().max()) for t in self._tensors.values())
            raise StateError(
                f"the model's output from this state is NaN or infinite: its values (up to {peak:.3g}) "
                "are too large for this model's arithmetic"
            )

    # --- files ------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write the state to a safetensors file (atomically: a partial file never appears)."""
        from safetensors.torch import save_file

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self._tensors.items()}
        meta = {"format": _FORMAT, "signature": self.signature, "fields": ",".join(self._tensors)}
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
        return path

    @staticmethod
    def load(path: str | os.PathLike, device="cpu") -> State:
        """Read a state written by `State.save`."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise StateError(f"{path}: no such state file")
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises several types for bad headers
            raise StateError(f"{path}: not a state file ({e})") from None
        if meta.get("format") != _FORMAT or "signature" not in meta:
            raise StateError(f"{path}: not an rwkv-engine state file")
        order = [k for k in meta.get("fields", "").split(",") if k in tensors]  # safetensors sorts keys
        order += sorted(k for k in tensors if k not in order)
        return State({k: tensors[k] for k in order}, meta["signature"])


def load_state(model, path: str | os.PathLike) -> State:
    """The state of one sequence from a file, checked against `model`: a `State.save` file, or a
    state-tuning file (RWKV-PEFT's `blocks.{i}.att.time_state` tensors alone, .pth or
    .safetensors; RWKV-6/7), whose wkv state starts from time_state^T per block (the layout of
    loading.initial_state) and whose token-shift states are zero. Raises StateError for a file of
    another model's shape, of several sequences, or with NaN / infinite values."""
    path = Path(path)
    if not path.is_file():
        raise StateError(f"{path}: no such state file")
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise StateError(f"{path}: cannot read the state file ({e.strerror})") from None
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        state = _time_state_file(model, path, _read_torch(path))
    else:
        try:
            state = State.load(path, model.device)
        except StateError:
            tensors = _read_safetensors(path)
            state = _time_state_file(model, path, tensors)
    try:
        state.check_usable(model)
    except StateError as e:
        raise StateError(f"{path}: {e}") from None
    return state.to(model.device)


def _read_torch(path: Path) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle / zip errors of all kinds
        raise StateError(f"{path}: not a state file ({type(e).__name__}: {str(e)[:160]})") from None
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise StateError(f"{path}: not a state file (expected a dict of time_state tensors)")
    return obj


def _read_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:
        raise StateError(f"{path}: not a state file ({str(e)[:160]})") from None


def _time_state_file(model, path: Path, tensors: dict) -> State:
    """A state-tuning file's state (see load_state)."""
    import re

    cfg = model.config
    names = {k: re.fullmatch(r"(?:rwkv\.)?blocks\.(\d+)\.att(?:ention)?\.time_state", k) for k in tensors}
    other = [k for k, m in names.items() if m is None]
    if not tensors or other:
        raise StateError(
            f"{path}: not a state file (neither written by State.save nor only blocks.N.att.time_state "
            f"tensors{'; it has ' + other[0] if other else ''})"
        )
    if cfg.family < 6:
        raise StateError(f"{path}: a time_state file; RWKV-{cfg.version} models have no such state")
    layers = {int(m.group(1)): k for k, m in names.items()}
    if sorted(layers) != list(range(cfg.n_layer)):
        raise StateError(
            f"{path}: the state has time_state for {len(layers)} blocks; this model has {cfg.n_layer} "
            f"(the state belongs to another model)"
        )
    H, N = cfg.n_head, cfg.head_size
    per_layer = []
    for i in range(cfg.n_layer):
        t = tensors[layers[i]]
        shape = tuple(t.shape)
        while len(shape) > 3 and shape[0] == 1:
            shape = shape[1:]
        if shape != (H, N, N):
            raise StateError(
                f"{path}: time_state of block {i} has shape {tuple(t.shape)}; this model's is {(H, N, N)} "
                f"(the state belongs to another model)"
            )
        per_layer.append(t.float().reshape(H, N, N).transpose(1, 2))
    state = model.new_state(1)
    tensors = dict(state.items())
    tensors["att_kv"] = torch.stack(per_layer)[None].contiguous().to(state.device)
    return State(tensors, state.signature)
