"""Quantization error at model level: each scheme against fp32, and which blocks int4 hurts most.

    python benchmarks/bench_quant_quality.py                       # RWKV-5.2, 4 x 512 and 24 x 256
    python benchmarks/bench_quant_quality.py --version 7 --skip-sensitivity

Models are random with heavy-tailed rows and columns (`testing.random_state_dict(outliers=True)`),
vocab 4096. A quantized model and the fp32 one are fed the same 64-token prompt and then the fp32
model's own 64 greedy tokens; the error is the RMS of the logit difference relative to the RMS of
the fp32 logits, over all 128 positions, and "greedy agree" is how often the argmax matches over
the decode steps. bits/weight counts every byte a decode step reads for the linear layers
(codes, scales, biases, column scales) over their weights.

Sensitivity: only block i in int4 (group 32), everything else fp32: how much an int4 error in
block i moves the logits. It is the measurement behind the q4 default policy (block 0 at 8 bits).
No timing here: quality only, so the numbers do not depend on the machine.
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


def measure(path: Path, prompt: list[int], steps: list[int], ref: torch.Tensor, **load_kw) -> tuple[float, float, float]:
    model = rwkv_engine.load(path, **load_kw)
    q = testing.logits_along(model, prompt, steps)
    agree = (q[-len(steps) - 1 :].argmax(-1) == ref[-len(steps) - 1 :].argmax(-1)).float().mean().item()
    return testing.rel_rms(q, ref), agree, linear_bits(model)


def setup(version: str, n_layer: int, n_embd: int, workdir: Path):
    sd = testing.random_state_dict(version, n_layer=n_layer, n_embd=n_embd, vocab_size=VOCAB, head_size=64,
                                   seed=3, outliers=True)
    path = testing.save_pth(sd, workdir / f"rwkv{version}-{n_layer}x{n_embd}.pth")
    prompt = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    fp32 = rwkv_engine.load(path)
    steps = testing.greedy_tokens(fp32, prompt, 64)
    return path, prompt, steps, testing.logits_along(fp32, prompt, steps)


SCHEMES = [
    ("q0bf16", dict(quantization="q0bf16")),
    ("q8 group 64", dict(quantization="q8", group_size=64)),
    ("q8 (default, group 32)", dict(quantization="q8")),
    ("q4 group 32, all blocks int4", dict(quantization="q4", policy={"blocks.0.*": "q4"})),
    ("q4 (default: group 32, block 0 + head q8)", dict(quantization="q4")),
    ("q4 group 128", dict(quantization="q4", group_size=128)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="5.2", choices=testing.SUPPORTED_RANDOM_VERSIONS)
    ap.add_argument("--skip-sensitivity", action="store_true", help="only the scheme tables")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for n_layer, n_embd in ((4, 512), (24, 256)):
            path, prompt, steps, ref = setup(args.version, n_layer, n_embd, Path(tmp))
            print(f"\nRWKV-{args.version}, {n_layer} layers x {n_embd}, vocab {VOCAB}: logits against fp32")
            print("| scheme | rel. RMS error | greedy agree | bits/weight |\n|---|---|---|---|")
            for name, kw in SCHEMES:
                err, agree, bits = measure(path, prompt, steps, ref, **kw)
                print(f"| {name} | {err:.4f} | {agree:.3f} | {bits:.2f} |", flush=True)
            if args.skip_sensitivity:
                continue
            print(f"\nonly block i in int4 (group 32), the rest fp32 ({n_layer} layers x {n_embd})")
            print("| block | rel. RMS error |\n|---|---|")
            for i in sorted({0, 1, 2, 3, n_layer // 2, n_layer - 1}):
                err, _, _ = measure(path, prompt, steps, ref, quantization="q4",
                                    policy={f"blocks.{i}.*": "q4", "*": "keep"})
                print(f"| {i} | {err:.4f} |", flush=True)


if __name__ == "__main__":
    main()
