"""The fused decode step: a few tokens per sequence through every block in one native call.

Decode is memory-bound: a step reads each weight once, and everything else (LayerNorms, mixes,
the WKV state update, a few hundred small tensor ops per step in PyTorch) should cost next to
nothing. `DecodeStep` hands the whole block stack to `kernels/native/step.cpp`, which runs the
same math as the PyTorch modules in this package (they stay the specification; the tests
compare the two) with the big matrices through the native GEMVs.

    step = DecodeStep.build(model)      # None where the native kernels or the model's layers don't allow it
    logits = step(x, state_fields_in, state_fields_out)                  # x [B, C]: one token per row
    logits = step(x, state_fields_in, state_fields_out, all_logits=True)  # x [B, T, C]: [B, T, V]

With T tokens per row (a speculative verify pass, a short prompt) every linear runs the B x T
rows as one GEMV, so each weight is read once for all of them (8 rows per read), while each
row's recurrence steps through its tokens; every token gets the bits of a one-token step from
the state before it, so a verify pass decides exactly what plain decoding would.

`RWKV.forward` uses it for inputs of at most GEMV_MAX_ROWS rows x tokens on the CPU. The step
points into the model's own tensors, so in-place changes (`load_state_dict`) show at once; when
a module, parameter or buffer is replaced (a quantization swap, `.to()`), `generation()` changes
and the model builds a new step. (Rebinding `param.data` directly is not seen: call
`model.reset_decode_step()` after that.)
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..kernels import native
from ..quant.kquant_linear import KQuantLinear
from ..quant.linear import _NATIVE_DENSE_DTYPES, DenseLinear, Int4Linear, Int8Linear
from .layers import LORA_DTYPES

Tensor = torch.Tensor

# Bumped whenever any module anywhere registers a submodule, parameter or buffer (nn.Module's
# global registration hooks fire on assignment), so a cached step can tell that it may be stale.
_generation = 0


def _bump(*_args) -> None:
    global _generation
    _generation += 1


def generation() -> int:
    return _generation


torch.nn.modules.module.register_module_module_registration_hook(_bump)
torch.nn.modules.module.register_module_parameter_registration_hook(_bump)
torch.nn.modules.module.register_module_buffer_registration_hook(_bump)


def _linear_parts(m: nn.Module) -> tuple | None:
    """A linear module as the tuple DecodePlan reads, or None where the native GEMVs can't run it."""
    if isinstance(m, Int8Linear):
        return (m.qweight, m.scales, None, m.col_scales) if m._native_ok() else None
    if isinstance(m, Int4Linear):
        return (m.qweight, m.scales, m.biases, m.col_scales)
    if isinstance(m, KQuantLinear):  # ggml's blocks as they are, and the type's id
        return (m.qweight, m.type_id, None, m.col_scales) if m._native_ok() else None
    if type(m) is nn.Linear or isinstance(m, DenseLinear):
        w = m.weight
        if m.bias is None and w.dtype in _NATIVE_DENSE_DTYPES and w.is_contiguous():
            return (w,)
    return None


def _fp32(t: Tensor) -> Tensor:
    return t.detach().float().contiguous()


def _as_stored(t: Tensor) -> Tensor:
    """A LoRA matrix as the model holds it (fp32, bf16 or fp16: step.cpp reads all three), not copied."""
    return t.detach().contiguous() if t.dtype in LORA_DTYPES else _fp32(t)


