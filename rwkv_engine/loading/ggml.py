"""Checkpoints of the ggml family: llama.cpp's GGUF files and rwkv.cpp's `.bin` files, read into
BlinkDL-named tensors (the converters' transforms undone) for the loader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

Tensor = torch.Tensor


@dataclass
class RowSource:
    """A quantized 2-D tensor read by rows (the embedding, whose fp32 copy is then never whole in
    memory): `src[r0:r1]` dequantizes those rows' blocks only; shape, numel and element_size as
    the fp32 tensor it stands for, so that the loader's embedding transform takes it as a tensor."""

    shape: tuple[int, int]
    rows: Callable[[int, int], Tensor]  # (r0, r1) -> fp32 [r1 - r0, shape[1]]
    source: Callable[[], Tensor] | None = None  # the mapped bytes read, whose pages can be dropped after
    dtype: torch.dtype = torch.float32
    offset: int | None = None  # where the stored rows start in the file (for reads with pread)

    def __getitem__(self, s: slice) -> Tensor:
        r0, r1, _ = s.indices(self.shape[0])
        return self.rows(r0, r1)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def element_size(self) -> int:
        return 4


@dataclass
class GgmlTensors:
    """What a reader found: BlinkDL-named tensors, each read (and dequantized) only when asked.

    tensors: name -> (shape, the dtype it stands for, getter). A quantized tensor stands for
             bf16 (its dequantized values come back in fp32, and are kept 16-bit unless -q).
    q8:      name -> getter of (qweight int8 [N, K], scales fp16 [N, K/32]) for the Q8_0 matrices:
             our int8 layout at group 32, taken as it is when the matrix is to be q8.
    blocks:  name -> getter of the K-quant matrices' blocks (uint8 [N, K/256 * block bytes],
             KQuantLinear's layout): a view of the file's mapping (`file_bytes`), or a copy where
             the reader changes them (a power-of-two rescale of the block scales).
    rows:    name -> RowSource of a quantized embedding (dequantized a few rows at a time).
    types:   name -> the ggml type it is stored in ("F16", "Q4_K", ...).
    """

    path: Path
    kind: str  # "GGUF" or "rwkv.cpp"
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype, Callable[[], Tensor]]] = field(default_factory=dict)
    q8: dict[str, Callable[[], tuple[Tensor, Tensor]]] = field(default_factory=dict)
    blocks: dict[str, Callable[[], Tensor]] = field(default_factory=dict)
    rows: dict[str, RowSource] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    _mapping: Tensor | None = None

    def file_bytes(self, offset: int, n: int) -> Tensor:
        """Bytes [offset, offset + n) of the file, uint8, without a copy: a view of one private
        mapping of the whole file (made on first use), whose pages are read when touched."""
        if self._mapping is None:
            size = self.path.stat().st_size
            self._mapping = torch.from_file(str(self.path), shared=False, size=size, dtype=torch.uint8)
        return self._mapping[offset : offset + n]

    def quantized_types(self) -> list[str]:
        from ..quant.ggml_quants import QUANTIZED

        return sorted({t for t in self.types.values() if t in QUANTIZED})


def sniff(head: bytes) -> str | None:
    """ "gguf", "rwkv.cpp" or None from a file's first 4 bytes."""
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:4] == (0x67676D66).to_bytes(4, "little"):  # rwkv.cpp's 'ggmf' magic, an int32
        return "rwkv.cpp"
    return None
