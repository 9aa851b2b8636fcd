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

--workload mixed: a load shaped like real traffic, on the RWKV-7 checkpoint of the shape (the
file bench_peers.py uses). For each concurrency c, c clients each send --requests-per-stream
streamed /v1/completions requests one after another: prompts of 20-600 tokens (a log-normal
from a fixed seed, median 150; the same lengths in every round, the same texts on every server
of a round, a distinct text per request so no prompt cache helps), --tokens (default 100) output
tokens at temperature 0, each stream running to its length (ignore_eos and min_tokens where the
server takes them). Per round: output tok/s (all output tokens / the round's wall time, prefill
included); "decode, all streams": the output tokens per second over the time when all c streams
are between their first and last token (the rate of a full decode batch, new prompts being
prefilled included: bench_server's aggregate decode); time to first token p50 / p99; and the
inter-token latency p50 / p99 (the gaps between a stream's successive chunks, over all streams).
For our server also the engine thread's seconds by phase (/metrics) and its mean decode batch.

--peer rwkvserve / --peer llama-server (repeatable; implies --workload mixed): the same rounds
on that server too, on the same weights and threads (benchmarks/server_peers.py says how each is
installed, started and stopped), the servers taking turns in each round (the order reversed
every other round; the servers not being measured are paused with SIGSTOP, so that an idle one
takes no CPU from the one measured), and the ratio per column: how many times better rwkv-engine is
(throughput ours / theirs, latency theirs / ours). With --quantization q8, llama-server runs
Q8_0 (else F16 against our bf16); rwkvserve always runs --dtype.

--workload resume: --repeats conversations of about --system-tokens tokens (RWKV-7 checkpoint)
on a server with --state-store: each asked cold, then again (resumed from the in-memory prompt
cache); the server is stopped, started again on the same directory, and each is asked once more
(resumed from the files). Printed: the three times to first token, restart / warm (the target:
at most 1.2x), the cached tokens and whether the three answers are the same (they must be).

Machines are noisy and shared: compare numbers from the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
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


def start_server(
    ckpt: Path, args, log_path: Path, tree: Path | None = None, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """The server on a free port, running the rwkv_engine package of `tree` (None: the installed
    one), with `extra` flags."""
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
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += extra
    log = open(log_path, "w")
    # `python -c` puts its working directory first on sys.path: the package of `tree` wins.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tree)
    return proc, wait_ready(proc, log_path)


def wait_ready(proc: subprocess.Popen, log_path: Path, timeout: float = 1800) -> str:
    """The base URL of a server subprocess once its /health says ok (SystemExit if it does not
    within `timeout` seconds)."""
    import httpx

    deadline = time.monotonic() + timeout
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


def conversation(system_tokens: int, salt: int, tokens: int) -> dict:
    """A streamed chat request whose system prompt has about `system_tokens` tokens, a fresh text
    for each salt (so its first request misses the cache), sampled with the salt as seed."""
    from rwkv_engine import WorldTokenizer

    rng = random.Random(salt)
    tok = WorldTokenizer()
    words = []
    while len(tok.encode(" ".join(words))) < system_tokens:
        words += [f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(64)]
    system = " ".join(words)
    return {
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


async def chat_once(url: str, body: dict) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        return await stream(http, "/v1/chat/completions", body)


async def ttft_pair(url: str, system_tokens: int, salt: int, tokens: int) -> dict:
    body = conversation(system_tokens, salt, tokens)
    cold = await chat_once(url, body)
    warm = await chat_once(url, body)
    return {
        "prompt_tokens": cold["usage"]["prompt_tokens"],
        "cold_ttft": cold["first"] - cold["start"],
        "warm_ttft": warm["first"] - warm["start"],
        "cold_cached": cold["usage"]["prompt_tokens_details"]["cached_tokens"],
        "warm_cached": warm["usage"]["prompt_tokens_details"]["cached_tokens"],
        "identical": cold["text"] == warm["text"],
    }


# --- the mixed workload (--workload mixed, --peer) ------------------------------------------------


def prompt_lengths(n: int, seed: int = 38, lo: int = 20, hi: int = 600, median: float = 150.0) -> list[int]:
    """n prompt lengths in tokens from a log-normal (sigma 0.75) around `median`, clipped to [lo, hi]."""
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), 0.75)))) for _ in range(n)]


