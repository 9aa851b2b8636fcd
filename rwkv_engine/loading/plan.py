"""Plan a load: resolve, open, rename, infer the config, choose the dtype, build the modules on the
meta device; then `load` fills them, one transformed (and quantized) tensor at a time."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..device import cuda_dtype, resolve_device
from ..errors import CheckpointError, InputError
from ..memory import FileRows, release_free_memory, release_pages, spill, to_huge_pages, tune_malloc
from ..models import RWKV
from ..models.layers import lora_dtype
from ..quant.ggml_embedding import GgmlEmbedding
from ..quant.ggml_quants import BY_NAME, KQUANT, QK_K, TYPES, block_scales, scale_blocks
from ..quant.schemes import applied_scheme, convert_weight, describe, get_scheme, plan, replace_module
from . import converted
from .formats import DTYPE_NAMES, Checkpoint, check_finite, open_checkpoint, parse_dtype
from .infer import infer_config
from .names import canonical_name, stored_transposed
from .progress import Progress
from .resolve import resolve
from .transforms import deep_embed_table, embedding, initial_state, source_name, target_name, transform

Tensor = torch.Tensor

# With fp16 weights, halve the residual every this many blocks (docs/formats.md A.7, RESCALE_LAYER).
FP16_RESCALE_EVERY = 6


def _check_names(ck: Checkpoint, cfg: ModelConfig, expected) -> dict[str, str | None]:
    """{canonical name: our parameter name or None}, after checking no tensor is unknown or missing."""
    mapping = {k: target_name(k, cfg.family) for k in ck.keys()}
    unknown = sorted(k for k, t in mapping.items() if t is not None and t not in expected)
    if unknown:
        raise CheckpointError(
            f"{ck.where}: {len(unknown)} unknown tensor(s) for an RWKV-{cfg.version} model: {', '.join(unknown[:5])}"
        )
    odd = [k for k, t in mapping.items() if t is not None and not ck.dtype(k).is_floating_point]
    if odd:  # (int8 / bool / complex: not weights this loader knows; casting them would be silent garbage)
        raise CheckpointError(
            f"{ck.where}: tensor {odd[0]} is {str(ck.dtype(odd[0])).removeprefix('torch.')}; "
            "an RWKV checkpoint's tensors are floating-point"
        )
    have = {t for t in mapping.values() if t is not None}
    missing = sorted(source_name(k) for k in expected if k not in have and k != "emb.weight")
    if "blocks.0.ln0.weight" not in ck or "blocks.0.ln0.bias" not in ck:
        missing.insert(0, "blocks.0.ln0.weight/bias")
    if missing:
        raise CheckpointError(f"{ck.where}: {len(missing)} tensor(s) missing: {', '.join(missing[:5])}")
    return mapping


class Plan:
    """A model about to be loaded, on `device`. For a checkpoint: the model on the meta device with
    its final modules (the linear layers already of the kinds the scheme gives them), and
    `tensors()`, which reads, transforms and quantizes the checkpoint one tensor at a time. For a
    converted directory or an exported program (`built`): the loaded model, and no tensors to read.

    `load` assigns what `tensors()` yields into the model; `converted.convert` writes it to disk
    and keeps nothing. Either way, at most a couple of source tensors are in flight: the peak
    memory is the result (for `load`) plus about twice the largest tensor in fp32.
    """

    def __init__(
        self,
        ck: Checkpoint,
        cfg: ModelConfig,
        dtype: torch.dtype,
        rescale_every: int,
        scheme,
        policy,
        dtype_reason: str,
        device: torch.device,
        path: Path,
    ):
        self.ck, self.cfg, self.dtype, self.rescale_every = ck, cfg, dtype, rescale_every
        self.device = device
        self.built = False
        with torch.device("meta"):
            self.model = RWKV(cfg, dtype, rescale_every)
        self.model.path = path
        self.model.dtype_reason = dtype_reason
        # The biggest tensors first (the embedding and the head): the transients of reading them
        # (their source pages, the folded embedding's rows) then add to a small result, not to
        # nearly the whole model's, which sets the peak of a quantizing load.
        self.mapping = dict(
            sorted(_check_names(ck, cfg, self.model.state_dict()).items(), key=lambda kv: -math.prod(ck.shape(kv[0])))
        )
        # The LoRA matrices keep a 16-bit checkpoint's type: their values exactly, in half the
        # memory of fp32 (770 MB at the 7B shape); the modules upcast them where they are used.
        self.lora = set(self.model.lora_names())
        self.lora_dtype = {t: lora_dtype(ck.dtype(k)) for k, t in self.mapping.items() if t in self.lora}
        self.model.set_lora_dtype(self.lora_dtype)
        self.expected = {k: (tuple(v.shape), v.dtype) for k, v in self.model.state_dict().items()}
        if scheme is None:
            scheme = _dense_scheme(dtype)
        self.targets = plan(self.model, scheme, policy=policy)
        if scheme.weights == "ggml":
            self.targets = self._as_stored(self.targets)
        report = {name: describe(t) for name, t in self.targets.items()}
        # The matrices the policy kept (too small to quantize) become DenseLinear in their own
        # dtype, so every matrix of a decode step runs through the same per-row kernels.
        for name, module in self.model.named_modules():
            if type(module) is nn.Linear and module.bias is None and name not in self.targets:
                self.targets[name] = _dense_scheme(module.weight.dtype)
        for name, target in self.targets.items():
            replace_module(self.model, name, convert_weight(self.model.get_submodule(name).weight, target, empty=True))
        self.model.quantization = applied_scheme(scheme, self.targets, dtype)
        self.model.quantization_report = report
        self.huge_pages = False  # tensors() puts the weights on huge pages (load sets it on the CPU)
        self.embedding_blocks = False  # the embedding is a GgmlEmbedding (embedding_as_blocks)

    def embedding_as_blocks(self) -> bool:
        """Make the model's embedding a GgmlEmbedding over the file's blocks where the checkpoint's
        is a quantized GGUF table and the model is on the CPU; whether it did. For `load` only:
        `convert` writes the folded table, as for any checkpoint."""
        ggml = None if self.built else self.ck.ggml
        src = ggml.rows.get("emb.weight") if ggml is not None and "emb.weight" in self.mapping else None
        if src is None or self.device.type != "cpu":
            return False
        V, C = src.shape
        tid = BY_NAME[ggml.types["emb.weight"]]
        if C % TYPES[tid][1] or self.expected.get("emb.weight", ((),))[0] != (V, C):
            return False
        self.model.emb = GgmlEmbedding(V, C, tid, self.dtype, device="meta")
        self.embedding_blocks = True
        return True

    def _as_stored(self, targets: dict) -> dict:
        """The "gguf" scheme per matrix: its own type in the file. K-quants run from their blocks
        (KQuantLinear), Q8_0 is q8 (the same codes and scales), other types are dense in the type
        they stand for (F32 / F16 / BF16 as they are; Q4_0, Q5_1, ... dequantized to bf16)."""
        ggml = self.ck.ggml
        source = {t: k for k, t in self.mapping.items() if t is not None}
        out = {}
        for name, target in targets.items():
            src = source.get(f"{name}.weight")
            tname = ggml.types.get(src) if target.weights == "ggml" and src is not None else None
            if target.weights != "ggml":
                out[name] = target
            elif tname in KQUANT and src in ggml.blocks:
                out[name] = replace(target, weights="kquant", qtype=tname)
            elif tname == "Q8_0" and src in ggml.q8:
                out[name] = get_scheme("q8")  # group 32
            else:
                out[name] = _dense_scheme(self.ck.dtype(src) if src is not None else self.dtype)
        return out

    @classmethod
    def of_built(cls, model) -> Plan:
        """The plan of a model that is loaded already (a converted directory, an exported program)."""
        plan = cls.__new__(cls)
        plan.model, plan.device, plan.built = model, model.device, True
        plan.ck, plan.mapping, plan.huge_pages = None, {}, False
        return plan

    def initial_state(self) -> dict[str, Tensor]:
        return self.model.initial_state if self.built else initial_state(self.ck, self.cfg)

    def source_bytes(self) -> int:
        ck = self.ck
        return sum(math.prod(ck.shape(k)) * _itemsize(ck, k) for k, t in self.mapping.items() if t is not None)

    def tensors(self, progress: Progress | None = None):
        """Yield {our state-dict name: tensor} for one source tensor at a time (a quantized
        linear's weight gives its module's buffers); nothing for a built model."""
        if self.built:
            return
        ck, cfg, dtype = self.ck, self.cfg, self.dtype
        real_bonus = any(k.endswith(".time_faaaa") for k in ck.keys())
        for name, target in self.mapping.items():
            if target is None:
                continue
            module, _, leaf = target.rpartition(".")
            linear = self.targets.get(module) if leaf == "weight" else None
            blocks = ck.ggml.blocks.get(name) if ck.ggml is not None and linear is not None else None
            if blocks is not None and linear.weights == "kquant" and ck.ggml.types[name] == linear.qtype:
                out = self._blocks_as_is(name, module, blocks)  # K-quants run from their blocks
                release_free_memory()  # (the embedding's transients, when it came just before)
                yield out
                if progress is not None:
                    progress.update(out[f"{module}.qweight"].numel())
                continue
            q8 = ck.ggml.q8.get(name) if ck.ggml is not None and linear is not None else None
            if q8 is not None and linear.weights == "int8" and linear.group_size == 32:
                out = self._q8_as_is(name, module, q8)  # ggml's Q8_0 is our int8 at group 32
                yield out
                if progress is not None:
                    progress.update(sum(v.numel() * v.element_size() for v in out.values()))
                continue
            # a quantized GGUF embedding is read a few rows at a time (no whole fp32 copy)
            lazy = ck.ggml.rows.get(name) if ck.ggml is not None and name == "emb.weight" else None
            if lazy is not None and self.embedding_blocks:
                yield self._embedding_blocks(lazy)  # kept as blocks: not even a folded table
                if progress is not None:
                    progress.update(lazy.numel() * lazy.element_size())
                continue
            src = lazy if lazy is not None else ck.get(name)
            nbytes = src.numel() * src.element_size()
            dt = dtype
            if linear is not None and linear.weights != "dense" and src.dtype.itemsize < dtype.itemsize:
                dt = src.dtype  # quantized from the narrower type: the same values, no wide copy
            if name == "emb.weight":
                t = embedding(src, ck.get("blocks.0.ln0.weight"), ck.get("blocks.0.ln0.bias"), dtype)
                if lazy is not None:  # (read by rows, not by `get`: a NaN row makes its LayerNorm NaN)
                    check_finite(t, f"{ck.where}: tensor {name}")
            elif name.endswith(".ffn.s_emb.weight"):
                t = deep_embed_table(src, ck, name.replace(".s_emb.", ".s_emb_x."), dtype)
            elif target in self.lora:
                t = src.to(self.lora_dtype[target])
            else:
                t = transform(name, src, cfg, dt, self.rescale_every, real_bonus)
            want = self.expected[target][0]
            if tuple(t.shape) != want:
                raise CheckpointError(
                    f"{ck.where}: tensor {name} has shape {tuple(ck.shape(name))}, expected {want} for this model"
                )
            if linear is not None:
                new = convert_weight(t, linear)
                out = {f"{module}.{k}": v for k, v in new.state_dict().items()}
            else:
                out = {target: t}
            if self.huge_pages:  # the weights a decode step streams (memory.to_huge_pages)
                out = {k: v if k == "emb.weight" else to_huge_pages(v) for k, v in out.items()}
            if name in ck.mapped and all(
                v.untyped_storage().data_ptr() != src.untyped_storage().data_ptr() for v in out.values()
            ):
                release_pages(src)  # consumed: its file pages need not stay resident
            elif lazy is not None and lazy.source is not None:
                release_pages(lazy.source())
            del src, t
            release_free_memory()  # the transients' pages, before the next tensor's
            yield out
            if progress is not None:
                progress.update(nbytes)

    def _blocks_as_is(self, name: str, module: str, blocks) -> dict[str, Tensor]:
        """A K-quant matrix's blocks as KQuantLinear's buffer, no dequantization: the file's mapped
        bytes, copied to huge pages where the weights go there (as a converted directory's); the
        fp16 rescale, a power of two, scales the block scales (exactly, or an InputError)."""
        b = blocks()
        tid = BY_NAME[self.ck.ggml.types[name]]
        check_finite(block_scales(b, tid), f"{self.ck.where}: tensor {name}")  # (`get` is not called)
        N, K = self.expected[f"{module}.weight"][0]
        want = (N, K // QK_K * TYPES[tid][2])
        if tuple(b.shape) != want:
            raise CheckpointError(
                f"{self.ck.where}: tensor {name} has {tuple(b.shape)} bytes of blocks, expected {want} for this model"
            )
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else 0
        if self.rescale_every and name.endswith((".att.output.weight", ".ffn.value.weight")):
            b = scale_blocks(b, tid, 2.0 ** -(layer // self.rescale_every), f"{self.ck.where}: {name}")
        if self.huge_pages and (moved := to_huge_pages(b, mapped=True)) is not b:
            release_pages(b)  # the file's pages of it, now copied
            b = moved
        return {f"{module}.qweight": b, f"{module}.col_scales": torch.ones(K, dtype=torch.float16)}

    def embedding_rows(self, blocks: Tensor) -> FileRows | None:
        """The GgmlEmbedding's rows of blocks read from the file with pread (memory.FileRows: a
        lookup through the mapping would fault in whole folios of the table), or None."""
        src = self.ck.ggml.rows["emb.weight"]
        if not FileRows.available() or src.offset is None:
            return None
        return FileRows(self.ck.ggml.path, src.offset, tuple(blocks.shape), torch.uint8, blocks)

    def _embedding_blocks(self, lazy) -> dict[str, Tensor]:
        """A quantized GGUF embedding as GgmlEmbedding's buffers: the file's blocks (a view of its
        mapping, not copied) and ln0, which a lookup applies to the rows it dequantizes."""
        ck = self.ck
        blocks = lazy.source().view(lazy.shape[0], -1)
        check_finite(block_scales(blocks, BY_NAME[ck.ggml.types["emb.weight"]]), f"{ck.where}: tensor emb.weight")
        release_pages(blocks)  # the check read every page; a lookup reads its rows again
        ln = [ck.get(f"blocks.0.ln0.{leaf}").float() for leaf in ("weight", "bias")]
        return {"emb.qweight": blocks, "emb.ln_weight": ln[0], "emb.ln_bias": ln[1]}

    def _q8_as_is(self, name: str, module: str, q8) -> dict[str, Tensor]:
        """A Q8_0 matrix's codes and scales as the module's buffers, no re-quantization (the fp16
        rescale, a power of two, divides the scales exactly)."""
        qweight, scales = q8()
        check_finite(scales, f"{self.ck.where}: tensor {name}")  # (the codes are integers; `get` is not called)
        want = self.expected[f"{module}.weight"][0]
        if tuple(qweight.shape) != want:
            raise CheckpointError(
                f"{self.ck.where}: tensor {name} has shape {tuple(qweight.shape)}, expected {want} for this model"
            )
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else 0
        if self.rescale_every and name.endswith((".att.output.weight", ".ffn.value.weight")):
            scales = scales / 2 ** (layer // self.rescale_every)
        ones = torch.ones(qweight.shape[1], dtype=torch.float16)
        return {
            f"{module}.qweight": qweight,
            f"{module}.scales": scales.to(torch.float16),
            f"{module}.col_scales": ones,
        }


def _dense_scheme(dtype: torch.dtype):
    return get_scheme(_DENSE_SCHEME[dtype])


def _itemsize(ck: Checkpoint, name: str) -> int:
    return ck.dtype(name).itemsize


_DENSE_SCHEME = {torch.float32: "q0f32", torch.bfloat16: "q0bf16", torch.float16: "q0f16"}


def load(
    path_or_id: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = "auto",
    *,
    quantization: str | None = None,
    group_size: int | None = None,
    policy=None,
    rescale_every: int | None = None,
    progress: bool = True,
) -> RWKV:
    """Load an RWKV model from a checkpoint file, a model directory or a Hugging Face Hub id.

    device: "cpu" (default), "cuda", "cuda:N" or "auto" (CUDA when torch sees a GPU); a CUDA
    device that is not there is an InputError.
    dtype: "auto" (default; None means the same), "fp32", "bf16" or "fp16": the model dtype, in
    which the matrices are stored (unless quantized) and the activations enter them; the state,
    the recurrence and the norms are fp32. "auto" keeps a 16-bit checkpoint's type (fp32 stays
    fp32; on CUDA always bf16, or fp16 on GPUs without bf16); quantized, the activations take the
    checkpoint's 16-bit type where the device computes in it fast and fp32 elsewhere (`auto_dtype`); a quantization name that implies a dtype
    (e.g. "q4f16_1" -> fp16) gives that one. `model.dtype_reason` says which rule chose it.
    quantization: a scheme of rwkv_engine.quant ("q8", "q4", "q0bf16", MLC names like
    "q4f16_1"); the weights are quantized while they are read, one tensor at a time. group_size
    and policy go to `rwkv_engine.quant.quantize_model`.
    rescale_every: halve the residual every this many blocks (default: 6 for fp16, off otherwise).
    progress: for a model of 256 MB or more, a progress bar on stderr when it is a terminal, else
    one summary line there.
    """
    tune_malloc()
    plan_ = prepare(
        path_or_id,
        device,
        dtype,
        quantization=quantization,
        group_size=group_size,
        policy=policy,
        rescale_every=rescale_every,
    )
    if plan_.built:  # a converted directory or an exported program: loaded as it is
        return plan_.model
    return assemble(plan_, progress)


def assemble(plan_: Plan, progress: bool = True) -> RWKV:
    """The model of a checkpoint's Plan, its tensors read, transformed and assigned one at a time."""
    device = plan_.device
    plan_.huge_pages = device.type == "cpu"  # each tensor as it comes: no second copy of the model
    plan_.embedding_as_blocks()  # a quantized GGUF's table stays its blocks (on the CPU)
    model = plan_.model
    bar = Progress("loading", plan_.source_bytes(), len(plan_.mapping), progress)
    sd: dict[str, Tensor] = {}
    rows = None
    table_rows: dict[str, object] = {}
    ok = False
    try:
        for tensors in plan_.tensors(bar):
            if "emb.weight" in tensors and device.type == "cpu":  # its rows read from a file, as a directory's
                tensors["emb.weight"], rows = spill(tensors["emb.weight"])
            for k in [k for k in tensors if k.endswith(".ffn.s_emb.weight") and device.type == "cpu"]:
                tensors[k], table_rows[k[: -len(".weight")]] = spill(tensors[k])  # RWKV-7a: the same
            sd.update(tensors)
        ok = True
    finally:
        bar.close(ok)
    model.load_state_dict(sd, strict=True, assign=True)
    if rows is not None:
        model.emb.file_rows = rows
    if plan_.embedding_blocks:
        model.emb.file_rows = plan_.embedding_rows(model.emb.qweight)
    for module, r in table_rows.items():
        model.get_submodule(module).file_rows = r
    model.initial_state = plan_.initial_state()
    del sd, plan_
    return _finish(model, model.path, device)


