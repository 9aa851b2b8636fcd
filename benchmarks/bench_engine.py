"""Prefill and decode speed of rwkv-engine beside the reference `rwkv` package, in one run.

    python benchmarks/bench_engine.py                      # RWKV-5.2 World 1.5B shape, fp32 and bf16
    python benchmarks/bench_engine.py --quant q8,q4        # plus our int8 / int4 (converted dirs)
    python benchmarks/bench_engine.py --version 7 --engines rwkv-engine --dtypes "" --quant q4,q4k --rounds 4
                                                           # q4k against q4 alone (ratios to the first)
    python benchmarks/bench_engine.py --version 4 --dtypes bf16
    python benchmarks/bench_engine.py --small              # a quick 0.1B-shape smoke run

A random-weight checkpoint of the real shape is written once (bf16 .pth, as the official files
are) into --workdir; `--quant` schemes are converted from it once (`rwkv-engine convert`, bf16
activations). Each configuration then runs in a fresh subprocess so that its peak RSS is its
own, and the configurations take turns for `--rounds` rounds: the medians compare runs that saw
the same drift of a noisy machine (every other round in reverse order). Ratios are to the `rwkv` package in the same dtype, and for
quantized rows to `rwkv` bf16 (the issue's targets are written that way); with several --quant
schemes, each also to the first one. The table also shows
the memory read bandwidth of the machine and the batch-1 decode speed it allows for each row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    # name: (n_layer, n_embd, vocab)
    "1.5B": (24, 2048, 65536),
    "0.4B": (24, 1024, 65536),
    "0.1B": (12, 768, 65536),
}


def make_checkpoint(path: Path, version: str, shape: str) -> None:
    import torch

    from rwkv_engine import testing

    if path.exists():
        return
    L, C, V = SHAPES[shape]
    print(f"writing a random RWKV-{version} {shape} checkpoint to {path} ...", file=sys.stderr, flush=True)
    sd = testing.random_state_dict(version, n_layer=L, n_embd=C, vocab_size=V, head_size=64)
    sd = testing.cast(sd, torch.bfloat16)
    tmp = path.with_suffix(".tmp")
    torch.save(sd, tmp)
    os.replace(tmp, path)


def run_one(engine: str, ckpt: str, dtype: str, prompt_len: int, decode: int, threads: int, version: str) -> dict:
    """Runs in the child process: load, prefill `prompt_len` tokens, decode `decode` tokens."""
    import torch

    torch.set_num_threads(threads)
    prompt = [(i * 7919) % 60000 + 1 for i in range(prompt_len)]
    t0 = time.perf_counter()
    if engine == "rwkv-engine":
        import rwkv_engine

        model = rwkv_engine.load(ckpt, dtype=None if Path(ckpt).is_dir() else dtype, progress=False)
        load_s = time.perf_counter() - t0

        def prefill():
            return model.forward(prompt)

        def step(tok, state):
            return model.forward([tok], state)
    else:
        if version == "7":
            os.environ["RWKV_V7_ON"] = "1"  # the package's RWKV-7 code path (a process-wide switch)
        os.environ.setdefault("RWKV_JIT_ON", "1")
        os.environ.setdefault("RWKV_CUDA_ON", "0")
        from rwkv.model import RWKV

        kwargs = {} if version == "7" else {"verbose": False}  # (its RWKV-7 class takes no verbose)
        model = RWKV(ckpt.removesuffix(".pth"), f"cpu {dtype}", **kwargs)
        load_s = time.perf_counter() - t0

        def prefill():
            return model.forward(prompt, None)

        def step(tok, state):
            return model.forward([tok], state)

    warm = prompt[:16]
    model.forward(warm, None) if engine != "rwkv-engine" else model.forward(warm)  # JIT, allocator
    t = time.perf_counter()
    logits, state = prefill()
    prefill_s = time.perf_counter() - t
    tok = int(logits.argmax())
    for _ in range(3):  # warm up decode
        logits, state = step(tok, state)
    steps = []
    for _ in range(decode):
        t = time.perf_counter()
        logits, state = step(tok, state)
        steps.append(time.perf_counter() - t)
        tok = int(logits.argmax())
    from rwkv_engine.cli.bench import peak_rss_mb

    weights = None
    if engine == "rwkv-engine":
        from rwkv_engine.cli.bench import weight_bytes_per_step

        weights = weight_bytes_per_step(model)
    return {
        "engine": engine,
        "dtype": dtype,
        "weight_bytes": weights,
        "load_s": round(load_s, 2),
        "prefill_tok_s": round(prompt_len / prefill_s, 2),
        "decode_tok_s": round(1 / statistics.median(steps), 2),
        "peak_rss_mb": round(peak_rss_mb()),
    }


def converted_dir(work: Path, ckpt: Path, scheme: str, dtype: str = "bf16") -> Path:
    """`rwkv-engine convert` of ckpt with `scheme` and activation `dtype`, once, into work. The
    name carries a hash of the quantization code, so a change of format or policy converts anew."""
    code = Path(__file__).resolve().parents[1] / "rwkv_engine"
    sources = sorted((code / "quant").glob("*.py")) + sorted((code / "loading").glob("*.py"))
    stamp = hashlib.sha1(b"".join(p.read_bytes() for p in sources)).hexdigest()[:8]
    out = work / (f"{ckpt.stem}-{scheme}" + ("" if dtype == "bf16" else f"-{dtype}") + f"-{stamp}")
    if not out.exists():
        print(f"converting {ckpt.name} to {scheme} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "rwkv_engine", "convert", str(ckpt), str(out), "-q", scheme, "--dtype", dtype]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="5.2", choices=["4", "5.2", "7"])
    ap.add_argument("--shape", default="1.5B", choices=sorted(SHAPES))
    ap.add_argument("--small", action="store_true", help="shortcut for --shape 0.1B --prompt-len 128 --decode 16")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--quant", default="", help="our quantization schemes to add, e.g. q8,q4 (bf16 activations)")
    ap.add_argument("--engines", default="rwkv,rwkv-engine")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="runs of every configuration, taking turns (medians)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--workdir", default="/tmp/rwkv-engine-bench")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        engine, ckpt, dtype = args.child.split("|")
        print(json.dumps(run_one(engine, ckpt, dtype, args.prompt_len, args.decode, args.threads, args.version)))
        return
    if args.small:
        args.shape, args.prompt_len, args.decode = "0.1B", 128, 16
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"rwkv{args.version}-{args.shape}-bf16.pth"
    make_checkpoint(ckpt, args.version, args.shape)

    # (label, engine, model path, dtype)
    configs = [(f"{e} {d}", e, str(ckpt), d) for d in args.dtypes.split(",") if d for e in args.engines.split(",")]
    configs += [
        (f"rwkv-engine {q}", "rwkv-engine", str(converted_dir(work, ckpt, q)), q) for q in args.quant.split(",") if q
    ]
    runs: dict[str, list[dict]] = {label: [] for label, *_ in configs}
    for rnd in range(args.rounds):
        # Every other round runs the configurations in reverse order, and each run starts after a
        # pause: the kernel is still reclaiming a finished run's memory for a few seconds, and the
        # run right after a big one would pay for it.
        for label, engine, path, dtype in configs if rnd % 2 == 0 else configs[::-1]:
            time.sleep(5)
            cmd = [
                sys.executable,
                __file__,
                "--child",
                f"{engine}|{path}|{dtype}",
                "--prompt-len",
                str(args.prompt_len),
                "--decode",
                str(args.decode),
                "--threads",
                str(args.threads),
                "--version",
                args.version,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{label} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(label, json.dumps(runs[label][-1]), file=sys.stderr, flush=True)

    import torch

    from rwkv_engine.cli.bench import read_bandwidth_gb_s

    torch.set_num_threads(args.threads)
    bw = read_bandwidth_gb_s()
    med = {
        label: {k: statistics.median(r[k] for r in rs) for k in ("load_s", "prefill_tok_s", "decode_tok_s")}
        | {"peak_rss_mb": max(r["peak_rss_mb"] for r in rs), "weight_bytes": rs[0]["weight_bytes"]}
        for label, rs in runs.items()
        if rs
    }
    print(
        f"\nRWKV-{args.version} {args.shape} shape, prompt {args.prompt_len} tokens, {args.threads} threads, "
        f"median of {args.rounds} round(s); memory read {bw:.1f} GB/s\n"
    )
    print(
        "| engine | load s | prefill tok/s | decode tok/s | peak RSS MB | weights/token MB | decode bound tok/s "
        "| prefill x ref | decode x ref |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, engine, _, dtype in configs:
        if label not in med:
            continue
        r = med[label]
        base = med.get(f"rwkv {dtype}") or (med.get("rwkv bf16") if dtype not in ("fp32", "bf16", "fp16") else None)
        px = f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}" if base and engine != "rwkv" else "-"
        dx = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}" if base and engine != "rwkv" else "-"
        wb = r["weight_bytes"]
        wcols = f"{wb / 1e6:.0f} | {bw * 1e9 / wb:.1f}" if wb else "- | -"
        print(
            f"| {label} | {r['load_s']:.1f} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} | "
            f"{r['peak_rss_mb']:.0f} | {wcols} | {px} | {dx} |"
        )
    # Our schemes against the first of --quant (e.g. --quant q4,q4k: q4k's decode over q4's), from
    # the same alternating rounds.
    quants = [f"rwkv-engine {q}" for q in args.quant.split(",") if q and f"rwkv-engine {q}" in med]
    for label in quants[1:]:
        a, b = med[label], med[quants[0]]
        print(
            f"{label} / {quants[0]}: decode {a['decode_tok_s'] / b['decode_tok_s']:.2f}x, "
            f"prefill {a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x, "
            f"weights read {a['weight_bytes'] / b['weight_bytes']:.2f}x"
        )


if __name__ == "__main__":
    main()
