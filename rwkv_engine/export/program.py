"""Build an ExecuTorch program (.pte) from a loaded model: the exported methods, quantization, metadata.

The program holds these methods (one copy of the weights, shared by all of them):

    decode(tokens int64 [1, 1], *state) -> (logits fp32 [1, V], *new_state)
    prefill(tokens int64 [1, T], *state) -> (logits fp32 [1, V] of the last token, *new_state)
    initial_state() -> state                 the state a sequence starts from (learned for a
                                             state-tuned model, else zeros, -1e30 for RWKV-4's att_max)
    rwkv_metadata() -> str                   JSON: the layout above, the model config, the
                                             quantization and the tokenizer's identity

`state` is the model's `State` fields in their order, batch 1, fp32 (METADATA["state"] names
them with their shapes): RWKV-5/6/7 att_x_prev [1, L, C], att_kv [1, L, H, N, N], ffn_x_prev
[1, L, C]; RWKV-4 att_x_prev, att_num, att_den, att_max, ffn_x_prev. An app keeps them as plain
tensors: saving, restoring or forking a conversation is copying them.

The methods run the model's own block loop (`RWKV.run_blocks`) on a copy of its module tree with
the modules ExecuTorch cannot take swapped out: the CPU GEMV linears and the file-reading
embedding for plain nn.Linear / nn.Embedding, nn.LayerNorm for `mean_norm` (means over the last
two axes of a 4-D view, which XNNPACK delegates). The WKV kernels and the head GroupNorm pick
their export forms themselves while torch.export traces (kernels/wkv5.py `wkv5_export`,
kernels/wkv7.py `wkv7_export`, models/layers.py `mean_norm`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from ..models.layers import mean_norm
from ..quant.ggml_embedding import GgmlEmbedding
from ..quant.linear import _QuantLinearBase
from ..quant.schemes import SCHEMES, _user_action, default_action, replace_module

Tensor = torch.Tensor

FORMAT = "rwkv-engine-pte/1"
QUANTIZATIONS = ("fp32", "q8", "q4")
BACKENDS = ("xnnpack", "portable")
DEFAULT_PREFILL_LEN = 32
# 4-bit weights: columns per scale (XNNPACK's blockwise int4 kernels take multiples of 32).
Q4_GROUP = 32
METADATA_METHOD = "rwkv_metadata"


class _LayerNorm(nn.Module):
    """nn.LayerNorm written with `mean_norm` (the same weight and bias tensors)."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__()
        self.weight, self.bias, self.eps = ln.weight, ln.bias, ln.eps

    def forward(self, x: Tensor) -> Tensor:
        return mean_norm(x, 1, self.weight, self.bias, self.eps)


class Int8Embedding(nn.Module):
    """An embedding stored as int8 rows with one fp32 scale per row (symmetric), looked up with
    plain ops (embedding, cast, multiply) that every ExecuTorch runtime has. (torchao's quantized
    embedding lowers to `quantized_decomposed::embedding_byte`, which needs ExecuTorch's
    quantized-kernel library: not in its Python runtime, nor in a plain app build.)"""

    def __init__(self, weight: Tensor):
        super().__init__()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        self.register_buffer("qweight", torch.round(weight / scale).to(torch.int8))
        self.register_buffer("scale", scale.float())

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.qweight).float() * F.embedding(ids, self.scale)


class StepProgram(nn.Module):
    """forward(tokens [1, T], *state) -> (logits [1, V], *new_state): the exported decode / prefill."""

    def __init__(self, model, fields: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.fields = fields

    def forward(self, tokens: Tensor, *state: Tensor):
        m = self.model
        L = m.config.n_layer
        layers = [{k: v[:, i] for k, v in zip(self.fields, state)} for i in range(L)]
        new: dict[str, list[Tensor]] = {k: [] for k in self.fields}

        def keep(i: int, fields: dict[str, Tensor]) -> None:
            for k, v in fields.items():
                new[k].append(v)

        x = m.run_blocks(m.emb(tokens), layers, keep)
        return (m._logits(x[:, -1]), *(torch.stack(new[k], dim=1) for k in self.fields))


class InitialState(nn.Module):
    """forward() -> the state a sequence starts from (batch 1)."""

    def __init__(self, state):
        super().__init__()
        self.fields = state.fields
        for k, v in state.items():
            self.register_buffer(k, v.clone())

    def forward(self):
        return tuple(getattr(self, k).clone() for k in self.fields)


def exportable_copy(model) -> nn.Module:
    """A copy of the model's module tree (sharing its tensors) that torch.export and ExecuTorch take."""
    scheme = model.quantization
    quantized = scheme is not None and scheme.weights != "dense"
    if model.dtype != torch.float32 or quantized or any(isinstance(m, _QuantLinearBase) for m in model.modules()):
        raise InputError(
            "export needs the model loaded in fp32 without --quantization (it quantizes itself with "
            "--quantization q8 / q4)"
        )
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}  # the tensors are shared
    for native in (model._native_step, getattr(model.emb, "file_rows", None)):  # native handles: not copied
        memo[id(native)] = None
    m = copy.deepcopy(model, memo=memo)
    m.native_decode = False
    m._native_step = None
    m.layer_observer = None
    table = model.emb.dequantize() if isinstance(model.emb, GgmlEmbedding) else model.emb.weight  # (a GGUF's blocks)
    m.emb = nn.Embedding.from_pretrained(table, freeze=True)
    m.set_lora_dtype(torch.float32)  # 16-bit LoRA matrices (a bf16 checkpoint's): fp32 copies in the program
    for name, module in list(m.named_modules()):
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            plain = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
            plain.weight = module.weight
            replace_module(m, name, plain)
        elif isinstance(module, nn.LayerNorm):
            replace_module(m, name, _LayerNorm(module))
    return m.eval()


