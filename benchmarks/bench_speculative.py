"""Speculative decoding: what a k-token verify pass costs, and the decode speed it buys.

    python benchmarks/bench_speculative.py                         # RWKV-7 and 5.2 1.5B, bf16 and q8 targets
    python benchmarks/bench_speculative.py --versions 7 --targets bf16 --ks 1,2,4,8 --batches 1
    python benchmarks/bench_speculative.py --shape 0.1B --decode 32   # a quick smoke run

(a) The verify cost curve: the median time of one `model.forward` of k tokens per row (all
logits, what a verify pass is) against one one-token decode step, for k in --ks and each batch
size in --batches. A pass of k tokens reads each weight once (the per-row GEMV, 8 rows per read,
up to 16 rows; more rows take the GEMM), so on a memory-bound machine the ratio stays near 1.

(b) End-to-end greedy decode tok/s of --decode tokens, batch 1: plain decoding; the oracle draft
(the target's own greedy continuation, computed beforehand: every draft accepted, the upper
bound); prompt lookup on a repetitive prompt; the target's q4 twin (--draft-quantization). Every
speculative row is checked to give the plain tokens. Random weights make real drafts agree far
less than a trained model and its twin would; the acceptance rate is printed beside.

The random-weight checkpoint of each shape (bf16 .pth) is written once into --workdir and
quantized on load. llama.cpp's decode (bench_peers.py) is not run here: its build takes longer
than this benchmark on a 2-core machine; compare with the README's bench_peers table of the
same CPU.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import SHAPES, make_checkpoint  # noqa: E402

from rwkv_engine.speculative import Drafter  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def batch_state(model, prompt, B):
    from rwkv_engine.state import State

    _, st = model.forward(prompt)
    return State({k: v.expand(B, *v.shape[1:]).contiguous() for k, v in st.items()}, st.signature)


def verify_curve(model, ks, batches, repeats) -> list[str]:
    import torch

    prompt = [(i * 7919) % 60000 + 1 for i in range(16)]
    lines = []
    for B in batches:
        st = batch_state(model, prompt, B)
        one = torch.full((B, 1), 11, dtype=torch.long)
        step = median_time(lambda: model.forward(one, st), repeats)
        row = [f"batch {B}: step {1000 * step:.1f} ms;"]
        for k in ks:
            toks = torch.randint(1, 60000, (B, k), generator=torch.Generator().manual_seed(k))
            t = median_time(lambda: model.forward(toks, st, all_logits=True), repeats)
            row.append(f"k={k} {t / step:.2f}x")
        lines.append(" ".join(row))
        print("   ", lines[-1], flush=True)
    return lines


class Oracle(Drafter):
    """Proposes the target's own greedy continuation, known beforehand."""

    def __init__(self, prompt, continuation):
        self.n, self.cont = len(prompt), continuation

    def propose(self, context, k):
        done = len(context) - self.n
        return self.cont[done : done + k], None


def decode_rows(model, tok, n, twin_quant, max_draft) -> list[tuple[str, float, str]]:
    from rwkv_engine.generation import generate
    from rwkv_engine.sampling import SamplingParams
    from rwkv_engine.speculative import make_drafter

    unit = [(i * 7919) % 60000 + 1 for i in range(24)]
    prompt = unit * 4  # repetitive: prompt lookup has something to find
    params = SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=[])
    rows = []

    def run(name, spec):
        gen = generate(model, tok, prompt, params, speculative=spec, max_draft=max_draft)
        gen.read()
        s = gen.stats
        extra = ""
        if s.speculative is not None:
            sp = s.speculative
            extra = f"accepted {100 * sp.acceptance_rate:.0f}%, {sp.tokens_per_pass:.2f} tok/pass"
        rows.append((name, s.decode_tokens_per_second, extra))
        print(f"    {name}: {s.decode_tokens_per_second:.2f} tok/s {extra}", flush=True)
        return gen.tokens

    run("plain (warm-up)", None)
    rows.clear()
    plain = run("plain", None)
    assert run("oracle draft", Oracle(prompt, plain)) == plain
    assert run("prompt lookup", "lookup") == plain
    if twin_quant:
        twin = make_drafter("draft", model, draft_quantization=twin_quant)
        assert run(f"{twin_quant} twin draft", twin) == plain
        del twin
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default="7,5.2")
    ap.add_argument("--shape", default="1.5B", choices=sorted(SHAPES))
    ap.add_argument("--targets", default="bf16,q8", help="bf16 and/or q8 (quantized on load)")
    ap.add_argument("--ks", default=",".join(map(str, range(1, 17))))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64, help="tokens per end-to-end decode")
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--draft-quantization", default="q4", help="the twin draft's scheme ('' skips it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-curve", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "rwkv-engine-bench"))
    args = ap.parse_args()

    import torch

    import rwkv_engine
    from rwkv_engine.tokenizer import WorldTokenizer

    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tok = WorldTokenizer()
    print(f"CPU: {cpu_name()}, {args.threads} threads; shape {args.shape}", flush=True)
    summary = []
    for version in args.versions.split(","):
        ckpt = work / f"random-v{version}-{args.shape}-bf16.pth"
        make_checkpoint(ckpt, version, args.shape)
        for target in args.targets.split(","):
            quant = None if target == "bf16" else target
            model = rwkv_engine.load(ckpt, dtype="bf16", quantization=quant, progress=False)
            name = f"RWKV-{version} {args.shape} {target}"
            print(f"{name}:", flush=True)
            if not args.skip_curve:
                for line in verify_curve(model, ks, batches, args.repeats):
                    summary.append(f"| {name} | verify | {line} |")
            if not args.skip_decode:
                rows = decode_rows(model, tok, args.decode, args.draft_quantization, args.max_draft)
                base = rows[0][1]
                for row, tps, extra in rows:
                    summary.append(f"| {name} | {row} | {tps:.2f} tok/s ({tps / base:.2f}x plain) {extra} |")
            del model
            gc.collect()
    print("\n| target | what | result |\n|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
