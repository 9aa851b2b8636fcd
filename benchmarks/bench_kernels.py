"""GEMV / GEMM throughput of our native kernels against torch's own, on RWKV 1.5B-sized layers.

    python benchmarks/bench_kernels.py                 # 2 threads, decode + crossover + prefill
    python benchmarks/bench_kernels.py --quick         # decode only, fewer rounds, no 65536-row head
    python benchmarks/bench_kernels.py --only errors   # quantization error table only
    python benchmarks/bench_kernels.py --only batch --baseline HEAD~3   # batched GEMVs, new vs old
    python benchmarks/bench_kernels.py --only batch --baseline isa:avx2 # the ISA level in use vs AVX2
    python benchmarks/bench_kernels.py --only step --model DIR --batches 1,8 --baseline HEAD
    python benchmarks/bench_kernels.py --only batch --resident --threads 1  # weights in cache: compute speed
    python benchmarks/bench_kernels.py --only batch --formats q4_k,q6_k,int4g32   # ggml K-quants beside ours
    python benchmarks/bench_kernels.py --only kprefill --threads 1     # K-quant prefill: integer kernel vs tiles + GEMM

Decode (one token, x [1, K]): for each layer shape of the RWKV-5 World 1.5B model and each weight
format, the torch peer and our kernel run in alternating rounds over enough copies of the
weight to flush the 32 MB L3 cache; the best round of each is reported as GB/s of weight
traffic and G weights/s, with the ratio torch time / our time (> 1: ours is faster). Peers:

    fp32 / bf16 / fp16   F.linear with x in the weight dtype
    int8                 torch._weight_int8pack_mm (per-channel scales, bf16 x)
    int4 g32/64/128      torch._weight_int4pack_mm_for_cpu (same group size, bf16 x)

Then an estimate of decode tok/s for the whole 1.5B model (24 layers x 8 matrices + head) per
scheme, the GEMV / GEMM crossover in the number of rows of x, and prefill (T = 512) GFLOP/s of
the quantized modules against torch's dense and packed GEMMs.

Batch (`--only batch`): our GEMV for x [B, K], B = 1, 4, 8, per shape and format, as GMAC/s
(B * N * K multiply-adds per call) and GB/s of weights read; with `--baseline REV` the kernels of
git revision REV (or, with `isa:LEVEL`, of this tree at another ISA level) are built beside ours
and timed in alternating rounds in the same process (ratio = baseline time / our time). The ISA
level in use is printed first (RWKV_ENGINE_ISA picks another). `--resident` times one copy of each
weight (L3-resident for all but the head) with 20 times the rounds, one call each, for the
kernels' compute speed rather than the memory stream.

K-quant prefill (`--only kprefill`): KQuantLinear's two prefill paths, the integer kernel (8 rows
of x per pass) and dequantized tiles + torch's GEMM (fp32, or bf16 with bf16 matrix
instructions), on Q4_K / Q6_K weights, x [T, K] for T = 64 and --prefill-tokens, in alternating
calls (best of 4x the rounds); with --threads 1 the time is the thread's CPU time, which the other
jobs of a shared machine do not inflate. The module takes the integer path where the GEMM is
fp32 (quant/kquant_linear.py).

Step (`--only step --model PATH`): whole decode steps of a model at each of `--batches`, with
`--baseline` switching between the two builds every step (the same weights in the same memory).

Machines are shared and noisy: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rwkv_engine.kernels import native  # noqa: E402
from rwkv_engine.kernels.native import build  # noqa: E402
from rwkv_engine.quant import linear as QL  # noqa: E402

# RWKV-5 World 1.5B: n_embd 2048, ffn 7168, vocab 65536; (out_features, in_features).
SHAPES = {
    "att/ffn.r 2048x2048": (2048, 2048),
    "ffn.key 7168x2048": (7168, 2048),
    "ffn.value 2048x7168": (2048, 7168),
    "head 65536x2048": (65536, 2048),
}
# Per layer: att key/value/receptance/gate/output + ffn receptance (2048x2048), ffn key, ffn value.
PER_LAYER = {"att/ffn.r 2048x2048": 6, "ffn.key 7168x2048": 1, "ffn.value 2048x7168": 1}
N_LAYER = 24
FLUSH_BYTES = 96 << 20  # each timed pass touches at least this much weight memory (3x L3)


def best_of_rounds(fns: dict, rounds: int) -> dict:
    """Seconds per pass for each entry: fns maps a name to a list of calls (one per weight copy).

    Rounds alternate between the entries; each call is timed on its own and keeps its best time
    over the rounds (a short call is rarely interrupted, so the best is the unloaded time on a
    shared machine); an entry's time is the sum over its calls.
    """
    best = {k: [float("inf")] * len(v) for k, v in fns.items()}
    for calls in fns.values():
        for f in calls:
            f()  # warm-up
    for _ in range(rounds):
        for k, calls in fns.items():
            b = best[k]
            for i, f in enumerate(calls):
                t0 = time.perf_counter()
                f()
                t = time.perf_counter() - t0
                if t < b[i]:
                    b[i] = t
    return {k: sum(v) for k, v in best.items()}


def copies_for(nbytes: int) -> int:
    return max(1, -(-FLUSH_BYTES // max(1, nbytes)))


def make_tensors(fmt: str, N: int, K: int) -> dict:
    """Random weight tensors of one format, ours and the torch peer's (values do not matter)."""
    g = torch.Generator().manual_seed(N + K)
    if fmt in ("fp32", "bf16", "fp16"):
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
        return {"w": (torch.randn(N, K, generator=g) / K**0.5).to(dt)}
    if fmt.startswith("int8"):
        G = 1 if fmt == "int8" else K // int(fmt.split("g")[1])
        s = (torch.rand(N, G, generator=g) * 0.01).half()
        return {
            "q": torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g),
            "s": s,
            "s_peer": s[:, 0].to(torch.bfloat16).contiguous(),
        }
    if fmt.startswith("int4"):
        gs = int(fmt.split("g")[1])
        codes = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=g)
        s = (torch.rand(N, K // gs, generator=g) * 0.01).half()
        z = (-8 * s.float()).half()
        return {
            "q": (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous(),
            "s": s,
            "z": z,
            "peer_w": torch._convert_weight_to_int4pack_for_cpu(codes, 1),
            "peer_sz": torch.stack([s.float().T, (z.float() + 8 * s.float()).T], dim=-1)
            .to(torch.bfloat16)
            .contiguous(),
        }
    if fmt in ("q4_k", "q5_k", "q6_k"):  # ggml's K-quant blocks from the test quantizer
        from rwkv_engine.testing.ggml_writers import quantize

        return {"kq": torch.from_numpy(quantize((torch.randn(N, K, generator=g) / K**0.5).numpy(), fmt.upper()))}
    raise ValueError(f"unknown format {fmt!r}")


def x_dtype(fmt: str) -> torch.dtype:
    return {"fp32": torch.float32, "fp16": torch.float16}.get(fmt, torch.bfloat16)


def weight_nbytes(fmt: str, t: dict) -> int:
    """Bytes our kernel reads per call (weights + scales)."""
    return sum(v.numel() * v.element_size() for k, v in t.items() if k in ("w", "q", "s", "z", "kq"))


@functools.cache
def _q8_half_scales(ops) -> bool:
    """Whether this build's gemv_q8 takes fp16 scales (fp32 before 306892d: a --baseline build)."""
    try:
        ops.gemv_q8(torch.zeros(1, 64), torch.zeros(1, 64, dtype=torch.int8), torch.ones(1, 1).half())
        return True
    except RuntimeError:
        return False


_KQ_IDS = {"q4_k": 12, "q5_k": 13, "q6_k": 14}


def run_ours(fmt: str, ops, x, t):
    if fmt in _KQ_IDS:
        return ops.gemv_kq(x, t["kq"], _KQ_IDS[fmt], x.shape[1])
    if fmt.startswith("int8"):
        return ops.gemv_q8(x, t["q"], t["s"] if _q8_half_scales(ops) else t["s"].float())
    if fmt.startswith("int4"):
        return ops.gemv_q4(x, t["q"], t["s"], t["z"])
    return ops.gemv_dense(x, t["w"])


def run_peer(fmt: str, x, t):
    if fmt in _KQ_IDS:  # torch has no K-quant kernel: its int4 GEMV of the same shape
        if "peer" not in t:
            t["peer"] = make_tensors("int4g32", t["kq"].shape[0], x.shape[1])
        return run_peer("int4g32", x, t["peer"])
    if fmt.startswith("int8"):
        return torch._weight_int8pack_mm(x, t["q"], t["s_peer"])
    if fmt.startswith("int4"):
        return torch._weight_int4pack_mm_for_cpu(x, t["peer_w"], int(fmt.split("g")[1]), t["peer_sz"])
    return F.linear(x, t["w"])


def _warm_up(ops, seconds: float = 0.5):
    """Run both libraries' kernels for a moment first (thread pools, clocks): the first timed
    entry was otherwise consistently slower."""
    w = torch.randn(4096, 2048)
    x = torch.randn(1, 2048)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        F.linear(x, w)
        ops.gemv_dense(x, w)


def weight_copies(fmt, N, K):
    """Enough copies of one (N, K) weight in `fmt` that a pass over them flushes the L3 cache,
    and the bytes of one."""
    first = make_tensors(fmt, N, K)
    nbytes = weight_nbytes(fmt, first)
    return [first] + [{k: v.clone() for k, v in first.items()} for _ in range(1, copies_for(nbytes))], nbytes


def bench_decode(ops, formats, shapes, rounds, batch=1):
    print(f"\n## Decode GEMV, x [{batch}, K], {torch.get_num_threads()} threads (best of {rounds} rounds)\n")
    print("| shape | format | torch GB/s | ours GB/s | torch Gw/s | ours Gw/s | ours/torch speed |")
    print("|---|---|---|---|---|---|---|")
    times = {}
    for sname, (N, K) in shapes.items():
        for fmt in formats:
            items, nbytes = weight_copies(fmt, N, K)
            n = len(items)
            x = torch.randn(batch, K).to(x_dtype(fmt))
            t = best_of_rounds(
                {
                    "torch": [lambda it=it: run_peer(fmt, x, it) for it in items],
                    "ours": [lambda it=it: run_ours(fmt, ops, x, it) for it in items],
                },
                rounds,
            )
            tt, to = t["torch"] / n, t["ours"] / n
            times[(sname, fmt)] = {"torch": tt, "ours": to}
            print(
                f"| {sname} | {fmt} | {nbytes / tt / 1e9:.1f} | {nbytes / to / 1e9:.1f} | "
                f"{N * K / tt / 1e9:.1f} | {N * K / to / 1e9:.1f} | {tt / to:.2f} |",
                flush=True,
            )
            del items
    return times


class AtLevel:
    """The kernel module with the kernels of one library: each attribute access switches to them
    first (a baseline and ours may share one bindings module; a switch costs microseconds)."""

    def __init__(self, ops, lib: Path):
        self.ops, self.lib = ops, str(lib)

    def __getattr__(self, name):
        self.ops.use_kernels(self.lib)
        return getattr(self.ops, name)


def load_baseline(spec: str, ops):
    """(baseline, ours) for --baseline: `isa:LEVEL` is this tree's kernels at another ISA level;
    anything else a git revision, whose kernels are built beside ours (at the level in use when
    the revision has ISA levels, else as its own extension with the AVX2 flags)."""
    ours = AtLevel(ops, native.build_kernels(ops.isa()))
    if spec.startswith("isa:"):
        return AtLevel(ops, native.build_kernels(spec[4:])), ours
    root = Path(__file__).resolve().parents[1]
    sub = "rwkv_engine/kernels/native"
    files = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{spec}:{sub}"], cwd=root, check=True, capture_output=True, text=True
    ).stdout.split()
    srcs = {
        f: subprocess.run(["git", "show", f"{spec}:{sub}/{f}"], cwd=root, check=True, capture_output=True).stdout
        for f in files
        if f.endswith((".cpp", ".h"))
    }
    h = hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(srcs.items()))).hexdigest()[:12]
    d = Path(tempfile.gettempdir()) / f"rwkv_engine_native_base_{h}"
    d.mkdir(exist_ok=True)
    for f, b in srcs.items():
        (d / f).write_bytes(b)
    if "api.h" in srcs:
        return AtLevel(ops, native.build_kernels(ops.isa(), src=d)), ours
    from torch.utils import cpp_extension

    base = cpp_extension.load(
        name=f"rwkv_engine_native_base_{h}",
        sources=[str(d / f) for f in srcs if f.endswith(".cpp")],
        extra_cflags=list(build._CFLAGS) + list(native.level("avx2").flags),
        extra_ldflags=list(build._LDFLAGS),
    )
    return base, ours


