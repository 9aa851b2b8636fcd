"""Layer-by-layer alignment of two configurations of one checkpoint (`rwkv-engine verify`).

A prompt runs through both; then the reference's greedy continuation is fed to both, one decode
step per token. The report holds, per layer, the relative RMS error (rel_rms: RMS of the
difference over the RMS of the reference) of the block's output over every prompt position (the
hidden state; when both sides expose it) and of each recurrent state field after the prompt; then
the logits' error at the last prompt position and at every decode step, and how often the two
greedy choices agree. Two layers are flagged: the first whose error exceeds JUMP_FLOOR, and the
first after it whose error jumps (more than JUMP_FACTOR times the layer before): where an
implementation goes wrong, or where quantization error starts to grow (a q4 model's first int4
block). The hidden state's error decides where there is one, else the largest state field's.

Sides: an engine model (any dtype or quantization: hidden states come from `RWKV.layer_observer`),
an exported program (.pte: state fields and logits only), or the official `rwkv` package (run in a
subprocess, since RWKV-7 needs RWKV_V7_ON=1 before it is imported; state fields and logits).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InputError

Tensor = torch.Tensor

JUMP_FACTOR = 4.0
JUMP_FLOOR = 1e-4

# The rwkv package's per-layer state list, in our field names (docs/formats.md A.9); RWKV-7's att_kv is
# stored [value][key] there, the transpose of ours.
PIP_LAYOUT = {
    4: ["att_x_prev", "att_num", "att_den", "att_max", "ffn_x_prev"],
    5: ["att_x_prev", "att_kv", "ffn_x_prev"],
    6: ["att_x_prev", "att_kv", "ffn_x_prev"],
    7: ["att_x_prev", "att_kv", "ffn_x_prev"],
}


# --- comparison metrics (also what the tests compare with: rwkv_engine.testing re-exports them) ---


def rel_rms(a: Tensor, b: Tensor) -> float:
    """RMS of a - b relative to the RMS of the reference b (in fp64)."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    """The model's own greedy continuation of `prompt`, n tokens."""
    out: list[int] = []
    logits, state = model.forward(prompt)
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits, state = model.forward(out[-1:], state)
    return out


def logits_along(model, prompt: list[int], steps: list[int]) -> Tensor:
    """[len(prompt) + len(steps), vocab] logits: every prompt position in one forward, then one
    decode step per token of `steps` (a quality comparison feeds two models the same tokens)."""
    logits, state = model.forward(prompt, all_logits=True)
    out = [logits]
    for t in steps:
        lg, state = model.forward([t], state)
        out.append(lg[None])
    return torch.cat(out)


@dataclass
class Trace:
    """What one side computed: per-layer prompt outputs (or None), the state after the prompt
    (field -> [L, ...]), the last prompt position's logits, and the logits of each decode step."""

    hidden: list[Tensor] | None
    state: dict[str, Tensor]
    prompt_logits: Tensor
    step_logits: list[Tensor] = field(default_factory=list)


@torch.no_grad()
def trace_model(model, prompt: list[int], steps: list[int]) -> Trace:
    """Run an engine model or a ProgramModel over `prompt`, then one decode step per token of `steps`."""
    hidden: dict[int, list[Tensor]] | None = None
    if hasattr(model, "run_blocks"):  # an engine model: observe every block
        hidden = {}

        def observe(i: int, x: Tensor, fields: dict) -> None:
            hidden.setdefault(i, []).append(x[0].float().clone())

        model.layer_observer = observe
    try:
        logits, state = model.forward(prompt)
    finally:
        if hidden is not None:
            model.layer_observer = None
    out = Trace(
        hidden=[torch.cat(hidden[i]) for i in sorted(hidden)] if hidden else None,
        state={k: v[0].float().clone() for k, v in state.items()},
        prompt_logits=logits.float().clone(),
    )
    for tok in steps:
        logits, state = model.forward([tok], state)
        out.step_logits.append(logits.float().clone())
    return out


_RWKV_PACKAGE = textwrap.dedent(
    """
    import os, sys
    if sys.argv[3] == "7":
        os.environ["RWKV_V7_ON"] = "1"
    os.environ.setdefault("RWKV_JIT_ON", "0")
    os.environ["RWKV_CUDA_ON"] = "0"
    import torch
    from rwkv.model import RWKV
    path, out, _, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    prompt = [int(t) for t in sys.argv[5].split(",")]
    model = RWKV(path[: -len(".pth")] if path.endswith(".pth") else path, "cpu fp32")
    logits, state = model.forward(prompt, None)
    res = {"prompt_logits": logits.float().clone(), "state": [s.float().clone() for s in state],
           "tokens": [], "step_logits": []}
    tok = int(logits.argmax())
    for _ in range(n):
        logits, state = model.forward([tok], state)
        res["tokens"].append(tok)
        res["step_logits"].append(logits.float().clone())
        tok = int(logits.argmax())
    torch.save(res, out)
    """
)