def prompt_texts(tok, lengths: list[int], salt: str) -> list[str]:
    """A text of exactly lengths[i] World tokens for each i, distinct from its first words on. A
    cut at a token boundary re-encodes to the same tokens (the tokenizer matches greedily from the
    left, and no match inside the text reaches past the cut)."""
    rng = random.Random(salt)
    out = []
    for i, n in enumerate(lengths):
        words = [f"Item {salt}-{i}:"]
        ids = tok.encode(" ".join(words))
        while len(ids) < n:
            words += [f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(64)]
            ids = tok.encode(" ".join(words))
        out.append(tok.decode(ids[:n]))
    return out


class StreamReader:
    """The JSON objects of a streamed answer as its bytes arrive: server-sent events (`data: {...}`
    lines and `data: [DONE]`) or bare JSON objects one after another (rwkvserve's stream)."""

    def __init__(self):
        self.buf = ""
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out = []
        while True:
            s = self.buf.lstrip()
            if s.startswith("data:"):
                s = s[5:].lstrip()
            if s.startswith("[DONE]"):
                self.buf = s[6:]
                continue
            self.buf = s
            try:
                obj, end = self._decoder.raw_decode(s)
            except json.JSONDecodeError:
                return out  # empty, or an object not complete yet
            out.append(obj)
            self.buf = s[end:]


def chunk_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def timed_stream(http, body: dict) -> dict:
    """One streamed completion: start, the arrival time of every chunk that carries a token, end,
    and the output tokens (the usage's count where the server reports it, else llama-server's
    timings, else one per chunk: rwkvserve sends every token in a chunk of its own)."""
    reader = StreamReader()
    times: list[float] = []
    usage = timings = None
    t0 = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for text in r.aiter_text():
            now = time.perf_counter()
            for obj in reader.feed(text):
                if "error" in obj:
                    raise RuntimeError(f"the server sent an error: {json.dumps(obj)[:500]}")
                usage = obj.get("usage") or usage
                timings = obj.get("timings") or timings
                for c in obj.get("choices") or ():
                    if c.get("finish_reason") is None or chunk_text(c):
                        times.append(now)
    if reader.buf.strip():
        raise RuntimeError(f"the stream ended in something that is not JSON: {reader.buf[:200]!r}")
    if usage:
        tokens = usage["completion_tokens"]
    elif timings and "predicted_n" in timings:
        tokens = timings["predicted_n"]
    else:
        tokens = len(times)
    return {"start": t0, "times": times, "end": time.perf_counter(), "tokens": tokens}


async def mixed_round(url: str, bodies: list[dict], c: int) -> list[dict]:
    """The requests sent by c clients, each taking the next body once its last answer ended."""
    import httpx

    results: list[dict | None] = [None] * len(bodies)
    order = iter(range(len(bodies)))

    async def client(http):
        for i in order:
            results[i] = await timed_stream(http, bodies[i])

    # A fresh connection per request: a kept-alive one that a server closed meanwhile (llama-server
    # does, between a round's requests) fails the next request with "Server disconnected without
    # sending a response". A loopback connect costs every server the same fraction of a millisecond.
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(c)))
    return results


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100) of xs, interpolated between ranks; nan for no values."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def all_decoding_rate(results: list[dict], c: int) -> float:
    """Output tokens per second over the spans when c requests are between their first and last
    token chunk at once; nan when that never happens. A chunk after a request's first carries
    (tokens - 1) / (chunks - 1) of its tokens."""
    edges = sorted(
        [(r["times"][0], 1) for r in results if r["times"]] + [(r["times"][-1], -1) for r in results if r["times"]]
    )
    starts, ends, active, since = [], [], 0, 0.0
    for t, step in edges:
        if active == c and t > since:
            starts.append(since)
            ends.append(t)
        active += step
        since = t
    span = sum(b - a for a, b in zip(starts, ends))
    if span <= 0:
        return math.nan
    tokens = 0.0
    for r in results:
        times = r["times"]
        if len(times) < 2:
            continue
        each = (r["tokens"] - 1) / (len(times) - 1)
        for t in times[1:]:
            i = bisect.bisect_left(starts, t) - 1  # the span (start, end] the chunk arrived in
            if i >= 0 and t <= ends[i]:
                tokens += each
    return tokens / span


