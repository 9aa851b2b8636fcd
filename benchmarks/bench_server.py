"""Throughput and latency of `rwkv-engine serve`, measured from outside with real HTTP streams.

    python benchmarks/bench_server.py                 # RWKV-5.2 World 1.5B shape (24 x 2048), bf16
    python benchmarks/bench_server.py --small         # the 0.1B shape (12 x 768), a quick run
    python benchmarks/bench_server.py --quantization q8   # int8 weights (converted once, bf16 activations)
    python benchmarks/bench_server.py --device cuda

A random-weight checkpoint of the shape is written once (bf16 .pth, as the official files are;
the same file bench_engine.py uses) into --workdir. The server runs as a subprocess on a free
loopback port with --max-batch = the largest concurrency measured. Then:

* decode throughput: for each concurrency c, c streaming completions start at once (short
  distinct prompts, --tokens tokens each, end-of-text banned so each runs to the end).
  "aggregate tok/s" = all generated tokens / the time from the last first token to the last
  token (every stream decoding); "per stream" = the median over streams of its own
  tokens after the first / its time after the first token; "mean batch" = the server's decode
  rows per decode step (/metrics) in that round.
* time to first token with a long system prompt (about --system-tokens tokens, a fresh text
  each repeat so the first request misses the cache): the first chat request (cold) and the
  same request again (the prompt-state cache resumes the system prompt). Both use one seed;
  the table says whether their answers are identical (they must be).

Machines are noisy and shared: compare numbers from the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The checkpoint and converted copies are bench_engine.py's (this script's directory is on sys.path).
from bench_engine import SHAPES, converted_dir, make_checkpoint

MODEL = "bench"
WORDS = ("river stone light paper engine garden window silver morning violin harbour lantern meadow "
         "copper thunder velvet orchard compass").split()


def start_server(ckpt: Path, args, log_path: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-c", "import sys; from rwkv_engine.cli import main; sys.exit(main())", "serve", str(ckpt),
           "--served-model-name", MODEL, "--port", "0", "--log-level", "warning", "--dtype", args.dtype,
           "--device", args.device, "--max-batch", str(max(args.concurrency)), "--max-queue", "256",
           "--prefill-chunk", str(args.prefill_chunk), "--max-prompt-tokens", "65536"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    import httpx

    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log_path.read_text()[-3000:]}")
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log_path.read_text())
        if m:
            try:
                if httpx.get(m.group(1) + "/health", timeout=2).status_code == 200:
                    return proc, m.group(1)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up")


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def stream(http, path: str, body: dict) -> dict:
    """One streamed request: first-token time, end time, text, usage."""
    t0 = time.perf_counter()
    first = None
    text, usage = "", None
    async with http.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            for c in data.get("choices", []):
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
    return {"start": t0, "first": first, "end": time.perf_counter(), "text": text, "usage": usage}


async def decode_round(url: str, c: int, tokens: int, salt: int) -> dict:
    import httpx

    bodies = [{"model": MODEL, "prompt": f"Note {salt}-{i}: the {WORDS[i % len(WORDS)]} is", "max_tokens": tokens,
               "stream": True, "stream_options": {"include_usage": True}, "temperature": 1.0, "top_p": 0.9,
               "top_k": 40, "seed": i, "logit_bias": {"0": -100}} for i in range(c)]
    steps0, rows0 = metric(url, "rwkv_engine_decode_steps_total"), metric(url, "rwkv_engine_decode_rows_total")
    limits = httpx.Limits(max_connections=c + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        results = await asyncio.gather(*(stream(http, "/v1/completions", b) for b in bodies))
    steps = metric(url, "rwkv_engine_decode_steps_total") - steps0
    rows = metric(url, "rwkv_engine_decode_rows_total") - rows0
    total = sum(r["usage"]["completion_tokens"] for r in results)
    window = max(r["end"] for r in results) - max(r["first"] for r in results)
    after_first = total - c  # tokens decoded once every stream had its first
    per_stream = [(r["usage"]["completion_tokens"] - 1) / (r["end"] - r["first"]) for r in results]
    return {
        "c": c, "tokens": total,
        "wall": max(r["end"] for r in results) - min(r["start"] for r in results),
        "aggregate": after_first / window if window > 0 else float("nan"),
        "per_stream": statistics.median(per_stream),
        "ttft": statistics.median(r["first"] - r["start"] for r in results),
        "mean_batch": rows / steps if steps else 0.0,
    }


async def ttft_pair(url: str, system_tokens: int, salt: int, tokens: int) -> dict:
    import httpx

    from rwkv_engine import WorldTokenizer

    rng = random.Random(salt)
    tok = WorldTokenizer()
    words = []
    while len(tok.encode(" ".join(words))) < system_tokens:
        words += [f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(64)]
    system = " ".join(words)
    body = {"model": MODEL, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "Summarise the list."}],
            "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": salt}
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        cold = await stream(http, "/v1/chat/completions", body)
        warm = await stream(http, "/v1/chat/completions", body)
    return {
        "prompt_tokens": cold["usage"]["prompt_tokens"],
        "cold_ttft": cold["first"] - cold["start"],
        "warm_ttft": warm["first"] - warm["start"],
        "cold_cached": cold["usage"]["prompt_tokens_details"]["cached_tokens"],
        "warm_cached": warm["usage"]["prompt_tokens_details"]["cached_tokens"],
        "identical": cold["text"] == warm["text"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5B", choices=sorted(SHAPES), help="model shape (default: %(default)s)")
    ap.add_argument("--small", action="store_true", help="shortcut for --shape 0.1B")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="server weight dtype")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quantization", default=None, help="serve a converted copy with this scheme (e.g. q8)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per decode stream (default: %(default)s)")
    ap.add_argument("--system-tokens", type=int, default=2048,
                    help="system prompt length, about (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2, help="cold/cached TTFT pairs (default: %(default)s)")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--workdir", default="/tmp/rwkv-engine-bench")
    args = ap.parse_args()
    if args.small:
        args.shape = "0.1B"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"rwkv5.2-{args.shape}-bf16.pth"
    make_checkpoint(ckpt, "5.2", args.shape)
    if args.quantization:
        ckpt = converted_dir(work, ckpt, args.quantization, args.dtype)
    t0 = time.perf_counter()
    proc, url = start_server(ckpt, args, work / "bench_server.log")
    print(f"server up in {time.perf_counter() - t0:.1f} s at {url}", file=sys.stderr, flush=True)
    try:
        asyncio.run(decode_round(url, 1, 4, salt=-1))  # warm-up
        rounds = []
        for c in args.concurrency:
            rounds.append(asyncio.run(decode_round(url, c, args.tokens, salt=c)))
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
        pairs = []
        for k in range(args.repeats):
            pairs.append(asyncio.run(ttft_pair(url, args.system_tokens, 1000 + k, 8)))
            print(json.dumps(pairs[-1]), file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(60)

    L, C, V = SHAPES[args.shape]
    print(f"\nrwkv-engine serve, RWKV-5.2 {args.shape} shape ({L} x {C}, vocab {V}), {args.dtype} "
          f"(quantization {args.quantization or 'none'}) on {args.device}, "
          f"max batch {max(args.concurrency)}, {os.cpu_count()} CPUs\n")
    print("| streams | tokens | wall s | aggregate decode tok/s | per-stream tok/s | median TTFT ms | mean batch |")
    print("|---|---|---|---|---|---|---|")
    for r in rounds:
        print(f"| {r['c']} | {r['tokens']} | {r['wall']:.1f} | {r['aggregate']:.1f} | {r['per_stream']:.1f} | "
              f"{r['ttft'] * 1e3:.0f} | {r['mean_batch']:.2f} |")
    print()
    print("| system prompt tokens | TTFT cold ms | TTFT cached ms | speed-up | cached tokens | same output |")
    print("|---|---|---|---|---|---|")
    for p in pairs:
        print(f"| {p['prompt_tokens']} | {p['cold_ttft'] * 1e3:.0f} | {p['warm_ttft'] * 1e3:.0f} | "
              f"{p['cold_ttft'] / p['warm_ttft']:.1f}x | {p['warm_cached']} (cold: {p['cold_cached']}) | "
              f"{'yes' if p['identical'] else 'NO'} |")


if __name__ == "__main__":
    main()