def trace_rwkv_package(path: Path, family: int, n_layer: int, prompt: list[int], n: int) -> tuple[Trace, list[int]]:
    """The official `rwkv` package (fp32, CPU) on a BlinkDL .pth, in a subprocess: (trace, its greedy tokens)."""
    try:
        import rwkv  # noqa: F401  (only to fail early with a clear message)
    except ImportError:
        raise InputError("--against rwkv needs the official rwkv package: pip install rwkv") from None
    if Path(path).suffix != ".pth" or not Path(path).is_file():
        raise InputError(f"--against rwkv needs a BlinkDL .pth checkpoint file, got {path}")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "trace.pt"
        proc = subprocess.run(
            [sys.executable, "-c", _RWKV_PACKAGE, str(path), str(out), str(family), str(n), ",".join(map(str, prompt))],
            capture_output=True,
            text=True,
            env={**os.environ},
        )
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise InputError(f"the rwkv package failed on {path}: {tail[0]}")
        res = torch.load(out)
    names = PIP_LAYOUT[family]
    state = {}
    for j, name in enumerate(names):
        per_layer = [res["state"][i * len(names) + j] for i in range(n_layer)]
        if family == 7 and name == "att_kv":
            per_layer = [t.transpose(-1, -2) for t in per_layer]
        state[name] = torch.stack(per_layer)
    trace = Trace(None, state, res["prompt_logits"], res["step_logits"])
    return trace, res["tokens"]


def compare(subject: Trace, reference: Trace) -> dict:
    """The JSON-able report of `subject` against `reference` (see the module docstring)."""
    fields = [k for k in reference.state if k in subject.state]
    n_layer = next(iter(reference.state.values())).shape[0]
    layers = []
    for i in range(n_layer):
        row = {"layer": i}
        if subject.hidden is not None and reference.hidden is not None:
            row["hidden"] = rel_rms(subject.hidden[i], reference.hidden[i])
        for k in fields:
            row[k] = rel_rms(subject.state[k][i], reference.state[k][i])
        layers.append(row)
    errs = [row.get("hidden", max((row[k] for k in fields), default=0.0)) for row in layers]
    first = next((i for i, e in enumerate(errs) if e > JUMP_FLOOR), None)
    jump = next((i for i in range(1, len(errs)) if errs[i] > JUMP_FLOOR and errs[i] > JUMP_FACTOR * errs[i - 1]), None)
    steps = [rel_rms(a, b) for a, b in zip(subject.step_logits, reference.step_logits)]
    agree = [int(a.argmax()) == int(b.argmax()) for a, b in zip(subject.step_logits, reference.step_logits)]
    return {
        "layers": layers,
        "state_fields": fields,
        "first_error_layer": first,
        "first_jump_layer": jump,
        "prompt_logits": rel_rms(subject.prompt_logits, reference.prompt_logits),
        "prompt_greedy_agrees": int(subject.prompt_logits.argmax()) == int(reference.prompt_logits.argmax()),
        "step_logits": steps,
        "step_logits_mean": sum(steps) / len(steps) if steps else None,
        "step_logits_max": max(steps) if steps else None,
        "greedy_agreement": sum(agree),
        "steps": len(agree),
    }


def format_report(report: dict, subject: str, reference: str) -> str:
    """The report as a table for a terminal."""
    fields = report["state_fields"]
    has_hidden = report["layers"] and "hidden" in report["layers"][0]
    cols = (["hidden"] if has_hidden else []) + fields
    lines = [f"{subject}  against  {reference}   (relative RMS error; reference = the second)", ""]
    lines.append("layer  " + "  ".join(f"{c:>11}" for c in cols))
    for row in report["layers"]:
        mark = "  <- first jump" if row["layer"] == report["first_jump_layer"] else ""
        lines.append(f"{row['layer']:>5}  " + "  ".join(f"{row[c]:>11.3e}" for c in cols) + mark)
    lines.append("")
    lines.append(
        f"logits, last prompt token: {report['prompt_logits']:.3e}"
        f" (greedy {'agrees' if report['prompt_greedy_agrees'] else 'differs'})"
    )
    if report["steps"]:
        lines.append(
            f"logits over {report['steps']} decode steps: mean {report['step_logits_mean']:.3e}, "
            f"max {report['step_logits_max']:.3e}; greedy agreement {report['greedy_agreement']}/{report['steps']}"
        )
    first, jump = report["first_error_layer"], report["first_jump_layer"]
    lines.append(f"first layer with an error above {JUMP_FLOOR:g}: {'none' if first is None else first}")
    if jump is None:
        lines.append(f"no later layer's error jumps (more than {JUMP_FACTOR:g}x the layer before)")
    else:
        lines.append(f"first jump (more than {JUMP_FACTOR:g}x the layer before) at layer {jump}")
    return "\n".join(lines)