def prepare(
    path_or_id: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = "auto",
    *,
    quantization: str | None = None,
    group_size: int | None = None,
    policy=None,
    rescale_every: int | None = None,
) -> Plan:
    """The Plan of loading a checkpoint, a converted directory or an exported program (see `load`)."""
    scheme = None
    if quantization is not None:
        scheme = get_scheme(quantization, group_size)
    elif group_size is not None:
        raise InputError("group_size is only meaningful with a quantization scheme")
    auto = dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto")
    explicit = None if auto else parse_dtype(dtype)
    auto_device = device is None or (isinstance(device, str) and device.strip().lower() == "auto")
    device = resolve_device(device)
    path = resolve(path_or_id)
    if _is_exported_program(path):  # an ExecuTorch .pte: its own runtime, nothing to convert
        device = torch.device("cpu") if auto_device else device
        return Plan.of_built(_load_program(path, device, dtype, quantization, group_size, policy))
    hf_config = _peek_config(path)
    if converted.is_converted(hf_config):  # already transformed and quantized: map it in
        model = converted.load(path, hf_config, explicit, quantization)
        model.dtype_reason = "explicit" if explicit is not None else "the converted directory's"
        return Plan.of_built(_finish(model, path, device))
    ck = open_checkpoint(path)
    _note_unsupported_parts(ck)
    return plan_checkpoint(ck, path, device, explicit, dtype, quantization, scheme, group_size, policy, rescale_every)


