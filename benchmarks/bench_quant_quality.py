"""Quantization error at model level: each scheme against fp32, and which blocks and matrices int4 hurts most.

    python benchmarks/bench_quant_quality.py                       # RWKV-5.2, 4 x 512 and 24 x 256
    python benchmarks/bench_quant_quality.py --version 7 --skip-sensitivity

Models are random with heavy-tailed rows and columns (`testing.random_state_dict(outliers=True)`),
vocab 4096. A quantized model and the fp32 one are fed the same 64-token prompt and then the fp32
model's own 64 greedy tokens; the error is the RMS of the logit difference relative to the RMS of
the fp32 logits, over all 128 positions, and "greedy agree" is how often the argmax matches over
the decode steps. bits/weight counts every byte a decode step reads for the linear layers
(codes, scales, biases, column scales) over their weights, the head included (the embedding is
a row lookup, not counted): on the measured model, and on the 1.5B shape (24 x 2048, vocab
65536) with the same scheme and policy, which is what a policy costs on a real model.

Sensitivity: only block i in int4 (group 32), everything else fp32: how much an int4 error in
block i moves the logits; and only one kind of matrix in int4, in block 0 or in every block.
They are the measurements behind the q4 default policy (blocks 0 and 1 at 8 bits; see
rwkv_engine.quant.schemes). No timing here: quality only, so the numbers do not depend on the
machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rwkv_engine  # noqa: E402
from rwkv_engine import testing  # noqa: E402
from rwkv_engine.config import ModelConfig  # noqa: E402
from rwkv_engine.models.model import RWKV  # noqa: E402
from rwkv_engine.quant import quantize_model  # noqa: E402
from rwkv_engine.quant.linear import weight_bytes  # noqa: E402

VOCAB = 4096


def linear_bits(model: nn.Module) -> float:
    """Bits read per weight by the model's linear layers (quantized or not)."""
    nbytes = weights = 0
    for m in model.modules():
        w = getattr(m, "qweight", None)
        if w is None and isinstance(m, nn.Linear):
            w = m.weight
        if w is None:
            continue
        nbytes += weight_bytes(m)
        weights += m.in_features * m.out_features
    return 8.0 * nbytes / weights


