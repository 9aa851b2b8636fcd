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

    python benchmarks/bench_quant_quality.py --peer llama.cpp --shape 0.1B     # or 1.5B

With llama.cpp as the peer: a random RWKV-7 of a real shape (bench_engine.py's 0.1B = 12 x 768 or
1.5B = 24 x 2048, vocab 65536) with heavy-tailed weights, stored in bf16 as real checkpoints are,
is converted to GGUF by llama.cpp's own convert_hf_to_gguf.py and quantized by its own
`llama-quantize` to Q4_K_M (bench_peers.py fetches and builds llama.cpp); that file is loaded by
rwkv-engine in fp32, its K-quant matrices run from their blocks by the K-quant module (as a
user's GGUF runs), so the two sides differ only in the rounding of the weights. Beside it: our
q8, q4, and q4k / q6k loaded as a user loads them (`-q q4k`: our blocks in the same module and
kernels), and our quantizer under other policies through the PyTorch fallback (each matrix
dequantized to fp32, activations not rounded). The table adds the MB of weights a decode
step reads: every matrix and LoRA matrix at its stored type, not the embedding (one row a token),
and the matrix output error: each block matrix's relative output error on the inputs the fp32
model gives it, RMS over the matrices (the rounding itself, before its growth through the
layers). --by-type adds that error for each K type, llama-quantize's (its Q4_K_M, Q5_K_M and Q6_K
files) against our quantizer's.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import os
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
from rwkv_engine.quant import (
    kquantize,  # noqa: E402
    quantize_model,  # noqa: E402
)
from rwkv_engine.quant.ggml_quants import BY_NAME, dequantize  # noqa: E402
from rwkv_engine.quant.kquantize import K_TYPES  # noqa: E402
from rwkv_engine.quant.linear import DenseLinear, weight_bytes  # noqa: E402
from rwkv_engine.quant.schemes import kquant_actions, kquant_read_bytes, replace_module  # noqa: E402

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


# --- against llama.cpp's own K-quants ---------------------------------------------------------

# llama-quantize's Q4_K_M for RWKV-7 (no RWKV tensor is in its attn_v / ffn_down classes): the head
# in Q6_K, every other matrix in Q4_K.
Q4_K_M = [("head", "Q6_K"), ("*", "Q4_K")]


def policy_actions(model: nn.Module, policy) -> dict[str, str]:
    """{linear name: action}: a scheme name ("q4k", "q6k": its default policy) or a list of
    (glob pattern, ggml type) pairs, first match wins, the rest kept."""
    if isinstance(policy, str):
        return kquant_actions(model, policy)
    return {
        name: next((t for pat, t in policy if fnmatch.fnmatchcase(name, pat)), "keep")
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }


def k_fallback(model: nn.Module, actions: dict[str, str], col_scales: bool = True) -> None:
    """The K-typed linears replaced (in place) by their blocks from our quantizer, dequantized to
    fp32 (times the column scales): the K-quant module's PyTorch fallback. Only K types here."""
    for name, t in actions.items():
        if t == "keep":
            continue
        if t not in K_TYPES:
            raise ValueError(f"{name}: {t} is not a K-quant type (this model shape needs none)")
        w = model.get_submodule(name).weight.detach()
        c = kquantize.column_scales(w) if col_scales else None
        deq = dequantize(kquantize.quantize_k(w, t, col_scales=c).reshape(-1), BY_NAME[t], tuple(w.shape))
        m = DenseLinear(w.shape[1], w.shape[0], device="meta")
        m.weight = nn.Parameter(deq * c.float() if c is not None else deq, requires_grad=False)
        replace_module(model, name, m)


def lora_bytes(model: nn.Module, dtype=torch.bfloat16) -> int:
    """Bytes of the 2-D parameters outside the linear modules (RWKV-6/7 LoRA, not the embedding),
    counted in `dtype`: the source's 16-bit type, which a quantized model keeps them in."""
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(
        p.numel() * size for n, p in model.named_parameters() if p.dim() == 2 and n not in linear and n != "emb.weight"
    )


def model_read_bytes(model: nn.Module) -> int:
    """Weight bytes a decode step of a loaded model reads: its linears as held, LoRA in bf16."""
    return sum(weight_bytes(m) for m in model.modules() if isinstance(m, nn.Linear) or hasattr(m, "qweight")) + (
        lora_bytes(model)
    )


def q4_read_bytes(model: nn.Module) -> int:
    """model_read_bytes of `model` under our q4 (its default policy), from the shapes alone."""
    with torch.device("meta"):
        meta = RWKV(model.config)
    quantize_model(meta, "q4", empty=True)
    return model_read_bytes(meta)


