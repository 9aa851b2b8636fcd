"""Speculative decoding: what a k-token verify pass costs, and the decode speed it buys.

    python benchmarks/bench_speculative.py                         # RWKV-7 and 5.2 1.5B, bf16 and q8 targets
    python benchmarks/bench_speculative.py --versions 7 --targets bf16 --ks 1,2,4,8 --batches 1
    python benchmarks/bench_speculative.py --shape 0.1B --decode 32   # a quick smoke run

(a) The verify cost curve: the median time of one forward of k tokens per row (all logits,
what a verify pass is; the fused native step) against one one-token decode step, for k in --ks
and each batch size in --batches, the two timed in turns. The GEMVs carry 8 rows x tokens per
read of a weight, so at batch 1 a pass of up to 8 tokens reads the weights once; a batch is cut
into groups of at most 16 rows x tokens, as the server verifies it.

(b) End-to-end greedy decode tok/s of --decode tokens, batch 1: plain decoding; the oracle draft
(the target's own greedy continuation, computed beforehand: every draft accepted, the upper
bound); prompt lookup on a repetitive prompt; the target's q4 twin (--draft-quantization). Every
speculative row is checked to give the plain tokens. Random weights make real drafts agree far
less than a trained model and its twin would; the acceptance rate is printed beside.

(c) For RWKV-7, llama.cpp's decode of the same weights in the same run (bench_peers.py's build,
conversion and llama-bench: GGUF F16 beside our bf16 target, Q8_0 beside q8), and our plain
and oracle decode over it. llama.cpp's speculative decoding does not serve recurrent models,
so its plain decode is the peer. --no-peer skips it (the first run builds llama.cpp: many
minutes on 2 cores).

The random-weight checkpoint of each shape (bf16 .pth) is written once into --workdir and
quantized on load.
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

from rwkv_engine.testing import KnownContinuation  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def batch_state(model, prompt, B):
    from rwkv_engine.state import State

    _, st = model.forward(prompt)
    return State({k: v.expand(B, *v.shape[1:]).contiguous() for k, v in st.items()}, st.signature)


def verify_curve(model, ks, batches, repeats) -> list[str]:
    """One line per batch size: the median one-token step, and each k's median pass / step.
    The step and the passes take turns in every round, so a drift of the machine's memory speed
    touches both alike. Passes go through the server's `decode_rows` (groups of at most
    GEMV_MAX_ROWS rows x tokens, as speculating rows are verified)."""
    import torch

    from rwkv_engine.serve.engine import decode_rows

    prompt = [(i * 7919) % 60000 + 1 for i in range(16)]
    lines = []
    for B in batches:
        st = batch_state(model, prompt, B)
        calls = {0: lambda: decode_rows(model, torch.full((B, 1), 11, dtype=torch.long), st)}
        for k in ks:
            toks = torch.randint(1, 60000, (B, k), generator=torch.Generator().manual_seed(k))
            calls[k] = lambda toks=toks: decode_rows(model, toks, st, all_logits=True)
        times: dict[int, list[float]] = {k: [] for k in calls}
        for fn in calls.values():  # warm-up
            fn()
        for _ in range(repeats):
            for k, fn in calls.items():
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
        step = statistics.median(times[0])
        row = [f"batch {B}: step {1000 * step:.1f} ms;"]
        row += [f"k={k} {statistics.median(times[k]) / step:.2f}x" for k in ks]
        lines.append(" ".join(row))
        print("   ", lines[-1], flush=True)
    return lines


def llama_decode(work: Path, ckpt: Path, target: str, args) -> float | None:
    """llama.cpp's decode tok/s (llama-bench, its own process) of ckpt in the GGUF type beside
    `target`; None (with the reason on stderr) where it cannot be built."""
    import bench_peers

    missing = bench_peers.missing_tools()
    if missing:
        print(f"    llama.cpp: skipped, this machine lacks {', '.join(missing)}", file=sys.stderr)
        return None
    gtype = {"bf16": "F16", "q8": "Q8_0"}[target]
    tree = bench_peers.llama_tree(work)
    bins = bench_peers.build_llama(tree, args.threads)
    gguf = bench_peers.gguf_files(work, ckpt, tree, bins, [gtype], args.threads)[gtype]
    run = argparse.Namespace(
        prompt_len=16, decode=args.decode, threads=args.threads, repeats=args.repeats, llama_load_mode="auto"
    )
    result = bench_peers.run_llama(bins, gguf, run)
    return result["decode_tok_s"]


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
    assert run("oracle draft", KnownContinuation(prompt, plain)) == plain
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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode", type=int, default=64, help="tokens per end-to-end decode")
    ap.add_argument("--max-draft", type=int, default=7)
    ap.add_argument("--draft-quantization", default="q4", help="the twin draft's scheme ('' skips it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-curve", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp's decode (c)")
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
                peer = None
                if version == "7" and not args.no_peer:
                    peer = llama_decode(work, ckpt, target, args)
                    if peer is not None:
                        print(f"    llama.cpp {target}: {peer:.2f} tok/s", flush=True)
                        summary.append(f"| {name} | llama.cpp plain decode | {peer:.2f} tok/s |")
                for row, tps, extra in rows:
                    vs = f", {tps / peer:.2f}x llama.cpp" if peer else ""
                    summary.append(f"| {name} | {row} | {tps:.2f} tok/s ({tps / base:.2f}x plain{vs}) {extra} |")
            del model
            gc.collect()
    print("\n| target | what | result |\n|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
