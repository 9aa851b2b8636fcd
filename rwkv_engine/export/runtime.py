"""Run an exported program (.pte) with the model contract of the engine: `forward(tokens, state)`.

    model = rwkv_engine.load("model.pte")
    logits, state = model.forward([1, 2, 3])          # prefill pieces of T tokens, the rest decoded
    logits, state = model.forward([4], state)         # one decode step

`ProgramModel` has the attributes the rest of the engine reads (config, dtype, device, path,
new_state, forward with all_logits), so generate / chat / bench / perplexity / serve run on a .pte
unchanged. Prompts go through the program's `prefill` method in pieces of its fixed T and the
remainder (and every position when all_logits=True: the methods return the last token's logits)
through `decode`; a batch of B rows runs row by row (the program is exported for batch 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import CheckpointError, InputError, StateError
from ..models.model import check_tokens
from ..quant.schemes import SCHEMES
from ..state import State
from .program import FORMAT, METADATA_METHOD

Tensor = torch.Tensor

PTE_MAGIC = b"ET"  # bytes 4-5 of every ExecuTorch program file ("ET12" and later)


def is_program(path: Path) -> bool:
    """Whether `path` is an ExecuTorch program file (by its header, not its name)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(8)
    return len(head) == 8 and head[4:6] == PTE_MAGIC


class ProgramModel:
    """An exported RWKV program loaded through `executorch.runtime`."""

    native_decode = False
    layer_observer = None
    dtype_reason = None  # fixed at export
    quantization_report: dict[str, str] = {}

    def __init__(self, path: str | Path):
        try:
            from executorch.runtime import Runtime
        except ImportError:
            raise CheckpointError(
                f'{path} is an ExecuTorch program; running it needs ExecutorchRuntime: pip install -e ".[export]"'
            ) from None
        self.path = Path(path)
        try:
            self._program = Runtime.get().load_program(str(self.path))
            names = set(self._program.method_names)
            meta = (
                json.loads(self._program.load_method(METADATA_METHOD).execute([])[0])
                if METADATA_METHOD in names
                else {}
            )
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot load the ExecuTorch program ({e})") from None
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{self.path}: an ExecuTorch program, but not one rwkv-engine exported")
        self.metadata = meta
        self.config = ModelConfig(**meta["config"])
        self.fields = tuple(s["name"] for s in meta["state"])
        self.prefill_len = meta["methods"]["prefill"]["tokens"][1]
        self.quantization = SCHEMES[{"fp32": "q0f32"}.get(meta["quantization"], meta["quantization"])]
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self._methods = {name: self._program.load_method(name) for name in ("decode", "prefill", "initial_state")}
        self._initial = [t.clone() for t in self._methods["initial_state"].execute([])]

    def __repr__(self) -> str:
        c = self.config
        return (
            f"ProgramModel(version={c.version}, n_layer={c.n_layer}, n_embd={c.n_embd}, "
            f"vocab_size={c.vocab_size}, quantization={self.metadata['quantization']}, path={str(self.path)!r})"
        )

    def eval(self):
        return self

    def weight_bytes_per_step(self) -> int:
        """Bytes a decode step reads, about: the program file less its embedding table (`rwkv-engine bench`)."""
        c = self.config
        row = c.n_embd * 4 if self.metadata["quantization"] == "fp32" else c.n_embd + 4  # Int8Embedding: int8 + scale
        return max(self.path.stat().st_size - c.vocab_size * row, 1)

    def new_state(self, batch_size: int = 1) -> State:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        tensors = {k: t.expand(batch_size, *t.shape[1:]).clone() for k, t in zip(self.fields, self._initial)}
        return State(tensors, self.config.state_signature())

    def _run(self, method: str, ids: Tensor, state: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        out = self._methods[method].execute([ids, *state])
        return out[0].clone(), [t.clone() for t in out[1:]]

    def _row(self, ids: Tensor, state: list[Tensor], all_logits: bool) -> tuple[Tensor, list[Tensor]]:
        """One row: ids [T] -> (logits [V] or [T, V], state tensors of batch 1)."""
        T, P = ids.shape[0], self.prefill_len
        outs, start = [], 0
        if not all_logits:
            while T - start >= P:
                logits, state = self._run("prefill", ids[None, start : start + P], state)
                start += P
        while start < T:
            logits, state = self._run("decode", ids[None, start : start + 1], state)
            outs.append(logits)
            start += 1
        return (torch.cat(outs) if all_logits else logits[0]), state

    @torch.no_grad()
    def forward(self, tokens, state: State | None = None, all_logits: bool = False) -> tuple[Tensor, State]:
        """The contract of `RWKV.forward`: logits [V] / [B, V] (or per position with all_logits) and a new state."""
        ids, one_d = check_tokens(tokens, self.config.vocab_size, self.device)
        B = ids.shape[0]
        if state is None:
            state = self.new_state(B)
        elif not isinstance(state, State) or state.signature != self.config.state_signature():
            raise StateError(f"state does not belong to this model ({self.config.state_signature()})")
        elif state.batch_size != B:
            raise StateError(f"state has batch size {state.batch_size} but the tokens have {B} rows")
        logits, rows = [], []
        for b in range(B):
            lg, st = self._row(ids[b], [t[b : b + 1].contiguous() for _, t in state.items()], all_logits)
            logits.append(lg)
            rows.append(st)
        new = State({k: torch.cat([r[i] for r in rows]) for i, k in enumerate(self.fields)}, state.signature)
        out = torch.stack(logits)
        return (out[0] if one_d else out), new

    __call__ = forward