def _note_unsupported_parts(ck: Checkpoint) -> None:
    if any(k.startswith(("vit.", "proj.")) for k in ck.keys()):
        print(
            f"note: {ck.where}: the image tower of this vision EmbeddingRWKV (vit.*, proj.*) is not loaded; "
            "the model embeds text",
            file=sys.stderr,
            flush=True,
        )


def plan_checkpoint(
    ck: Checkpoint,
    path: Path,
    device: torch.device,
    explicit: torch.dtype | None,
    dtype=None,
    quantization: str | None = None,
    scheme=None,
    group_size: int | None = None,
    policy=None,
    rescale_every: int | None = None,
) -> Plan:
    """The Plan of an opened checkpoint (BlinkDL, Hugging Face or fla names): its names made
    canonical, its config inferred, its dtype chosen (`explicit`, else implied by the scheme,
    else `auto_dtype`); `dtype` is the caller's spelling of it, for messages."""
    ck.rename(canonical_name, transposed=stored_transposed)
    cfg = infer_config(ck)
    if ck.ggml is not None:
        quantization, scheme = _ggml_scheme(ck, quantization, scheme, group_size)
    elif scheme is not None and scheme.weights == "ggml":
        raise InputError(f"{path}: -q {scheme.name} keeps a GGUF file's own tensor types; this is not a GGUF file")
    implied = scheme.dtype if scheme is not None else None
    if explicit is not None:
        if implied is not None and implied != explicit:
            raise InputError(
                f"quantization {quantization!r} implies dtype {str(implied).removeprefix('torch.')}, but dtype {dtype!r} was asked for"
            )
        dt, reason = explicit, "explicit"
    elif implied is not None:
        dt, reason = implied, f"implied by {quantization}"
    else:
        dt, reason = auto_dtype(ck.weights_dtype(), device, quantized=scheme is not None and scheme.weights != "dense")
    if scheme is not None and scheme.weights == "dense" and scheme.dtype is None:
        scheme = None
    if rescale_every is None:
        rescale_every = FP16_RESCALE_EVERY if dt == torch.float16 else 0
    return Plan(ck, cfg, dt, rescale_every, scheme, policy, reason, device, path)


