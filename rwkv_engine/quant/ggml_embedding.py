"""The token embedding of a quantized GGUF, kept as the file's blocks: only looked-up rows are
dequantized.

    emb = GgmlEmbedding.from_blocks("Q4_K", blocks, (vocab, C), ln0_w, ln0_b, torch.float32)
    x = emb(ids)            # ids [...] int64 -> [..., C] in `dtype`: LayerNorm(ln0) of the rows

A checkpoint's embedding is stored with ln0 folded in (loading/transforms.embedding, docs/formats.md
A.7). For a quantized GGUF that table would be the dequantized vocabulary in the model dtype: at the
0.1B shape (65536 x 768) 192 MB of fp32 beside a Q4_K table of 27 MB, and the load's peak memory
(llama.cpp keeps the table as blocks). Here the blocks stay a view of the file's mapping (pages
read when a row is looked up), and a lookup computes, for just those rows, what the folded table
holds: gguf.quants' values of the row (`rows`), then F.layer_norm with ln0, in the model dtype.
The result equals the folded table's row bit for bit (layer_norm works row by row).

Buffers: qweight uint8 [vocab, C / block_size * block_bytes] (the blocks, row n = token n),
ln_weight and ln_bias fp32 [C] (ln0). `file_rows` (memory.FileRows over the same bytes, set by the
loader) reads a lookup's rows with pread, as a model directory's embedding is read: through the
mapping, each fault maps a whole folio of the file, and a prompt's scattered rows would put much of
the table into the process's memory. K-quant rows are decoded by the native decoder where it
loads (kernels/native dequant_kq, gguf.quants' values bit for bit), other types by
quant/ggml_quants.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rwkv_engine.errors import InputError
from rwkv_engine.kernels import native
from rwkv_engine.quant.ggml_quants import BY_NAME, KQUANT, QUANTIZED, TYPES, dequantize

Tensor = torch.Tensor

_CHUNK_ROWS = 4096  # rows per step of `dequantize()`: small temporaries


class GgmlEmbedding(nn.Module):
    """Token embedding rows LayerNorm(ln0)(W[ids]) from W in ggml blocks (see the module docstring)."""

    file_rows = None  # memory.FileRows of qweight's rows in the model file, or None

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str | int, dtype: torch.dtype, device=None):
        super().__init__()
        tid = BY_NAME.get(qtype) if isinstance(qtype, str) else qtype
        if TYPES.get(tid, ("",))[0] not in QUANTIZED:
            raise InputError(f"GgmlEmbedding: a quantized ggml type is needed, got {qtype!r}")
        _, bs, ts = TYPES[tid]
        if embedding_dim % bs:
            raise InputError(
                f"GgmlEmbedding: {TYPES[tid][0]} rows must be a multiple of {bs} wide, got {embedding_dim}"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.type_id, self.qtype, self.dtype = tid, TYPES[tid][0], dtype
        self.register_buffer(
            "qweight", torch.zeros(num_embeddings, embedding_dim // bs * ts, dtype=torch.uint8, device=device)
        )
        self.register_buffer("ln_weight", torch.ones(embedding_dim, device=device))
        self.register_buffer("ln_bias", torch.zeros(embedding_dim, device=device))

    @classmethod
    def from_blocks(
        cls, qtype: str | int, blocks: Tensor, shape: tuple[int, int], ln_weight: Tensor, ln_bias: Tensor, dtype
    ) -> GgmlEmbedding:
        """The embedding of `shape` (vocab, C) stored as `blocks` (not copied), ln0 = (ln_weight, ln_bias)."""
        V, C = (int(n) for n in shape)
        m = cls(V, C, qtype, dtype, device="meta")
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != tuple(m.qweight.shape):
            raise InputError(
                f"GgmlEmbedding: {m.qtype} blocks of a {V} x {C} table must be uint8 {tuple(m.qweight.shape)}, "
                f"got {blocks.dtype} {tuple(blocks.shape)}"
            )
        m.qweight = blocks
        m.ln_weight, m.ln_bias = ln_weight.float(), ln_bias.float()
        return m

    def rows(self, ids: Tensor) -> Tensor:
        """The stored rows of `ids` (1-D int64), dequantized: fp32 [len(ids), C], gguf.quants' values."""
        n, C = ids.numel(), self.embedding_dim
        rows = self.file_rows
        if rows is not None and rows.serves(self.qweight):
            blocks = rows.read(ids.cpu())  # [n, row bytes]
        else:
            blocks = self.qweight.index_select(0, ids.to(self.qweight.device))  # a small copy
        ops = native.load() if self.qtype in KQUANT and blocks.device.type == "cpu" else None
        if ops is not None and n > 0:
            return ops.dequant_kq(blocks, self.type_id, C, 0, n, torch.float32)
        # (quant/ggml_quants.py on the CPU: a few rows, and its shift tables live there)
        return dequantize(blocks.reshape(-1).cpu(), self.type_id, (n, C)).to(blocks.device)

    def forward(self, ids: Tensor) -> Tensor:
        """ids [...] -> [..., C] in the model dtype."""
        x = self.rows(ids.reshape(-1))
        x = F.layer_norm(x, (self.embedding_dim,), self.ln_weight, self.ln_bias).to(self.dtype)
        return x.reshape(*ids.shape, self.embedding_dim)

    def dequantize(self) -> Tensor:
        """The whole folded table [vocab, C] in the model dtype (what an export needs; 4 bytes a value
        in fp32, so never on the inference path)."""
        out = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.dtype)
        for r0 in range(0, self.num_embeddings, _CHUNK_ROWS):
            ids = torch.arange(r0, min(r0 + _CHUNK_ROWS, self.num_embeddings))
            out[r0 : r0 + len(ids)] = self(ids)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}, dtype={self.dtype}"


__all__ = ["GgmlEmbedding"]