def _block_dict(block: nn.Module, family: int) -> dict | None:
    att, ffn = block.att, block.ffn
    d: dict[str, object] = {
        "ln1_w": block.ln1.weight,
        "ln1_b": block.ln1.bias,
        "ln2_w": block.ln2.weight,
        "ln2_b": block.ln2.bias,
        "ffn_mix_k": ffn.mix_k,
    }
    linears = {
        "att_r": att.receptance,
        "att_k": att.key,
        "att_v": att.value,
        "att_o": att.output,
        "ffn_k": ffn.key,
        "ffn_v": ffn.value,
    }
    if ffn.gated:
        d["ffn_mix_r"] = ffn.mix_r
        linears["ffn_r"] = ffn.receptance
    if getattr(att, "gate", None) is not None:
        linears["att_g"] = att.gate
    if family == 4:
        d.update(mix_k=att.mix_k, mix_v=att.mix_v, mix_r=att.mix_r, decay=att.log_decay, bonus=att.bonus)
    else:
        d.update(lnx_w=att.ln_x.weight, lnx_b=att.ln_x.bias)
        names = {
            5: ("mix_r", "mix_k", "mix_v", "mix_g"),
            6: (
                "mix_r",
                "mix_k",
                "mix_v",
                "mix_g",
                "mix_x",
                "mix_w",
                "bonus",
                "decay_base",
                "maa_w1",
                "maa_w2",
                "decay_w1",
                "decay_w2",
            ),
            7: (
                "mix_r",
                "mix_k",
                "mix_v",
                "mix_g",
                "mix_w",
                "mix_a",
                "w0",
                "w1",
                "w2",
                "a0",
                "a1",
                "a2",
                "v0",
                "v1",
                "v2",
                "g1",
                "g2",
                "k_k",
                "k_a",
                "r_k",
            ),
        }[family]
        for name in names:
            t = getattr(att, name, None)
            if t is not None:
                d[name] = t
        if family == 5:
            d.update(decay=att.log_decay, bonus=att.bonus)
    lora = getattr(att, "LORA", ())
    d = {k: _as_stored(v) if k in lora else _fp32(v) for k, v in d.items()}
    for key, m in linears.items():
        parts = _linear_parts(m)
        if parts is None:
            return None
        d[key] = parts
    return d


_noticed = False


def _notice_deep_embed() -> None:
    """Once per process: RWKV-7a decodes through the PyTorch modules."""
    global _noticed
    if not _noticed:
        _noticed = True
        print(
            "note: RWKV-7a (DeepEmbed) has no fused native decode step yet; one-token steps run the "
            "PyTorch modules (the same results, slower)",
            file=sys.stderr,
            flush=True,
        )


class DecodeStep:
    """A model's block stack as one native call (see the module docstring)."""

    def __init__(self, plan):
        self.plan = plan

    @classmethod
    def build(cls, model) -> DecodeStep | None:
        ops = native.load()
        if ops is None or not hasattr(ops, "DecodePlan") or model.device.type != "cpu":
            return None
        cfg = model.config
        if cfg.deep_embed:
            _notice_deep_embed()
            return None
        blocks = [_block_dict(b, cfg.family) for b in model.blocks]
        head = _linear_parts(model.head)
        if any(b is None for b in blocks) or head is None:
            return None
        out = {"ln_out_w": _fp32(model.ln_out.weight), "ln_out_b": _fp32(model.ln_out.bias), "head": head}
        plan = ops.DecodePlan(
            family=cfg.family,
            gated=cfg.version != "5.0",
            C=cfg.n_embd,
            A=cfg.dim_att,
            H=cfg.n_head,
            N=cfg.head_size,
            F=cfg.ffn_dim,
            V=cfg.vocab_size,
            dtype=model.dtype,
            rescale_every=model.rescale_every,
            blocks=blocks,
            out=out,
        )
        return cls(plan)

    def __call__(self, x: Tensor, state_in: list[Tensor], state_out: list[Tensor], all_logits: bool = False) -> Tensor:
        """x [B, C] or [B, T, C] fp32 embedded tokens (overwritten) -> logits fp32: [B, V] of each
        row's last token, or [B, T, V] with all_logits and x [B, T, C]. The state fields in the
        State's order, read from state_in (before the first token) and written to state_out
        (after the last)."""
        return self.plan.step(x, state_in, state_out, all_logits)
