"""ExecuTorch programs against the engine: .pte size, export time and peak memory, decode / prefill tok/s.

    python benchmarks/bench_export.py                                 # the 1.5B shape, RWKV-5.2 and 7, q4
    python benchmarks/bench_export.py --n-layer 6 --n-embd 1024       # a smaller shape

For each version: a random-weight checkpoint of the shape is written to a scratch directory; the
export runs in a child process (its peak RSS is the export's memory); then the program (through
executorch.runtime) and the engine (the same checkpoint, quantized by the engine's own scheme of
the same name; bf16 for fp32, the checkpoint's type) run in this process, in alternating rounds, at --threads threads
each: decode tok/s over --decode steps and prefill tok/s over --prefill-pieces pieces of the
program's T. Timings on a shared machine are rough: compare the ratio, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import rwkv_engine
from rwkv_engine import testing

_EXPORT = """
import json, resource, sys, time
import rwkv_engine
from rwkv_engine.export import export_program
path, out, q, T = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
model = rwkv_engine.load(path, dtype="fp32", progress=False)
report = export_program(model, out, quantization=q, prefill_len=T)
print(json.dumps({"seconds": time.perf_counter() - t0, "export_seconds": report.seconds, "bytes": report.bytes,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _rate(fn, tokens: int) -> float:
    t0 = time.perf_counter()
    fn()
    return tokens / (time.perf_counter() - t0)


def bench(version: str, args, scratch: Path) -> dict:
    # bf16, as the official checkpoints are: the export reads it into fp32, the engine keeps bf16
    sd = testing.cast(
        testing.random_state_dict(
            version, n_layer=args.n_layer, n_embd=args.n_embd, vocab_size=args.vocab, head_size=64, seed=0
        ),
        torch.bfloat16,
    )
    ckpt = testing.save_pth(sd, scratch / f"v{version}.pth")
    del sd
    pte = scratch / f"v{version}-{args.quantization}.pte"
    proc = subprocess.run(
        [sys.executable, "-c", _EXPORT, str(ckpt), str(pte), args.quantization, str(args.prefill_len)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"export failed:\n{proc.stderr[-3000:]}")
    exp = json.loads(proc.stdout.strip().splitlines()[-1])

    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    _unsafe_reset_threadpool(args.threads)
    torch.set_num_threads(args.threads)
    program = rwkv_engine.load(pte)
    engine = rwkv_engine.load(
        ckpt, quantization=None if args.quantization == "fp32" else args.quantization, progress=False
    )
    T = args.prefill_len
    prompt = [(i * 7919) % args.vocab for i in range(T * args.prefill_pieces)]
    rates = {"program": {"decode": [], "prefill": []}, "engine": {"decode": [], "prefill": []}}
    for _ in range(args.rounds):
        for name, model in (("program", program), ("engine", engine)):
            model.forward(prompt[:T])  # warm-up
            state = None

            def prefill():
                nonlocal state
                _, state = model.forward(prompt)

            rates[name]["prefill"].append(_rate(prefill, len(prompt)))

            def decode():
                s = state
                for i in range(args.decode):
                    _, s = model.forward([i % args.vocab], s)

            rates[name]["decode"].append(_rate(decode, args.decode))
    best = {n: {k: max(v) for k, v in r.items()} for n, r in rates.items()}
    del program, engine
    os.unlink(ckpt)
    return {
        "version": version,
        "shape": f"{args.n_layer} x {args.n_embd}, vocab {args.vocab}",
        "quantization": args.quantization,
        "pte_mb": exp["bytes"] / 1e6,
        "export_s": exp["export_seconds"],
        "export_peak_rss_mb": exp["peak_rss_mb"],
        **{f"{n}_{k}": v for n, r in best.items() for k, v in r.items()},
        "decode_ratio": best["program"]["decode"] / best["engine"]["decode"],
        "prefill_ratio": best["program"]["prefill"] / best["engine"]["prefill"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", nargs="+", default=["5.2", "7"])
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--quantization", default="q4", choices=["fp32", "q8", "q4"])
    ap.add_argument("--prefill-len", type=int, default=32)
    ap.add_argument("--prefill-pieces", type=int, default=4)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench_export_"))
    rows = []
    try:
        for v in args.versions:
            rows.append(bench(v, args, scratch))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"threads {args.threads}, prefill T={args.prefill_len}; best of {args.rounds} alternating rounds")
    print(
        "| version | shape | quant | .pte MB | export s | export peak RSS MB | decode tok/s pte / engine (ratio)"
        " | prefill tok/s pte / engine (ratio) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['version']} | {r['shape']} | {r['quantization']} | {r['pte_mb']:.0f} | {r['export_s']:.0f} | "
            f"{r['export_peak_rss_mb']:.0f} | {r['program_decode']:.1f} / {r['engine_decode']:.1f} "
            f"({r['decode_ratio']:.2f}x) | {r['program_prefill']:.1f} / {r['engine_prefill']:.1f} "
            f"({r['prefill_ratio']:.2f}x) |"
        )


if __name__ == "__main__":
    main()