def summarize_round(results: list[dict], c: int) -> dict:
    first = [r["times"][0] - r["start"] for r in results if r["times"]]
    gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "c": c,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "all_decoding_tok_s": all_decoding_rate(results, c),
        "ttft_p50_ms": 1e3 * percentile(first, 50),
        "ttft_p99_ms": 1e3 * percentile(first, 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
    }


ENGINE_PHASES = ("prefill", "forward", "sample", "stream")


def engine_counters(url: str) -> dict:
    """Our server's engine seconds by phase and decode step counts, from /metrics."""
    names = {ph: f'rwkv_engine_engine_seconds_total{{phase="{ph}"}}' for ph in ENGINE_PHASES}
    names |= {"steps": "rwkv_engine_decode_steps_total", "rows": "rwkv_engine_decode_rows_total"}
    names |= {"pieces": "rwkv_engine_prefill_pieces_total", "prefilled": "rwkv_engine_prefill_tokens_total"}
    names |= {"beside": "rwkv_engine_prefill_beside_seconds_total"}  # the prefill thread's (--prefill-threads)
    return {k: metric(url, n) for k, n in names.items()}


# (column, key, higher is better, format)
MIXED_COLUMNS = (
    ("output tok/s", "output_tok_s", True, ".1f"),
    ("decode tok/s, all streams", "all_decoding_tok_s", True, ".1f"),
    ("TTFT p50 ms", "ttft_p50_ms", False, ".0f"),
    ("TTFT p99 ms", "ttft_p99_ms", False, ".0f"),
    ("ITL p50 ms", "itl_p50_ms", False, ".0f"),
    ("ITL p99 ms", "itl_p99_ms", False, ".0f"),
)