def _ggml_scheme(ck: Checkpoint, quantization, scheme, group_size):
    """(quantization, scheme) for a GGUF / rwkv.cpp file, and a note on stderr saying what
    becomes of its quantized tensors. By default K-quant matrices run as they are stored
    (the "gguf" scheme; Q8_0 matrices as q8 with them) and a file of Q8_0 matrices loads as q8
    (the same codes and scales); other ggml types are dequantized once, then kept 16-bit or,
    with -q, re-quantized."""
    kinds = ck.ggml.quantized_types()
    if not kinds:
        return quantization, scheme
    ks = [k for k in kinds if k in KQUANT]
    if scheme is None and ks:
        quantization, scheme = "gguf", get_scheme("gguf", group_size)
    elif scheme is None and kinds == ["Q8_0"]:
        quantization, scheme = "q8", get_scheme("q8", group_size)
    if scheme is None or scheme.weights == "dense":
        what = f"{', '.join(kinds)} tensors dequantized once and kept 16-bit (-q q8 or -q q4 re-quantizes them)"
    elif scheme.weights == "ggml":
        parts = [f"{', '.join(ks)} matrices run as they are stored (K-quant blocks)"] if ks else []
        if "Q8_0" in kinds:
            parts.append("Q8_0 matrices as q8 (the same codes and scales)")
        others = [k for k in kinds if k not in KQUANT and k != "Q8_0"]
        if others:
            parts.append(f"{', '.join(others)} tensors dequantized once and kept 16-bit")
        what = "; ".join(parts)
    else:
        others = [k for k in kinds if k != "Q8_0"]
        parts = []
        if "Q8_0" in kinds and scheme.weights == "int8" and scheme.group_size == 32:
            parts.append("Q8_0 matrices taken as they are where they become q8 (the same codes and scales)")
        else:
            others = kinds
        if others:
            parts.append(f"{', '.join(others)} tensors dequantized once, then re-quantized to {scheme.name}")
        what = "; ".join(parts)
    print(f"note: {ck.where}: {what}", file=sys.stderr, flush=True)
    return quantization, scheme