def bits_on_1b5(version: str, quantization: str, group_size: int | None = None, policy=None) -> float:
    """linear_bits of the scheme and policy on the 1.5B shape: 24 x 2048, head size 64, vocab 65536,
    ffn 7168 (RWKV-4/5/6) or 8192 (RWKV-7); built on the meta device, nothing is quantized."""
    C = 2048
    lora = {}
    if version in ("6.0", "7"):
        r = testing.lora_ranks(version, C)
        lora = (
            dict(lora_mix=r["mix"], lora_decay=r["decay"])
            if version == "6.0"
            else dict(lora_decay=r["decay"], lora_iclr=r["iclr"], lora_value=r["value"], lora_gate=r["gate"])
        )
    heads = dict(n_head=C // 64, head_size=64) if version != "4" else {}
    cfg = ModelConfig(
        version=version,
        n_layer=24,
        n_embd=C,
        vocab_size=65536,
        dim_att=C,
        ffn_dim=4 * C if version in ("4", "7") else 7168,
        **heads,
        **lora,
    )
    with torch.device("meta"):
        model = RWKV(cfg)
    quantize_model(model, quantization, group_size, policy, empty=True)
    return linear_bits(model)


def measure(
    path: Path, prompt: list[int], steps: list[int], ref: torch.Tensor, **load_kw
) -> tuple[float, float, float]:
    model = rwkv_engine.load(path, **load_kw)
    q = testing.logits_along(model, prompt, steps)
    agree = (q[-len(steps) - 1 :].argmax(-1) == ref[-len(steps) - 1 :].argmax(-1)).float().mean().item()
    return testing.rel_rms(q, ref), agree, linear_bits(model)


def setup(version: str, n_layer: int, n_embd: int, workdir: Path):
    sd = testing.random_state_dict(
        version, n_layer=n_layer, n_embd=n_embd, vocab_size=VOCAB, head_size=64, seed=3, outliers=True
    )
    path = testing.save_pth(sd, workdir / f"rwkv{version}-{n_layer}x{n_embd}.pth")
    prompt = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    fp32 = rwkv_engine.load(path)
    steps = testing.greedy_tokens(fp32, prompt, 64)
    return path, prompt, steps, testing.logits_along(fp32, prompt, steps)


ALL_INT4 = {"blocks.0.*": "q4", "blocks.1.*": "q4"}
SCHEMES = [
    ("q0bf16", dict(quantization="q0bf16")),
    ("q8 group 64", dict(quantization="q8", group_size=64)),
    ("q8 (default, group 32)", dict(quantization="q8")),
    ("q4 group 32, all blocks int4", dict(quantization="q4", policy=ALL_INT4)),
    ("q4 group 32, block 0 q8", dict(quantization="q4", policy={"blocks.1.*": "q4"})),
    ("q4 (default: group 32, blocks 0-1 + head q8)", dict(quantization="q4")),
    ("q4 group 128", dict(quantization="q4", group_size=128)),
]

# Other q4 policies (head q8 in all; the first matching pattern wins, then the default policy):
# more bits by position (leading blocks) or by kind of matrix.
ATT_KVR = {f"*.att.{m}": "q8" for m in ("key", "value", "receptance")}
POLICIES = [
    ("blocks 0-2 q8", {"blocks.2.*": "q8"}),
    ("block 0 q8 + att.key/value/receptance q8", {**ATT_KVR, "blocks.1.*": "q4"}),
    ("block 0 q8 + att.* q8", {"*.att.*": "q8", "blocks.1.*": "q4"}),
    ("block 0 q8 + ffn.* q8", {"*.ffn.*": "q8", "blocks.1.*": "q4"}),
    ("blocks 0-1 q8 + att.* q8", {"*.att.*": "q8"}),
]


MATRICES = {
    "7": ("att.receptance", "att.key", "att.value", "att.output", "ffn.key", "ffn.value"),
    "6.0": (
        "att.receptance",
        "att.key",
        "att.value",
        "att.gate",
        "att.output",
        "ffn.key",
        "ffn.value",
        "ffn.receptance",
    ),
    "5.2": (
        "att.receptance",
        "att.key",
        "att.value",
        "att.gate",
        "att.output",
        "ffn.key",
        "ffn.value",
        "ffn.receptance",
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="5.2", choices=testing.SUPPORTED_RANDOM_VERSIONS)
    ap.add_argument("--skip-sensitivity", action="store_true", help="only the scheme tables")
    args = ap.parse_args()
    torch.manual_seed(0)
    v = args.version
    with tempfile.TemporaryDirectory() as tmp:
        for n_layer, n_embd in ((4, 512), (24, 256)):
            path, prompt, steps, ref = setup(v, n_layer, n_embd, Path(tmp))
            print(f"\nRWKV-{v}, {n_layer} layers x {n_embd}, vocab {VOCAB}: logits against fp32")
            print(
                "| scheme | rel. RMS error | greedy agree | bits/weight | bits/weight, 1.5B shape |\n|---|---|---|---|---|"
            )
            rows = SCHEMES + [(f"q4, {name}", dict(quantization="q4", policy=pol)) for name, pol in POLICIES]
            for name, kw in rows:
                err, agree, bits = measure(path, prompt, steps, ref, **kw)
                print(f"| {name} | {err:.4f} | {agree:.3f} | {bits:.2f} | {bits_on_1b5(v, **kw):.2f} |", flush=True)
            if args.skip_sensitivity:
                continue
            print(f"\nonly block i in int4 (group 32), the rest fp32 ({n_layer} layers x {n_embd})")
            print("| block | rel. RMS error |\n|---|---|")
            for i in sorted({0, 1, 2, 3, n_layer // 2, n_layer - 1}):
                err, _, _ = measure(
                    path, prompt, steps, ref, quantization="q4", policy={f"blocks.{i}.*": "q4", "*": "keep"}
                )
                print(f"| {i} | {err:.4f} |", flush=True)
            if v not in MATRICES:
                continue
            print(f"\nonly one kind of matrix in int4 (group 32), the rest fp32 ({n_layer} layers x {n_embd})")
            print("| matrix | in block 0 | in every block |\n|---|---|---|")
            for m in MATRICES[v] + ("head",):
                one = (
                    float("nan")
                    if m == "head"
                    else measure(
                        path, prompt, steps, ref, quantization="q4", policy={f"blocks.0.{m}": "q4", "*": "keep"}
                    )[0]
                )
                pattern = "head" if m == "head" else f"blocks.*.{m}"
                every = measure(path, prompt, steps, ref, quantization="q4", policy={pattern: "q4", "*": "keep"})[0]
                print(f"| {m} | {one:.4f} | {every:.4f} |", flush=True)


if __name__ == "__main__":
    main()