def span(values: list[float], spec: str) -> str:
    """A cell: the value, or "lo-hi" over rounds; "-" for no number."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    lo, hi = format(min(values), spec), format(max(values), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def mixed_table(rounds: dict[str, list[dict]], concurrency: list[int]) -> str:
    """Markdown: a row per server and concurrency (ranges over rounds), then per peer the ratios
    of the medians, oriented so that > 1 means rwkv-engine is better."""
    names = list(rounds)
    head = "| streams | server | " + " | ".join(col for col, *_ in MIXED_COLUMNS) + " |"
    lines = [head, "|---" * (2 + len(MIXED_COLUMNS)) + "|"]
    for c in concurrency:
        by = {n: [r for r in rounds[n] if r["c"] == c] for n in names}
        for n in names:
            cells = [span([r[key] for r in by[n]], spec) for _, key, _, spec in MIXED_COLUMNS]
            lines.append(f"| {c} | {n} | " + " | ".join(cells) + " |")
        ours = by[names[0]]
        for n in names[1:]:
            cells = []
            for _, key, higher, _ in MIXED_COLUMNS:
                a = statistics.median([r[key] for r in ours]) if ours else math.nan
                b = statistics.median([r[key] for r in by[n]]) if by[n] else math.nan
                x = (a / b if higher else b / a) if a > 0 and b > 0 else math.nan
                cells.append("-" if math.isnan(x) else f"{x:.2f}x")
            lines.append(f"| {c} | x vs {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_mixed(args, work: Path) -> None:
    from bench_peers import cpu_summary, our_version
    from server_peers import Served, ours_body, start_llama_server, start_rwkvserve

    from rwkv_engine import WorldTokenizer

    ckpt = work / f"rwkv7-{args.shape}-bf16.pth"
    make_checkpoint(ckpt, "7", args.shape)
    model = converted_dir(work, ckpt, args.quantization, args.dtype) if args.quantization else ckpt
    top = max(args.concurrency)
    servers: list[Served] = []
    try:
        t0 = time.perf_counter()
        trees = {"rwkv-engine": None} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
        for i, (name, tree) in enumerate(trees.items()):
            log = work / f"bench_server-mixed{i or ''}.log"
            proc, url = start_server(model, args, log, tree)
            servers.append(Served(name, proc, url, log, ours_body))
        threads = args.threads or os.cpu_count()  # (the peers are told a number: ours defaults to it too)
        for peer in args.peer:
            if peer == "rwkvserve":
                servers.append(start_rwkvserve(work, ckpt, Path(args.cache), args.dtype, top, threads))
            else:
                llama_type = "Q8_0" if args.quantization == "q8" else "F16"
                ctx = 1024 * (1 + (600 + args.tokens) // 1024)
                servers.append(
                    start_llama_server(work, ckpt, Path(args.cache), llama_type, top, threads, args.jobs, ctx)
                )
        print(f"servers up in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        tok = WorldTokenizer()
        for s in servers:  # warm-up: a short request each
            asyncio.run(mixed_round(s.url, [s.body("Warm up.", 4)], 1))
            s.pause(True)
        rounds: dict[str, list[dict]] = {s.name: [] for s in servers}
        counters: list[tuple[int, dict, float]] = []  # ours: (c, engine seconds by phase, wall)
        for rnd in range(args.rounds):
            for c in args.concurrency:
                n = max(c * args.requests_per_stream, args.min_requests)
                texts = prompt_texts(tok, prompt_lengths(n), salt=f"{rnd}.{c}")
                for s in servers if rnd % 2 == 0 else servers[::-1]:
                    for other in servers:  # only the server measured runs (see Served.pause)
                        other.pause(other is not s)
                    before = engine_counters(s.url) if s.name == "rwkv-engine" else None
                    got = summarize_round(
                        asyncio.run(mixed_round(s.url, [s.body(t, args.tokens) for t in texts], c)), c
                    )
                    rounds[s.name].append(got)
                    if before is not None:
                        after = engine_counters(s.url)
                        counters.append((c, {k: after[k] - before[k] for k in after}, got["wall_s"]))
                    print(s.name, json.dumps(got), file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()

    L, C, V = SHAPES[args.shape]
    model_name, isa = cpu_summary(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
    print(
        f"\nCPU: {model_name}; ISA: {' '.join(isa) or '?'}; {args.threads or os.cpu_count()} threads; "
        f"rwkv-engine {our_version()}\n"
        f"RWKV-7 {args.shape} shape ({L} x {C}, vocab {V}), random weights, rwkv-engine {args.dtype} "
        f"(quantization {args.quantization or 'none'}), --max-batch {top}, --prefill-chunk {args.prefill_chunk}; "
        f"streaming /v1/completions, prompts 20-600 tokens (log-normal, median 150), {args.tokens} output tokens, "
        f"temperature 0; {args.rounds} round(s), servers alternating; x = times better for rwkv-engine\n"
    )
    for s in servers:
        for note in s.notes:
            print(f"* {note}")
    print()
    print(mixed_table(rounds, args.concurrency))
    if counters:
        print("\nrwkv-engine engine thread, by round: seconds by phase / wall, mean decode batch")
        for c, d, wall in counters:
            phases = ", ".join(f"{ph} {d[ph]:.1f}" for ph in ENGINE_PHASES)
            batch = d["rows"] / d["steps"] if d["steps"] else 0.0
            piece = d["prefilled"] / d["pieces"] if d.get("pieces") else math.nan  # (an older engine has no count)
            beside = d.get("beside") or 0.0  # (an older engine has no prefill thread)
            rate = d["prefilled"] / (d["prefill"] + beside) if d["prefill"] + beside else math.nan
            print(
                f"  {c} streams: {phases} of {wall:.1f} s; mean batch {batch:.1f} over {d['steps']:.0f} steps; "
                f"prefill {d['prefilled']:.0f} tokens in pieces of {piece:.0f} on average, {rate:.0f} tok/s "
                f"(of it beside the decode steps, on the prefill thread: {beside:.1f} s)"
            )


# --- a conversation resumed after a restart (--workload resume) -------------------------------------


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(60)


def run_resume(args, work: Path) -> None:
    """Conversations of about --system-tokens tokens on a server with --state-store: each asked
    cold and again (the in-memory prompt cache); then the server is stopped and started again on
    the same directory and each is asked once more (the state store). Target: the restarted
    server's first token within 1.2x the warm in-memory time."""
    import shutil

    ckpt = work / f"rwkv7-{args.shape}-bf16.pth"
    make_checkpoint(ckpt, "7", args.shape)
    model = converted_dir(work, ckpt, args.quantization, args.dtype) if args.quantization else ckpt
    store = work / "bench_server-state-store"
    shutil.rmtree(store, ignore_errors=True)
    flags = ("--state-store", str(store))
    bodies = [conversation(args.system_tokens, 2000 + k, 8) for k in range(args.repeats)]
    runs: list[dict] = []
    for phase, log in (("first", "bench_server-resume.log"), ("restarted", "bench_server-resume2.log")):
        proc, url = start_server(model, args, work / log, extra=flags)
        try:
            asyncio.run(decode_round(url, 1, 4, salt=-1))  # warm-up
            for k, body in enumerate(bodies):
                if phase == "first":
                    runs.append({"cold": asyncio.run(chat_once(url, body)), "warm": asyncio.run(chat_once(url, body))})
                else:
                    runs[k]["restored"] = asyncio.run(chat_once(url, body))
                    hits = metric(url, "rwkv_engine_state_store_hits_total")
                    print(f"conversation {k}: state store hits so far {hits:.0f}", file=sys.stderr, flush=True)
        finally:
            stop_server(proc)

    L, C, V = SHAPES[args.shape]
    print(
        f"\nrwkv-engine serve --state-store, RWKV-7 {args.shape} shape ({L} x {C}, vocab {V}), {args.dtype} "
        f"(quantization {args.quantization or 'none'}), --prefill-chunk {args.prefill_chunk}, "
        f"{args.threads or os.cpu_count()} threads\n"
    )
    print(
        "| conversation tokens | TTFT cold ms | TTFT warm (memory) ms | TTFT after a restart (store) ms "
        "| restart / warm (target <= 1.2) | cached tokens warm / restart | same answer |"
    )
    print("|---" * 7 + "|")
    ttft = lambda r: 1e3 * (r["first"] - r["start"])  # noqa: E731
    cached = lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    for r in runs:
        cold, warm, restored = r["cold"], r["warm"], r["restored"]
        same = cold["text"] == warm["text"] == restored["text"]
        print(
            f"| {cold['usage']['prompt_tokens']} | {ttft(cold):.0f} | {ttft(warm):.0f} | {ttft(restored):.0f} "
            f"| {ttft(restored) / ttft(warm):.2f}x | {cached(warm)} / {cached(restored)} | {'yes' if same else 'NO'} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5B", choices=sorted(SHAPES), help="model shape (default: %(default)s)")
    ap.add_argument("--small", action="store_true", help="shortcut for --shape 0.1B")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="server weight dtype")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quantization", default=None, help="serve a converted copy with this scheme (e.g. q8)")
    ap.add_argument(
        "--concurrency", default=None, help="comma-separated stream counts (default: 1,4,16; mixed: 1,4,16,64)"
    )
    ap.add_argument("--tokens", type=int, default=None, help="tokens per stream (default: 32; mixed: 100)")
    ap.add_argument(
        "--workload",
        default="decode",
        choices=["decode", "mixed", "resume"],
        help="decode: the rounds and TTFT pairs above; mixed: the variable-length load; resume: conversations "
        "resumed after a restart from --state-store (default: %(default)s)",
    )
    ap.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=["rwkvserve", "llama-server"],
        help="also run the mixed load on this server (repeatable; implies --workload mixed)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="mixed: rounds of every concurrency (default: %(default)s)")
    ap.add_argument(
        "--requests-per-stream", type=int, default=2, help="mixed: requests each client sends (default: %(default)s)"
    )
    ap.add_argument(
        "--min-requests", type=int, default=8, help="mixed: at least this many requests a round (default: %(default)s)"
    )
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of every server (default: one per core)")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rwkv-engine-bench",
        help="where the peers are installed and built (bench_peers.py's; default: %(default)s)",
    )
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 2), help="llama.cpp build jobs")
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
    if args.peer:
        args.workload = "mixed"
    mixed = args.workload == "mixed"
    args.concurrency = [int(c) for c in (args.concurrency or ("1,4,16,64" if mixed else "1,4,16")).split(",")]
    args.tokens = args.tokens or (100 if mixed else 32)
    if args.baseline is not None and not (args.baseline / "rwkv_engine" / "__init__.py").is_file():
        raise SystemExit(f"--baseline: no rwkv_engine package in {args.baseline}")

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if mixed:
        run_mixed(args, work)
        return
    if args.workload == "resume":
        run_resume(args, work)
        return
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