def auto_dtype(weights: torch.dtype, device: torch.device, quantized: bool) -> tuple[torch.dtype, str]:
    """(model dtype, why) for `dtype="auto"`, given the dtype of the checkpoint's matrices.

    Dense: the checkpoint's own type (a 16-bit file stays 16-bit in memory; fp32 stays fp32);
    each GEMM then runs in `compute_dtype` of it (bf16 with AVX512-BF16 / AMX and on CUDA, fp32
    tiles on CPUs where bf16 matmuls are slow). Quantized: the weights no longer need the type,
    so the activations take `compute_dtype` of it directly.
    """
    from ..quant.linear import compute_dtype

    name = DTYPE_NAMES.get(weights, "fp32")
    if device.type == "cuda":  # tensor cores: 16-bit whatever the file holds (fp32 on CUDA is for parity)
        dt = cuda_dtype(device)
        return dt, f"auto: {name} checkpoint, {DTYPE_NAMES[dt]} on cuda"
    if weights not in (torch.bfloat16, torch.float16):
        return torch.float32, f"auto: {name} checkpoint"
    if not quantized:
        return weights, f"auto: {name} checkpoint"
    ct = compute_dtype(weights, device)
    return ct, f"auto: {name} checkpoint, {DTYPE_NAMES[ct]} matmuls on {device.type}"