def gguf_read_bytes(path: Path) -> tuple[int, str]:
    """(bytes of every matrix but the embedding, the types of the quantized ones with counts) of a
    GGUF file."""
    from gguf import GGUFReader

    total, kinds = 0, {}
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight" and min(int(d) for d in t.shape) > 1:
            total += int(t.n_bytes)
            if t.tensor_type.name.startswith("Q"):
                kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    return total, ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))


def linear_inputs(model: nn.Module, prompt: list[int]) -> dict[str, torch.Tensor]:
    """{linear name: its input rows [T, in_features]} in one forward of `prompt`."""
    xs, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            hook = lambda _m, a, n=name: xs.__setitem__(n, a[0].reshape(-1, a[0].shape[-1]).detach().clone())  # noqa: E731
            hooks.append(m.register_forward_pre_hook(hook))
    native, model.native_decode = model.native_decode, False  # (the fused native step calls no module)
    model.forward(prompt, all_logits=True)
    model.native_decode = native
    for h in hooks:
        h.remove()
    return xs


def matrix_error(model: nn.Module, xs: dict[str, torch.Tensor], ys: dict[str, torch.Tensor]) -> float:
    """RMS over the block matrices of each one's relative output error on the fp32 model's inputs:
    the weights' rounding, without the growth through the layers that dominates the logits."""
    errs = [testing.rel_rms(model.get_submodule(n)(x), ys[n]) ** 2 for n, x in xs.items() if n != "head"]
    return (sum(errs) / len(errs)) ** 0.5


def by_type(fp32: nn.Module, f16: Path, work: Path, ckpt: Path, bins: Path, xs, ys, threads: int) -> None:
    """Matrix output error of each K type over the block matrices: llama-quantize's (from its
    Q4_K_M, Q5_K_M and Q6_K files, which hold every block matrix of an RWKV-7 in Q4_K, Q5_K and
    Q6_K) against our quantizer's, without and with column scales."""
    from bench_peers import check_run, log_step

    print(
        "\nmatrix output error of the block matrices, by type\n| type | llama-quantize | ours | ours, column scales |"
    )
    print("|---|---|---|---|")
    for ftype, t in (("Q4_K_M", "Q4_K"), ("Q5_K_M", "Q5_K"), ("Q6_K", "Q6_K")):
        path = work / f"{ckpt.stem}-llama.cpp-{ftype}.gguf"
        if not path.exists():
            log_step(f"quantizing to {ftype} ...")
            check_run(
                [bins / "llama-quantize", f16, path.with_suffix(".tmp"), ftype, threads], f"llama-quantize {ftype}"
            )
            os.replace(path.with_suffix(".tmp"), path)
        errs = [matrix_error(rwkv_engine.load(path, dtype="fp32", progress=False), xs, ys)]
        for col in (False, True):
            model = copy.deepcopy(fp32)
            k_fallback(model, {n: t for n in xs if n != "head"}, col)
            errs.append(matrix_error(model, xs, ys))
            del model
        print(f"| {t} | " + " | ".join(f"{e:.4f}" for e in errs) + " |", flush=True)