BATCH_FORMATS = "fp32,bf16,int8g64,int4g32"


def bench_batch(ops, base, formats, shapes, batches, rounds, resident=False):
    """GMAC/s of our GEMVs by rows of x, and against a baseline build when given; `resident`: one
    copy of each weight (cache-resident), 20x the rounds."""
    who = {"ours": ops} if base is None else {"base": base, "ours": ops}
    rounds = rounds * 20 if resident else rounds
    print(
        f"\n## Batched GEMV, x [B, K], {torch.get_num_threads()} threads, GMAC/s = B*N*K / time, weights "
        f"{'cache-resident' if resident else 'streamed from memory'} "
        f"(best of {rounds} rounds{', alternating with the baseline' if base else ''})\n"
    )
    cols = [f"{w} GMAC/s" for w in who] + [f"{w} GB/s" for w in who] + (["base/ours time"] if base else [])
    print("| shape | format | B | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for sname, (N, K) in shapes.items():
        for fmt in formats:
            items, nbytes = weight_copies(fmt, N, K)
            items = items[:1] if resident else items
            n = len(items)
            for B in batches:
                x = torch.randn(B, K).to(x_dtype(fmt))
                t = best_of_rounds(
                    {w: [lambda it=it, m=m: run_ours(fmt, m, x, it) for it in items] for w, m in who.items()}, rounds
                )
                t = {w: v / n for w, v in t.items()}
                cells = [f"{B * N * K / t[w] / 1e9:.1f}" for w in who] + [f"{nbytes / t[w] / 1e9:.1f}" for w in who]
                if base:
                    cells.append(f"{t['base'] / t['ours']:.2f}")
                print(f"| {sname} | {fmt} | {B} | " + " | ".join(cells) + " |", flush=True)
            del items


def token_estimate(times, formats):
    """tok/s of a whole 1.5B decode (weights only) from the per-shape times."""
    if not all((s, f) in times for s in SHAPES for f in formats):
        return
    print("\n## Estimated 1.5B decode, matrices only (24 layers x 8 + head)\n")
    print("| scheme (body / head) | torch tok/s | ours tok/s |")
    print("|---|---|---|")
    plans = [
        ("fp32", "fp32"),
        ("bf16", "bf16"),
        ("fp16", "fp16"),
        ("int8", "int8"),
        ("int8g128", "int8g128"),
        ("int4g32", "int8"),
        ("int4g64", "int8"),
        ("int4g128", "int8"),
        ("int4g32", "bf16"),
        ("int4g32", "int4g32"),
    ]
    for body, head in plans:
        if body not in formats or head not in formats:
            continue
        row = []
        for who in ("torch", "ours"):
            t = N_LAYER * sum(c * times[(s, body)][who] for s, c in PER_LAYER.items())
            t += times[("head 65536x2048", head)][who]
            row.append(1.0 / t)
        print(f"| {body} / {head} | {row[0]:.1f} | {row[1]:.1f} |")


def bench_crossover(ops, rounds):
    print("\n## GEMV vs dequantized-tile GEMM by rows of x (7168x2048, bf16 x, ms per call)\n")
    N, K = 7168, 2048
    w = torch.randn(N, K) / K**0.5
    mods = {
        "bf16 DenseLinear": QL.DenseLinear.from_linear(_lin(w), torch.bfloat16),
        "int8g128": QL.Int8Linear.from_weight(w, 128),
        "int4g32": QL.Int4Linear.from_weight(w, 32, search=False),
    }
    print("| rows | " + " | ".join(f"{k} gemv | {k} tiles+GEMM" for k in mods) + " |")
    print("|---|" + "---|---|" * len(mods))
    for M in (1, 2, 4, 8, 12, 16, 32):
        x = torch.randn(M, K).bfloat16()
        cells = []
        for _name, m in mods.items():
            if isinstance(m, QL.DenseLinear):
                fns = {"gemv": [lambda: ops.gemv_dense(x, m.weight)], "gemm": [lambda: _dense_prefill(m, x)]}
            else:
                fns = {"gemv": [lambda: m._gemv(ops, x)], "gemm": [lambda: m._prefill(ops, x)]}
            t = best_of_rounds(fns, max(5, rounds // 3))
            cells += [f"{t['gemv'] * 1e3:.2f}", f"{t['gemm'] * 1e3:.2f}"]
        print(f"| {M} | " + " | ".join(cells) + " |")


def _dense_prefill(m, x):
    """DenseLinear's path for many rows (forced, whatever the row count)."""
    old = QL.GEMV_MAX_ROWS
    QL.GEMV_MAX_ROWS = 0
    try:
        return m(x)
    finally:
        QL.GEMV_MAX_ROWS = old


def _lin(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    return lin


def bench_prefill(ops, T, rounds):
    print(
        f"\n## Prefill GEMM, x [{T}, K] bf16 (fp32 for torch fp32), GFLOP/s (best of {rounds}); "
        f"ratio = our speed / torch's (fp32 F.linear for int8 / int4)\n"
    )
    print(f"prefill compute dtype for bf16 x here: {QL.prefill_dtype(torch.bfloat16)}\n")
    print(
        "| shape | torch fp32 | torch bf16 | torch int8pack | torch int4pack g32 | ours bf16 DenseLinear | ours int8g128 | ours int4g32 "
        "| ratio bf16 (vs torch bf16) | ratio int8 | ratio int4 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for sname in ("att/ffn.r 2048x2048", "ffn.key 7168x2048"):
        N, K = SHAPES[sname]
        w = torch.randn(N, K) / K**0.5
        wb = w.bfloat16()
        dl = QL.DenseLinear.from_linear(_lin(w), torch.bfloat16)
        q8 = QL.Int8Linear.from_weight(w, 128)
        q4 = QL.Int4Linear.from_weight(w, 32, search=False)
        codes = torch.randint(0, 16, (N, K), dtype=torch.int32)
        p4 = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        sz = torch.rand(K // 32, N, 2).bfloat16()
        q8pc = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        s8 = torch.rand(N).bfloat16()
        x = torch.randn(T, K)
        xb = x.bfloat16()
        fns = {
            "fp32": [lambda: F.linear(x, w)],
            "bf16": [lambda: F.linear(xb, wb)],
            "int8pack": [lambda: torch._weight_int8pack_mm(xb, q8pc, s8)],
            "int4pack": [lambda: torch._weight_int4pack_mm_for_cpu(xb, p4, 32, sz)],
            "dense": [lambda: dl(xb)],
            "q8": [lambda: q8(xb)],
            "q4": [lambda: q4(xb)],
        }
        t = best_of_rounds(fns, rounds)
        flop = 2 * T * N * K
        g = {k: flop / v / 1e9 for k, v in t.items()}
        print(
            f"| {sname} | {g['fp32']:.0f} | {g['bf16']:.0f} | {g['int8pack']:.0f} | {g['int4pack']:.0f} | "
            f"{g['dense']:.0f} | {g['q8']:.0f} | {g['q4']:.0f} | {t['bf16'] / t['dense']:.2f} | "
            f"{t['fp32'] / t['q8']:.2f} | {t['fp32'] / t['q4']:.2f} |"
        )


def bench_kquant_prefill(ops, T, rounds):
    """KQuantLinear's prefill paths: the integer kernel against dequantized tiles + GEMM."""
    from rwkv_engine.quant.kquant_linear import KQuantLinear
    from rwkv_engine.testing.ggml_writers import quantize

    one = torch.get_num_threads() == 1
    clock = time.thread_time if one else time.perf_counter
    print(
        f"\n## K-quant prefill, x [T, K] bf16, GFLOP/s, {'thread CPU time' if one else 'wall time'}, best of "
        f"{4 * rounds} alternating calls; GEMM dtype here {QL.prefill_dtype(torch.bfloat16)}; the module "
        f"takes the integer kernel where that is fp32\n"
    )
    print("| shape | type | T | integer kernel | tiles + GEMM | integer / tiles time |")
    print("|---|---|---|---|---|---|")
    for sname in ("att/ffn.r 2048x2048", "ffn.key 7168x2048"):
        N, K = SHAPES[sname]
        w = torch.randn(N, K) / K**0.5
        for qtype in ("Q4_K", "Q6_K"):
            m = KQuantLinear.from_blocks(qtype, torch.from_numpy(quantize(w.numpy(), qtype)), (N, K))
            for t_rows in sorted({64, T}):
                x = torch.randn(t_rows, K).bfloat16()
                fns = {"int": lambda: m._gemv(ops, x), "tiles": lambda: QL._QuantLinearBase._prefill(m, ops, x)}
                best = {k: float("inf") for k in fns}
                for _ in range(4 * rounds):
                    for k, f in fns.items():
                        t0 = clock()
                        f()
                        best[k] = min(best[k], clock() - t0)
                g = {k: 2 * t_rows * N * K / v / 1e9 for k, v in best.items()}
                print(
                    f"| {sname} | {qtype} | {t_rows} | {g['int']:.1f} | {g['tiles']:.1f} | "
                    f"{best['int'] / best['tiles']:.2f} |",
                    flush=True,
                )


def bench_errors():
    """Relative RMS output error of each weight format on heavy-tailed random weights."""
    from rwkv_engine.quant import primitives as P
    from rwkv_engine.testing import random_state_dict

    sd = random_state_dict("5.2", n_layer=1, n_embd=2048, vocab_size=16384, head_size=64, outliers=True, seed=0)
    mats = {
        "att.key 2048x2048": sd["blocks.0.att.key.weight"],
        "ffn.value 2048x7168": sd["blocks.0.ffn.value.weight"],
        "head 16384x2048": sd["head.weight"],
    }
    del sd

    def col(f):  # the same format on weight / column scales, as the modules store it
        def run(w):
            c = P.column_scales(w)
            return f(w / c.float()) * c.float()

        return run

    fmts = {
        "bf16": lambda w: w.bfloat16().float(),
        "fp16": lambda w: w.half().float(),
        "int8 per channel": lambda w: P.dequantize_int8(*P.quantize_int8(w)),
        "int8 g128": lambda w: P.dequantize_int8(*P.quantize_int8(w, 128)),
        "int8 g32": lambda w: P.dequantize_int8(*P.quantize_int8(w, 32)),
        "int4 g32 symmetric": lambda w: P.dequantize_int4(*P.quantize_int4(w, 32, symmetric=True)),
        "int4 g32 no search": lambda w: P.dequantize_int4(*P.quantize_int4(w, 32, search=False)),
        "int4 g32": lambda w: P.dequantize_int4(*P.quantize_int4(w, 32)),
        "int4 g64": lambda w: P.dequantize_int4(*P.quantize_int4(w, 64)),
        "int4 g128": lambda w: P.dequantize_int4(*P.quantize_int4(w, 128)),
    }
    for name in ("int8 per channel", "int8 g128", "int4 g32", "int4 g64", "int4 g128"):
        fmts[name + " + col scales (module default)"] = col(fmts[name])
    print(
        "\n## Quantization error: relative RMS of x @ W^T, heavy-tailed random weights "
        "(testing.random_state_dict(outliers=True)), x ~ N(0, 1) [32, K]\n"
    )
    print("| format | bytes/weight | " + " | ".join(mats) + " |")
    print("|---|---|" + "---|" * len(mats))
    bpw = {
        "bf16": 2,
        "fp16": 2,
        "int8 per channel": 1.0,
        "int8 g128": 1 + 4 / 128,
        "int8 g32": 1 + 4 / 32,
        "int4 g32 symmetric": 0.5 + 2 / 32,
        "int4 g32 no search": 0.5 + 4 / 32,
        "int4 g32": 0.5 + 4 / 32,
        "int4 g64": 0.5 + 4 / 64,
        "int4 g128": 0.5 + 4 / 128,
    }
    for name in list(bpw):
        bpw[name + " + col scales (module default)"] = bpw[name]  # + 2 bytes per column: negligible
    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(32, w.shape[1], generator=g) for k, w in mats.items()}
    refs = {k: xs[k] @ w.T for k, w in mats.items()}
    for name, f in fmts.items():
        cells = []
        for k, w in mats.items():
            y = xs[k] @ f(w).T
            cells.append(f"{((y - refs[k]).square().mean() / refs[k].square().mean()).sqrt().item():.4f}")
        print(f"| {name} | {bpw[name]:.3f} | " + " | ".join(cells) + " |", flush=True)


def bench_step(ours, base, model_path: str, batches, steps: int):
    """Whole decode steps of a model (bf16 activations), ours against a baseline build when given:
    the kernels switch every step, so both run on the same weights in the same memory (on a VM,
    fresh memory reads at speeds that differ from one process to the next, which decides
    separate runs' decode speed more than a kernel change does)."""
    import rwkv_engine

    model = rwkv_engine.load(model_path, dtype="bf16")
    sides = {"ours": ours} | ({"baseline": base} if base is not None else {})
    print(
        f"\n## Decode steps of {Path(model_path).name}, bf16 activations ({steps} steps per side, "
        f"{'alternating with the baseline every step' if base is not None else 'ours only'})\n"
    )
    print(
        "| B | "
        + " | ".join(f"{k} ms/step (quartiles)" for k in sides)
        + " | "
        + ("baseline / ours |" if base is not None else "tok/s |")
    )
    print("|---|" + "---|" * (len(sides) + 1))
    for B in batches:
        tok = torch.randint(1, 200, (B, 1))
        _, state = model.forward(tok)
        times = {k: [] for k in sides}
        for i in range(steps + 2):
            for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                sides[name].isa()  # with a baseline, switches to that side's kernels (AtLevel)
                t = time.perf_counter()
                _, state = model.forward(tok, state)
                if i >= 2:
                    times[name].append(time.perf_counter() - t)
        q = {k: statistics.quantiles(v, n=4) for k, v in times.items()}
        cells = [f"{q[k][1] * 1e3:.1f} ({q[k][0] * 1e3:.1f}-{q[k][2] * 1e3:.1f})" for k in sides]
        last = f"{q['baseline'][1] / q['ours'][1]:.3f}" if base is not None else f"{B / q['ours'][1]:.1f}"
        print(f"| {B} | " + " | ".join(cells) + f" | {last} |", flush=True)


SECTIONS = ("decode", "crossover", "prefill", "errors", "batch", "step", "kprefill")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="decode only, 10 rounds, no head shape")
    ap.add_argument("--formats", help=f"comma list (default: all for decode, {BATCH_FORMATS} for batch)")
    ap.add_argument("--batch", type=int, default=1, help="rows of x in the decode table")
    ap.add_argument("--batches", default="1,4,8", help="rows of x in the batch table")
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="batch table: also time the kernels of this git revision, or of this tree at another ISA level (isa:avx2)",
    )
    ap.add_argument(
        "--resident",
        action="store_true",
        help="batch table: one copy of each weight (in cache) instead of enough to stream from memory",
    )
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument(
        "--model",
        help="step section: a checkpoint or converted directory (e.g. one that "
        "bench_engine.py or bench_peers.py wrote)",
    )
    ap.add_argument("--steps", type=int, default=60, help="step section: timed decode steps per side and batch")
    ap.add_argument(
        "--only",
        default=",".join(s for s in SECTIONS if s not in ("batch", "step", "kprefill")),
        help=f"comma list of sections, from {','.join(SECTIONS)} (default: all but batch, step and kprefill)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = native.load()
    if ops is None:
        print("native kernels unavailable on this machine (see the log); nothing to compare")
        return 1
    print(
        f"torch {torch.__version__}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"native ISA level {ops.isa()}"
    )
    rounds = 10 if args.quick else args.rounds
    only = set(filter(None, args.only.split(",")))
    if not only <= set(SECTIONS):
        ap.error(f"--only: unknown sections {sorted(only - set(SECTIONS))}")
    args.formats_given = args.formats is not None
    formats = (args.formats or "fp32,bf16,fp16,int8,int8g128,int4g32,int4g64,int4g128").split(",")
    shapes = {k: v for k, v in SHAPES.items() if not (args.quick and k.startswith("head"))}
    if "step" in only and not (args.model and Path(args.model).exists()):
        ap.error(f"--only step needs --model, an existing checkpoint or directory (got {args.model!r})")
    _warm_up(ops)
    base, ours = load_baseline(args.baseline, ops) if args.baseline else (None, ops)
    if "step" in only:
        bench_step(ours, base, args.model, [int(b) for b in args.batches.split(",")], args.steps)
    if "batch" in only:
        fmts = args.formats.split(",") if args.formats_given else BATCH_FORMATS.split(",")
        bench_batch(ours, base, fmts, shapes, [int(b) for b in args.batches.split(",")], rounds, args.resident)
    if "decode" in only:
        times = bench_decode(ops, formats, shapes, rounds, args.batch)
        if args.batch == 1:
            token_estimate(times, formats)
    if "crossover" in only and not args.quick:
        bench_crossover(ops, rounds)
    if "prefill" in only and not args.quick:
        bench_prefill(ops, args.prefill_tokens, max(3, rounds // 6))
    if "kprefill" in only:
        bench_kquant_prefill(ops, args.prefill_tokens, max(3, rounds // 3))
    if "errors" in only and not args.quick:
        bench_errors()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
