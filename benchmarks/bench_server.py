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
  "engine ms / step" splits a decode step as the engine thread timed it (/metrics
  engine_seconds_total): model forward, sampling, and streaming (detokenizer, stop strings,
  handing the text to the event loop); what the HTTP side costs shows as the gap between
  their sum and 1000 * mean batch / aggregate.
* time to first token with a long system prompt (about --system-tokens tokens, a fresh text
  each repeat so the first request misses the cache): the first chat request (cold) and the
  same request again (the prompt-state cache resumes the system prompt). Both use one seed;
  the table says whether their answers are identical (they must be).

With --baseline DIR, a second server runs the rwkv_engine package of DIR (e.g. a `git worktree`
of an older revision), and every round runs on both servers in turn, so the two columns of
numbers come from the same minutes of the same machine.

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
PHASES = ("forward", "sample", "stream")  # of a decode step, as the engine times them
WORDS = [
    "river",
    "stone",
    "light",
    "paper",
    "engine",
    "garden",
    "window",
    "silver",
    "morning",
    "violin",
    "harbour",
    "lantern",
    "meadow",
    "copper",
    "thunder",
    "velvet",
    "orchard",
    "compass",
]


def start_server(ckpt: Path, args, log_path: Path, tree: Path | None = None) -> tuple[subprocess.Popen, str]:
    """The server on a free port, running the rwkv_engine package of `tree` (None: the installed one)."""
    cmd = [
        sys.executable,
        "-c",
        "import sys; from rwkv_engine.cli import main; sys.exit(main())",
        "serve",
        str(ckpt),
        "--served-model-name",
        MODEL,
        "--port",
        "0",
        "--log-level",
        "warning",
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--max-batch",
        str(max(args.concurrency)),
        "--max-queue",
        "256",
        "--prefill-chunk",
        str(args.prefill_chunk),
        "--max-prompt-tokens",
        "65536",
    ]
    log = open(log_path, "w")
    # `python -c` puts its working directory first on sys.path: the package of `tree` wins.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tree)
    return proc, wait_ready(proc, log_path)