def _is_exported_program(path: Path) -> bool:
    from ..export.runtime import is_program

    return is_program(path)


def _load_program(path: Path, device, dtype, quantization, group_size, policy):
    """An exported program (rwkv_engine/export): its weights and quantization are fixed at export."""
    if str(device) != "cpu":
        raise InputError(f"{path} is an exported ExecuTorch program: it runs on the CPU (device cpu), not {device}")
    fixed = dtype not in (None, "auto", "fp32", torch.float32)
    if fixed or any(x is not None for x in (quantization, group_size, policy)):
        raise InputError(
            f"{path} is an exported ExecuTorch program: its dtype and quantization were fixed "
            f"when it was exported (drop --dtype / --quantization)"
        )
    from ..export.runtime import ProgramModel

    return ProgramModel(path)


def _finish(model: RWKV, path: Path, device: torch.device) -> RWKV:
    model.requires_grad_(False)
    model.eval()
    model.path = path
    model = model.to(device)
    if device.type == "cuda":  # the quantized linears' layout, read as it is by the GPU kernels
        from ..quant.cuda import convert_for_cuda

        convert_for_cuda(model)
    return model


def _peek_config(path: Path) -> dict | None:
    """config.json of a model directory, if it has a readable one (open_checkpoint reports errors)."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return None
