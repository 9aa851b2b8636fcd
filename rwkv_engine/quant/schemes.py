"""Quantization schemes and `quantize_model`, which swaps the `nn.Linear` modules of any model.

    from rwkv_engine.quant import quantize_model, get_scheme
    report = quantize_model(model, "q4")                # in place; {module name: what it became}
    report = quantize_model(model, "q4f16_1")           # MLC-LLM name for the same weights
    report = quantize_model(model, "q4", group_size=64, policy={"blocks.0.*": "keep"})

Schemes (weights only; activations stay in the model dtype):

    name     weights                                       model dtype
    q0f32    unquantized fp32                              fp32
    q0bf16   unquantized bf16                              bf16
    q0f16    unquantized fp16                              fp16
    q8       int8, fp16 scale per 32 columns (default; group_size=-1: one scale per row)    unchanged
    q4       int4, fp16 scale + bias per 32 columns (group_size 32 / 64 / 128)             unchanged
    gguf     a GGUF file's matrices in their own types: K-quants (Q4_K, Q5_K, Q6_K) run from
             their blocks (KQuantLinear), Q8_0 as q8, others dequantized once to 16 bits;
             the default for GGUF files with K-quants                                    unchanged
    q4k      ggml K-quant blocks of our own error search (kquantize.py), fp16 column scales:
             Q4_K, the head in Q5_K and the leading blocks in Q6_K / Q5_K (kquant_actions);
             at most the bytes of llama.cpp's Q4_K_M                                     unchanged
    q6k      the same, Q6_K throughout                                                   unchanged

MLC-LLM names (`qAfB_id`: A weight bits, B activation dtype) map onto these by their weight bits
and group size; `Scheme.dtype` carries the B part for the loader:

    q0f32                       -> q0f32
    q0f16 / q0bf16              -> q0f16 / q0bf16
    q4f16_0, q4f16_1, q4f16_2   -> q4, group 32, dtype fp16
    q4bf16_0, q4bf16_1          -> q4, group 32, dtype bf16
    q4f32_0, q4f32_1            -> q4, group 32, dtype fp32
    q8f16_0, q8f16_1            -> q8, group 32, dtype fp16    (q8bf16_*, q8f32_* likewise)

MLC's `_0` / `_1` differ only in its storage layout and `_2` in leaving the embedding and the
final projection unquantized; our default policy keeps the head (and blocks 0-1) of a q4 model at
8 bits. MLC's int4 is symmetric; ours has a zero point (lower error on heavy-tailed weights). The
names only select a scheme: MLC weight files are not read.

Policy: which matrices get what. `quantize_model` considers every `nn.Linear` without a bias and
asks, in this order:

1. the user `policy`: a dict {glob pattern on the module name: action} (first matching pattern
   wins) or a callable (name, module) -> action or None (None: fall through);
2. the default policy of the scheme:
   * `head` in a q4 scheme -> "q8": int4 on the output projection costs the most accuracy for
     the least speed;
   * the first Q4_Q8_BLOCKS (2) blocks in a q4 scheme -> "q8": an int4 error made early grows
     through every later block, and no single matrix of a block dominates, so bits by position
     beat bits by matrix;
   * the first block in a q8 scheme -> 16-bit (bf16; fp16 in an fp16 model), for the same reason;
   * matrices of fewer than MIN_QUANT_WEIGHTS (65536) weights -> "keep": their GEMV costs a
     fixed few microseconds whatever the format, and low-rank projections are the most
     sensitive to rounding;
   * everything else -> the scheme.

The measurements behind these choices are in docs/quantization.md.

Actions: a scheme name or alias ("q4", "q8", "q0bf16", ...; group size from the call) or "keep"
(leave the module as it is).
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Union

import torch
from torch import nn

from rwkv_engine.errors import InputError
from rwkv_engine.quant import kquantize as KQ
from rwkv_engine.quant import primitives as P
from rwkv_engine.quant.kquant_linear import KQuantLinear
from rwkv_engine.quant.linear import DenseLinear, Int4Linear, Int8Linear, weight_bytes

# Linear layers with fewer weights than this stay as they are under the default policy.
MIN_QUANT_WEIGHTS = 1 << 16
# The first blocks of a q4 model that the default policy keeps at 8 bits (blocks.0 .. blocks.{n-1}).
Q4_Q8_BLOCKS = 2

INT8_DEFAULT_GROUP = 32
INT4_DEFAULT_GROUP = 32
PER_CHANNEL = -1  # group_size value for one int8 scale per output row


@dataclass(frozen=True)
class Scheme:
    """A weight format. `weights`: "dense", "int8", "int4", "kquant" (ggml K-quant blocks of type
    `qtype`, KQuantLinear) or "ggml" (a GGUF's own types, resolved per matrix by the loader);
    `dtype`: the model dtype it implies (None: keep the model's); `group_size`: columns per scale
    (int8: None means per row)."""

    name: str
    weights: str
    group_size: int | None = None
    dtype: torch.dtype | None = None
    search: bool = True  # int4: per-group range search (see primitives.quantize_int4)
    qtype: str | None = None  # kquant: "Q4_K", "Q5_K" or "Q6_K"

    def to_dict(self) -> dict:
        """JSON-friendly description (for a converted model's config)."""
        return {
            "name": self.name,
            "weights": self.weights,
            "group_size": self.group_size,
            "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
        } | ({"qtype": self.qtype} if self.qtype else {})


SCHEMES: dict[str, Scheme] = {
    "q0f32": Scheme("q0f32", "dense", dtype=torch.float32),
    "q0bf16": Scheme("q0bf16", "dense", dtype=torch.bfloat16),
    "q0f16": Scheme("q0f16", "dense", dtype=torch.float16),
    "q8": Scheme("q8", "int8", group_size=INT8_DEFAULT_GROUP),
    "q4": Scheme("q4", "int4", group_size=INT4_DEFAULT_GROUP),
    "gguf": Scheme("gguf", "ggml"),
    "q4k": Scheme("q4k", "kquant", qtype="Q4_K"),
    "q6k": Scheme("q6k", "kquant", qtype="Q6_K"),
}

_DT = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
ALIASES: dict[str, tuple[str, torch.dtype]] = {}
for _bits, _base in (("4", "q4"), ("8", "q8")):
    for _tag, _dt in _DT.items():
        for _id in ("0", "1") + (("2",) if _bits == "4" and _tag == "f16" else ()):
            ALIASES[f"q{_bits}{_tag}_{_id}"] = (_base, _dt)


def scheme_names() -> list[str]:
    return sorted(SCHEMES) + sorted(ALIASES)


def get_scheme(name: str | Scheme, group_size: int | None = None) -> Scheme:
    """The Scheme for a name or MLC alias, with `group_size` (None: the scheme's default)."""
    if isinstance(name, Scheme):
        base = name
    else:
        if not isinstance(name, str):
            raise InputError(f"scheme must be a name, got {type(name).__name__}")
        key = name.strip().lower()
        if key in SCHEMES:
            base = SCHEMES[key]
        elif key in ALIASES:
            canon, dt = ALIASES[key]
            base = replace(SCHEMES[canon], dtype=dt)
        else:
            raise InputError(f"unknown quantization scheme {name!r}; known: {', '.join(scheme_names())}")
    if group_size is None:
        return base
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise InputError(f"group_size must be an int, got {group_size!r}")
    if base.weights in ("dense", "ggml", "kquant"):
        what = "does not quantize" if base.weights == "dense" else "has fixed blocks"
        raise InputError(f"scheme {base.name} {what}, so it takes no group_size")
    if base.weights == "int4":
        if group_size not in P.INT4_GROUP_SIZES:
            raise InputError(f"int4 group_size must be one of {P.INT4_GROUP_SIZES}, got {group_size}")
        return replace(base, group_size=group_size)
    if group_size == PER_CHANNEL:
        return replace(base, group_size=None)
    if group_size <= 0:
        raise InputError(f"int8 group_size must be positive, or {PER_CHANNEL} for one scale per row; got {group_size}")
    return replace(base, group_size=group_size)


Action = str
PolicyLike = Union[None, Mapping[str, Action], Callable[[str, nn.Module], Union[Action, None]]]


def default_action(name: str, module: nn.Linear, scheme: Scheme) -> Action:
    """What the default policy does with one Linear (see the module docstring; the K-quant
    schemes' policy, which weighs the whole model's bytes, is kquant_actions)."""
    if module.weight.numel() < MIN_QUANT_WEIGHTS:
        return "keep"
    if scheme.weights == "int4" and (name.split(".")[-1] == "head" or _block_index(name) < Q4_Q8_BLOCKS):
        return "q8"
    if scheme.weights == "int8" and name.startswith("blocks.0."):
        return "q0f16" if module.weight.dtype == torch.float16 else "q0bf16"
    return scheme.name


# --- the K-quant schemes' policy (q4k, q6k) ---------------------------------------------------
# Their matrices are ggml K-quant blocks (quant/kquantize.py writes them, with column scales) for
# the K-quant linear module. The measurements behind the policy: docs/quantization.md
# (`bench_quant_quality.py --peer llama.cpp`).

KQUANT_BASE = {"q4k": "Q4_K", "q6k": "Q6_K"}
# q4k: the head one step below llama.cpp's Q4_K_M (which holds it in Q6_K, every other matrix in
# Q4_K), and the bytes that saves spent on the leading blocks, in the first of these types that fits.
Q4K_HEAD = "Q5_K"
Q4K_LEADING = ("Q6_K", "Q5_K")
_KQUANT_FALLBACK = {"Q4_K": "q4", "Q5_K": "q4", "Q6_K": "q8"}  # for widths not a multiple of 256


def kquant_actions(model: nn.Module, scheme: str, extra_bytes: float = 0) -> dict[str, str]:
    """The default policy of a K-quant scheme ("q4k" or "q6k"): {linear name: ggml type ("Q4_K",
    "Q5_K", "Q6_K"), our scheme for a matrix whose width no K-quant block fits ("q4" for Q4_K /
    Q5_K, "q8" for Q6_K; "q8" also where q4's groups do not fit), or "keep"}.

    q6k: every matrix in Q6_K. q4k: Q4_K, but the head in Q4K_HEAD, and the leading blocks in
    Q6_K, then Q5_K, for as many whole blocks as the head's saving on Q6_K pays for, column scales
    counted: at most the bytes of llama.cpp's Q4_K_M of the same model, on any shape. An early
    block's error grows through every later one (docs/quantization.md), so those bits do more
    there than in the head. Matrices below MIN_QUANT_WEIGHTS are kept, as in every scheme.
    extra_bytes: more bytes per token for q4k's leading blocks (to compare at other budgets).
    Needs only the modules' shapes (a model on the meta device will do).
    """
    base = KQUANT_BASE[scheme]
    actions: dict[str, str] = {}
    fits: list[tuple[str, nn.Linear]] = []  # the matrices K-quant blocks can hold
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or m.bias is not None:
            continue
        t = Q4K_HEAD if base == "Q4_K" and _is_head(name) else base
        if m.weight.numel() < MIN_QUANT_WEIGHTS:
            t = "keep"
        elif m.in_features % KQ.QK_K:
            t = _KQUANT_FALLBACK[t]
            t = "q8" if t == "q4" and m.in_features % min(P.INT4_GROUP_SIZES) else t
        else:
            fits.append((name, m))
        actions[name] = t
    if base == "Q4_K":
        _upgrade_leading_blocks(actions, fits, KQ.bits_per_weight, extra_bytes)
    return actions


def _upgrade_leading_blocks(actions: dict[str, str], fits: list[tuple[str, nn.Linear]], bits, extra: float) -> None:
    """q4k: the leading blocks' K matrices in the first type of Q4K_LEADING that the bytes left pay
    for, whole blocks in order, while any does; the bytes: the head's saving against Q6_K, less
    every K matrix's column scales."""
    budget = sum(m.weight.numel() * (bits("Q6_K") - bits(Q4K_HEAD)) / 8 for n, m in fits if _is_head(n))
    budget += extra - sum(2 * m.in_features for _, m in fits)
    blocks: dict[int, list[tuple[str, nn.Linear]]] = {}
    for n, m in fits:
        if _block_index(n) != float("inf"):
            blocks.setdefault(int(_block_index(n)), []).append((n, m))
    for i in sorted(blocks):
        weights = sum(m.weight.numel() for _, m in blocks[i])
        costs = {t: weights * (bits(t) - bits("Q4_K")) / 8 for t in Q4K_LEADING}
        t = next((t for t in Q4K_LEADING if costs[t] <= budget), None)
        if t is None:
            return
        budget -= costs[t]
        for n, _ in blocks[i]:
            actions[n] = t


def kquant_read_bytes(model: nn.Module, actions: Mapping[str, str]) -> int:
    """Weight bytes a decode step reads for the linears under `actions` (kquant_actions'): K types at
    their block size plus fp16 column scales, our schemes as their modules hold them, kept ones
    as they are."""
    total = 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or m.bias is not None:
            continue
        t = actions.get(name, "keep")
        if t in KQ.K_TYPES:
            total += int(m.weight.numel() * KQ.bits_per_weight(t) / 8) + 2 * m.in_features
        elif t == "keep":
            total += m.weight.numel() * m.weight.element_size()
        else:
            target = _resolve(t, get_scheme(t), name, m.in_features)
            total += weight_bytes(convert_weight(m.weight, target, empty=True))
    return total


def _is_head(name: str) -> bool:
    return name.split(".")[-1] == "head"


def _block_index(name: str) -> float:
    """i for a module under `blocks.{i}.`, else infinity."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit():
        return int(parts[1])
    return float("inf")


def _user_action(policy: PolicyLike, name: str, module: nn.Module) -> Action | None:
    if policy is None:
        return None
    if callable(policy):
        return policy(name, module)
    if isinstance(policy, Mapping):
        for pattern, action in policy.items():
            if fnmatch.fnmatchcase(name, pattern):
                return action
        return None
    raise InputError(f"policy must be None, a dict of pattern -> action, or a callable; got {type(policy).__name__}")


def _resolve(action: Action, scheme: Scheme, name: str, width: int | None = None) -> Scheme | None:
    """The Scheme an action means for one module (None: keep). An action of the call's weight
    format takes the call's group size; another format takes its own default."""
    if not isinstance(action, str):
        raise InputError(f"policy action for {name!r} must be a scheme name or 'keep', got {action!r}")
    if action == "keep":
        return None
    if action in KQ.K_TYPES:  # (kquant_actions' per-matrix types)
        return Scheme(
            scheme.name if scheme.weights == "kquant" else action, "kquant", qtype=action, search=scheme.search
        )
    target = get_scheme(action)
    if target.weights == scheme.weights and target.weights != "dense":
        target = replace(target, group_size=scheme.group_size)
    elif target.weights != "dense" and width is not None and target.group_size and width % target.group_size:
        # Another format's default group does not fit this matrix (e.g. the q8 head of a small q4
        # model): take the largest group of that format that does.
        # (int8 groups that are multiples of 32 keep the native kernel; else one scale per row.)
        fits = [g for g in (P.INT4_GROUP_SIZES if target.weights == "int4" else (64, 32)) if width % g == 0]
        target = replace(
            target, group_size=max(fits) if fits else (None if target.weights == "int8" else target.group_size)
        )
    return replace(target, search=scheme.search)


def convert_weight(weight: torch.Tensor, target: Scheme, empty: bool = False) -> nn.Module:
    """The module of format `target` for one (N, K) weight (empty: zero buffers of the right shapes,
    on the weight's device, which may be meta)."""
    N, K = weight.shape
    dev = weight.device
    if target.weights == "dense":
        dt = target.dtype or weight.dtype
        m = DenseLinear(K, N, device=dev if empty else "meta", dtype=dt)
        if not empty:
            m.weight = nn.Parameter(weight.detach().to(dt), requires_grad=False)
        return m
    if target.weights == "kquant":
        if empty:
            return KQuantLinear(K, N, target.qtype, device=dev)
        cs = KQ.column_scales(weight)
        blocks = KQ.quantize_k(weight, target.qtype, search=target.search, col_scales=cs)
        return KQuantLinear.from_blocks(target.qtype, blocks, (N, K), cs)
    if target.weights == "ggml":
        raise InputError(f"{target.name} keeps a GGUF file's own types: it applies when loading a .gguf file only")
    gs = target.group_size
    if target.weights == "int8":
        return Int8Linear(K, N, gs, device=dev) if empty else Int8Linear.from_weight(weight, gs)
    return Int4Linear(K, N, gs, device=dev) if empty else Int4Linear.from_weight(weight, gs, search=target.search)


def plan(
    model: nn.Module,
    scheme: str | Scheme,
    group_size: int | None = None,
    policy: PolicyLike = None,
    search: bool | None = None,
) -> dict[str, Scheme]:
    """{module name: target Scheme} for the `nn.Linear` modules `quantize_model` would swap (the
    kept ones are absent). Needs only the modules' shapes and dtypes, so a model on the meta
    device can be planned before its weights are read (the loader quantizes while it streams).
    Raises InputError for an unknown scheme or a group size that does not divide a selected
    matrix's width."""
    if not isinstance(model, nn.Module):
        raise InputError(f"quantize_model needs an nn.Module, got {type(model).__name__}")
    sch = get_scheme(scheme, group_size)
    if search is not None:
        sch = replace(sch, search=bool(search))
    targets: dict[str, Scheme] = {}
    defaults = kquant_actions(model, sch.name) if sch.name in KQUANT_BASE else {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module.bias is not None:
            continue
        action = _user_action(policy, name, module)
        if action is None:
            action = defaults.get(name) or default_action(name, module, sch)
        target = _resolve(action, sch, name, module.in_features)
        if target is None:
            continue
        if target.weights == "kquant" and module.in_features % KQ.QK_K:
            raise InputError(
                f"{target.qtype} needs a width that is a multiple of {KQ.QK_K}; {name!r} is {module.in_features} wide"
            )
        gs = target.group_size
        if target.weights != "dense" and gs is not None and module.in_features % gs:
            raise InputError(
                f"group size {gs} does not divide the width {module.in_features} of {name!r}; "
                f"choose another group_size or keep this module with policy={{{name!r}: 'keep'}}"
            )
        targets[name] = target
    return targets


def quantize_model(
    model: nn.Module,
    scheme: str | Scheme,
    group_size: int | None = None,
    policy: PolicyLike = None,
    *,
    empty: bool = False,
    search: bool | None = None,
) -> dict[str, str]:
    """Swap the model's `nn.Linear` modules (in place) for the scheme's; {name: action applied}.

    group_size: int4 32 / 64 / 128; int8 a positive divisor of the width or -1 (per row);
    None: the scheme's default. policy: see the module docstring. empty=True builds modules of
    the right shapes without quantizing anything (for loading an already-converted state dict
    into a model built on the meta device). search: override the int4 range search (slower
    quantization, about 5% lower error). Raises InputError for an unknown scheme or a group
    size that does not divide a selected matrix's width (before changing anything).
    """
    targets = plan(model, scheme, group_size, policy, search)
    report: dict[str, str] = {}
    for name, target in targets.items():
        replace_module(model, name, convert_weight(model.get_submodule(name).weight, target, empty))
        report[name] = describe(target)
    return report


NOTHING_QUANTIZED = "nothing quantized (all matrices below the policy's size)"


def applied_scheme(scheme: Scheme, targets: Mapping[str, Scheme], dtype: torch.dtype) -> Scheme:
    """The scheme a model of `dtype` holds once `targets` (plan's) are applied: `scheme`, or where
    it quantizes but the plan quantizes no matrix (a small model), the dense scheme of `dtype`,
    said on stderr: a model that claims q4 while holding dense weights misleads every report."""
    if scheme.weights == "dense" or any(t.weights != "dense" for t in targets.values()):
        return scheme
    dense = next(s for s in SCHEMES.values() if s.weights == "dense" and s.dtype == dtype)
    print(f"rwkv-engine: {scheme.name}: {NOTHING_QUANTIZED}; the model stays {dense.name}", file=sys.stderr, flush=True)
    return dense


def quantization_note(asked: str | Scheme | None, held: Scheme | None) -> str | None:
    """NOTHING_QUANTIZED where the scheme `asked` quantizes and the model `held` none (see
    applied_scheme), else None."""
    if asked is None or held is None or held.weights != "dense":
        return None
    return NOTHING_QUANTIZED if get_scheme(asked).weights != "dense" else None


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` at the dotted module path `name` of `model` (the old module is dropped)."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def describe(s: Scheme) -> str:
    if s.weights == "dense":
        return s.name
    if s.weights == "int8":
        return f"q8 (group {s.group_size})" if s.group_size else "q8 (per channel)"
    if s.weights == "kquant":
        return s.qtype
    if s.weights == "ggml":
        return "as stored in the GGUF"
    return f"q4 (group {s.group_size})"