def wait_ready(proc: subprocess.Popen, log_path: Path) -> str:
    """The base URL of a server subprocess once its /health says ok (SystemExit if it never does)."""
    import httpx

    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log_path.read_text()[-3000:]}")
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log_path.read_text())
        if m:
            try:
                if httpx.get(m.group(1) + "/health", timeout=2).status_code == 200:
                    return m.group(1)
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

    bodies = [
        {
            "model": MODEL,
            "prompt": f"Note {salt}-{i}: the {WORDS[i % len(WORDS)]} is",
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 1.0,
            "top_p": 0.9,
            "top_k": 40,
            "seed": i,
            "logit_bias": {"0": -100},
        }
        for i in range(c)
    ]
    names = ["rwkv_engine_decode_steps_total", "rwkv_engine_decode_rows_total"] + [
        f'rwkv_engine_engine_seconds_total{{phase="{phase}"}}' for phase in PHASES
    ]
    before = [metric(url, n) for n in names]
    limits = httpx.Limits(max_connections=c + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        results = await asyncio.gather(*(stream(http, "/v1/completions", b) for b in bodies))
    steps, rows, *seconds = [metric(url, n) - b for n, b in zip(names, before)]
    total = sum(r["usage"]["completion_tokens"] for r in results)
    window = max(r["end"] for r in results) - max(r["first"] for r in results)
    after_first = total - c  # tokens decoded once every stream had its first
    per_stream = [(r["usage"]["completion_tokens"] - 1) / (r["end"] - r["first"]) for r in results]
    return {
        "c": c,
        "tokens": total,
        "wall": max(r["end"] for r in results) - min(r["start"] for r in results),
        "aggregate": after_first / window if window > 0 else float("nan"),
        "per_stream": statistics.median(per_stream),
        "ttft": statistics.median(r["first"] - r["start"] for r in results),
        "mean_batch": rows / steps if steps else 0.0,
        "step_ms": {ph: 1e3 * t / steps if steps else 0.0 for ph, t in zip(PHASES, seconds)},
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
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the list."}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 40,
        "seed": salt,
    }
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
    ap.add_argument(
        "--system-tokens", type=int, default=2048, help="system prompt length, about (default: %(default)s)"
    )
    ap.add_argument("--repeats", type=int, default=2, help="cold/cached TTFT pairs (default: %(default)s)")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help="also serve the rwkv_engine package in DIR, rounds alternating with this tree's",
    )
    ap.add_argument("--workdir", default="/tmp/rwkv-engine-bench")
    args = ap.parse_args()
    if args.small:
        args.shape = "0.1B"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.baseline is not None and not (args.baseline / "rwkv_engine" / "__init__.py").is_file():
        raise SystemExit(f"--baseline: no rwkv_engine package in {args.baseline}")

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"rwkv5.2-{args.shape}-bf16.pth"
    make_checkpoint(ckpt, "5.2", args.shape)
    if args.quantization:
        ckpt = converted_dir(work, ckpt, args.quantization, args.dtype)
    trees = {"this tree": None}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    servers = {}
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    pairs: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for i, (name, tree) in enumerate(trees.items()):
            t0 = time.perf_counter()
            servers[name] = start_server(ckpt, args, work / f"bench_server{i or ''}.log", tree)
            print(
                f"{name}: server up in {time.perf_counter() - t0:.1f} s at {servers[name][1]}",
                file=sys.stderr,
                flush=True,
            )
            asyncio.run(decode_round(servers[name][1], 1, 4, salt=-1))  # warm-up
        for c in args.concurrency:
            for name, (_, url) in servers.items():
                rounds[name].append(asyncio.run(decode_round(url, c, args.tokens, salt=c)))
                print(name, json.dumps(rounds[name][-1]), file=sys.stderr, flush=True)
        for k in range(args.repeats):
            for name, (_, url) in servers.items():
                pairs[name].append(asyncio.run(ttft_pair(url, args.system_tokens, 1000 + k, 8)))
                print(name, json.dumps(pairs[name][-1]), file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)

    L, C, V = SHAPES[args.shape]
    print(
        f"\nrwkv-engine serve, RWKV-5.2 {args.shape} shape ({L} x {C}, vocab {V}), {args.dtype} "
        f"(quantization {args.quantization or 'none'}) on {args.device}, "
        f"max batch {max(args.concurrency)}, {os.cpu_count()} CPUs"
        + (f"; baseline: {args.baseline}" if args.baseline else "")
        + "\n"
    )
    label = "| server " if len(trees) > 1 else ""
    print(
        f"{label}| streams | tokens | wall s | aggregate decode tok/s | per-stream tok/s | median TTFT ms "
        f"| mean batch | engine ms / step: forward + sample + stream |"
    )
    print("|---" * (8 + bool(label)) + "|")
    for k in range(len(args.concurrency)):
        for name in trees:
            r = rounds[name][k]
            ms = r["step_ms"]
            split = " + ".join(f"{ms[ph]:.1f}" for ph in PHASES) if any(ms.values()) else "-"
            print(
                f"{f'| {name} ' if label else ''}| {r['c']} | {r['tokens']} | {r['wall']:.1f} | "
                f"{r['aggregate']:.1f} | {r['per_stream']:.1f} | {r['ttft'] * 1e3:.0f} | {r['mean_batch']:.2f} | "
                f"{split} |"
            )
    if args.repeats:
        print()
        print(
            f"{label}| system prompt tokens | TTFT cold ms | TTFT cached ms | speed-up | cached tokens | same output |"
        )
        print("|---" * (6 + bool(label)) + "|")
        for k in range(args.repeats):
            for name in trees:
                p = pairs[name][k]
                print(
                    f"{f'| {name} ' if label else ''}| {p['prompt_tokens']} | {p['cold_ttft'] * 1e3:.0f} | "
                    f"{p['warm_ttft'] * 1e3:.0f} | {p['cold_ttft'] / p['warm_ttft']:.1f}x | "
                    f"{p['warm_cached']} (cold: {p['cold_cached']}) | {'yes' if p['identical'] else 'NO'} |"
                )


if __name__ == "__main__":
    main()