def quantize_for_export(m: nn.Module, quantization: str, policy=None) -> dict[str, str]:
    """Quantize the copy's linears and embedding in place with torchao, by the engine's policy.

    q8: every linear int8 (one scale per row) with int8 dynamic activations, block 0 kept fp32
    (the engine keeps it 16-bit). q4: int4 weights (group 32) with int8 dynamic activations,
    blocks 0-1 and the head int8 (quant/schemes.py `default_action`). Matrices under
    MIN_QUANT_WEIGHTS stay fp32. The embedding is `Int8Embedding` in both.
    `policy` is quant.quantize_model's: {glob on the module name: "q8" | "q4" | "keep"} or a
    callable, asked first. Returns {module name: what it became}.
    """
    if quantization == "fp32":
        return {}
    from torchao.quantization import quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig

    configs = {
        "q8": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
        "q4": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(Q4_GROUP)),
    }
    scheme = SCHEMES[quantization]
    report: dict[str, str] = {}
    for name, module in m.named_modules():
        if type(module) is nn.Linear:
            action = _user_action(policy, name, module) or default_action(name, module, scheme)
            if action == "q4" and module.in_features % Q4_GROUP:
                action = "q8"
            report[name] = action if action in configs else "fp32"
    for action, config in configs.items():
        names = {n for n, a in report.items() if a == action}
        if names:
            quantize_(m, config, filter_fn=lambda mod, fqn: fqn in names)
    m.emb = Int8Embedding(m.emb.weight)
    report["emb"] = "q8"
    return report


def tokenizer_identity(model, tokenizer=None) -> dict:
    """{"kind", "file", "sha256", "vocab_size"} of the model's tokenizer (what an app must load)."""
    from ..tokenizer import load_tokenizer

    try:
        tok = tokenizer if tokenizer is not None else load_tokenizer(model)
    except Exception as e:  # no known tokenizer: the program still runs on token ids
        return {"kind": "unknown", "note": str(e)}
    path = Path(getattr(tok, "vocab_path", None) or tok.path)
    kind = "world" if hasattr(tok, "vocab_path") else "huggingface"
    return {
        "kind": kind,
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "vocab_size": getattr(tok, "vocab_size", None),
    }


@dataclass
class ExportReport:
    path: Path
    bytes: int
    seconds: float
    metadata: dict


def metadata(
    model, fields_shapes: dict, quantization: str, quant_report: dict, prefill_len: int, backend: str, tokenizer: dict
) -> dict:
    return {
        "format": FORMAT,
        "config": asdict(model.config),
        "state_signature": model.config.state_signature(),
        "methods": {
            "decode": {"tokens": [1, 1]},
            "prefill": {"tokens": [1, prefill_len]},
            "initial_state": {},
        },
        "inputs": ["tokens", *fields_shapes],
        "outputs": ["logits", *fields_shapes],
        "state": [{"name": k, "shape": list(s), "dtype": "float32"} for k, s in fields_shapes.items()],
        "logits": {"shape": [1, model.config.vocab_size], "dtype": "float32", "position": "last token"},
        "quantization": quantization,
        "quantized_modules": quant_report,
        "backend": backend,
        "tokenizer": tokenizer,
    }


def export_program(
    model,
    path: str | Path,
    quantization: str = "fp32",
    prefill_len: int = DEFAULT_PREFILL_LEN,
    backend: str = "xnnpack",
    tokenizer=None,
    policy=None,
) -> ExportReport:
    """Export `model` (loaded in fp32) to an ExecuTorch program at `path`; see the module docstring."""
    model.require_lm_head()  # (its methods return logits)
    if quantization not in QUANTIZATIONS:
        raise InputError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if isinstance(prefill_len, bool) or not isinstance(prefill_len, int) or prefill_len < 2:
        raise InputError(f"prefill_len must be an integer of at least 2, got {prefill_len!r}")
    try:
        from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    except ImportError:
        raise InputError('export needs ExecuTorch: pip install -e ".[export]" (executorch, torchao)') from None

    t0 = time.perf_counter()
    start = model.new_state(1)
    fields = start.fields
    m = exportable_copy(model)
    quant_report = quantize_for_export(m, quantization, policy)
    step = StepProgram(m, fields).eval()
    state = tuple(t.contiguous() for _, t in start.items())
    with torch.no_grad():
        programs = {
            "decode": torch.export.export(step, (torch.zeros(1, 1, dtype=torch.long), *state)),
            "prefill": torch.export.export(step, (torch.zeros(1, prefill_len, dtype=torch.long), *state)),
            "initial_state": torch.export.export(InitialState(start), ()),
        }
    partitioners = None
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioners = [XnnpackPartitioner()]
    meta = metadata(
        model,
        {k: tuple(t.shape) for k, t in start.items()},
        quantization,
        quant_report,
        prefill_len,
        backend,
        tokenizer_identity(model, tokenizer),
    )
    edge = to_edge_transform_and_lower(
        programs,
        partitioner=partitioners,
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods={METADATA_METHOD: json.dumps(meta)},
    )
    program = edge.to_executorch(
        ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True, extract_delegate_segments=True)
    )
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        program.write_to_file(f)
    tmp.replace(path)
    return ExportReport(path, path.stat().st_size, time.perf_counter() - t0, meta)