def peer_llama(args) -> None:
    from bench_engine import SHAPES
    from bench_peers import build_llama, check_run, gguf_files, llama_tree, log_step, missing_tools

    L, C, V = SHAPES[args.shape]
    tree = llama_tree(args.cache)
    bins = tree / "build" / "bin"
    if not all((bins / b).exists() for b in ("llama-quantize", "llama-bench")):  # (bench_peers builds both)
        if missing := missing_tools():
            print(f"bench_quant_quality: skipped: building llama.cpp needs {' and '.join(missing)}", file=sys.stderr)
            return
        bins = build_llama(tree, args.jobs)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"rwkv7-{args.shape}-heavy-bf16.pth"
    if not ckpt.exists():
        log_step(f"writing a random heavy-tailed RWKV-7 {args.shape} checkpoint to {ckpt} ...")
        sd = testing.random_state_dict("7", n_layer=L, n_embd=C, vocab_size=V, head_size=64, seed=3, outliers=True)
        torch.save(testing.cast(sd, torch.bfloat16), ckpt)
        del sd
    ggufs = gguf_files(work, ckpt, tree, bins, ["F16", "Q4_K_M"], args.threads)
    f16_emb = work / f"{ckpt.stem}-llama.cpp-Q4_K_M-f16-embedding.gguf"
    if not f16_emb.exists():
        log_step("quantizing to Q4_K_M with an F16 embedding ...")
        tmp = f16_emb.with_suffix(".tmp")
        cmd = [bins / "llama-quantize", "--token-embedding-type", "f16", ggufs["F16"], tmp, "Q4_K_M", args.threads]
        check_run(cmd, "llama-quantize Q4_K_M")
        os.replace(tmp, f16_emb)

    n = args.tokens
    prompt = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    log_step(f"fp32 reference: logits over {n} prompt tokens and {n} greedy steps, every matrix's inputs ...")
    fp32 = rwkv_engine.load(ckpt, dtype="fp32", progress=False)
    xs = linear_inputs(fp32, prompt)
    ys = {name: fp32.get_submodule(name)(x) for name, x in xs.items()}
    if args.by_type:
        by_type(fp32, ggufs["F16"], work, ckpt, bins, xs, ys, args.threads)
    steps = testing.greedy_tokens(fp32, prompt, n)
    ref = testing.logits_along(fp32, prompt, steps)
    del fp32

    def wanted(label: str) -> bool:
        return not args.only or any(o in label for o in args.only.split(","))

    def row(label: str, model: nn.Module, nbytes: int, note: str = "") -> None:
        q = testing.logits_along(model, prompt, steps)
        agree = (q[-n - 1 :].argmax(-1) == ref[-n - 1 :].argmax(-1)).float().mean().item()
        print(
            f"| {label} | {testing.rel_rms(q, ref):.4f} | {agree:.3f} | {matrix_error(model, xs, ys):.4f} | "
            f"{nbytes / 1e6:.1f} | {note} |",
            flush=True,
        )

    print(f"\nRWKV-7 {args.shape} ({L} x {C}, vocab {V}), heavy-tailed random weights in bf16: against fp32")
    print(
        "| weights | logits rel. RMS error | greedy agree | matrix output error | MB read per token | types |\n"
        "|---|---|---|---|---|---|"
    )
    for label, path in (
        ("llama.cpp F16 (the GGUF source)", ggufs["F16"]),
        ("llama.cpp Q4_K_M (llama-quantize)", ggufs["Q4_K_M"]),
        ("llama.cpp Q4_K_M, F16 embedding", f16_emb),
    ):
        if not wanted(label):
            continue
        nbytes, kinds = gguf_read_bytes(path)
        row(label, rwkv_engine.load(path, dtype="fp32", progress=False), nbytes, kinds)
    for q in ("q8", "q4", "q4k", "q6k"):
        if not wanted(f"rwkv-engine {q}"):
            continue
        model = rwkv_engine.load(ckpt, dtype="fp32", quantization=q, progress=False)
        kinds = [getattr(m, "qtype", "") for m in model.modules()]
        counts = ", ".join(f"{t} x{kinds.count(t)}" for t in K_TYPES if t in kinds)
        row(f"rwkv-engine {q}", model, model_read_bytes(model), counts)
    for label, policy, col in (
        ("our quantizer, Q4_K_M's types, no column scales", Q4_K_M, False),
        ("our quantizer, Q4_K_M's types", Q4_K_M, True),
        ("q4k's policy, fallback", "q4k", True),
        ("q4k with q4's bytes", "q4k+", True),
        ("q6k", "q6k", True),
    ):
        if not wanted(label):
            continue
        model = rwkv_engine.load(ckpt, dtype="fp32", progress=False)
        if policy == "q4k+":  # the q4k policy with more bytes for its leading blocks: those q4 reads
            extra = q4_read_bytes(model) - kquant_read_bytes(model, kquant_actions(model, "q4k")) - lora_bytes(model)
            actions = kquant_actions(model, "q4k", extra)
        else:
            actions = policy_actions(model, policy)
        nbytes = kquant_read_bytes(model, actions) - (
            0 if col else 2 * sum(model.get_submodule(a).in_features for a, t in actions.items() if t in K_TYPES)
        )
        k_fallback(model, actions, col)
        counts = {t: sum(v == t for v in actions.values()) for t in K_TYPES}
        row(label, model, nbytes + lora_bytes(model), ", ".join(f"{t} x{c}" for t, c in counts.items() if c))
        del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="5.2", choices=testing.SUPPORTED_RANDOM_VERSIONS)
    ap.add_argument("--skip-sensitivity", action="store_true", help="only the scheme tables")
    ap.add_argument("--peer", choices=["llama.cpp"], help="compare with llama.cpp's K-quants instead (RWKV-7)")
    ap.add_argument("--shape", default="0.1B", choices=["0.1B", "0.4B", "1.5B"], help="--peer: model shape")
    ap.add_argument("--tokens", type=int, default=64, help="--peer: prompt tokens, and greedy steps after them")
    ap.add_argument("--by-type", action="store_true", help="--peer: also each K type's matrix error, both quantizers")
    ap.add_argument("--only", help="--peer: only the rows whose label contains one of these (comma-separated)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="--peer: llama-quantize threads")
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 2), help="--peer: llama.cpp build jobs")
    ap.add_argument("--workdir", default="/tmp/rwkv-engine-bench", help="--peer: checkpoint and GGUF files")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rwkv-engine-bench",
        help="--peer: where llama.cpp is unpacked and built (bench_peers.py's)",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.peer:
        peer_llama(args)
        return
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
