"""What the loader's finiteness check (loading.formats.check_finite) costs: `rwkv_engine.load`
with the check and with it switched off, in alternating rounds in one process, per format.

    python benchmarks/bench_load_check.py                          # RWKV-7, 12 x 1024, vocab 65536
    python benchmarks/bench_load_check.py --layers 2 --embd 256 --rounds 2   # a quick dry run

The files are written once into a temporary directory, then each round loads each of them
twice (the check on, then off, or the other way round in every other round, so neither side
always meets the warmer caches). The files stay in the page cache after the first round: what
is measured is the CPU cost of the check (one `aminmax` pass per tensor), not disk reads.
Prints the median wall and CPU time (user + system, all threads) of each side and their ratios
per format. On a busy machine read the CPU times with --threads 1: a parallel region of torch's
whose helper thread the OS runs late counts its wait as CPU time.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.loading import converted, formats, plan


@contextmanager
def check_off():
    """check_finite as a no-op in every module that calls it (this benchmark's baseline)."""
    mods = (formats, plan, converted)
    saved = [m.check_finite for m in mods]
    for m in mods:
        m.check_finite = lambda t, what: None
    try:
        yield
    finally:
        for m, f in zip(mods, saved, strict=True):
            m.check_finite = f


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads: less disturbed than wall time by
    other work on a shared machine."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def write_files(d: Path, args) -> dict[str, tuple[Path, dict]]:
    sd = testing.random_state_dict(
        "7", n_layer=args.layers, n_embd=args.embd, vocab_size=args.vocab, head_size=64, seed=1
    )
    bf16 = testing.cast(sd, torch.bfloat16)
    files = {
        "pth bf16": (testing.save_pth(bf16, d / "m.pth"), {}),
        "safetensors fp32": (testing.save_safetensors(sd, d / "m.safetensors"), {}),
        "pth bf16 -> q8": (d / "m.pth", {"quantization": "q8"}),
    }
    files["converted bf16"] = (converted.convert(plan.prepare(d / "m.pth"), d / "conv", progress=False), {})
    q8 = plan.prepare(d / "m.pth", quantization="q8")
    files["converted q8"] = (converted.convert(q8, d / "conv-q8", progress=False), {})
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch's thread count (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), args)
        times = {(name, on): [] for name in files for on in (True, False)}
        for r in range(args.rounds):
            for name, (path, kw) in files.items():
                for on in (True, False) if r % 2 == 0 else (False, True):
                    t0, c0 = time.perf_counter(), cpu_seconds()
                    if on:
                        model = rwkv_engine.load(path, progress=False, **kw)
                    else:
                        with check_off():
                            model = rwkv_engine.load(path, progress=False, **kw)
                    times[(name, on)].append((time.perf_counter() - t0, cpu_seconds() - c0))
                    del model
        shape = f"RWKV-7 {args.layers} x {args.embd}, vocab {args.vocab}"
        print(f"{shape}, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
        for name in files:
            line = f"{name:18s}"
            for i, what in enumerate(("wall", "cpu")):
                on = statistics.median(t[i] for t in times[(name, True)])
                off = statistics.median(t[i] for t in times[(name, False)])
                line += f"  {what}: on {on:7.3f} s, off {off:7.3f} s, on/off {on / off:5.3f}"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
