"""Ray Serve scale-out: aggregate decode tok/s with 1 and 2 engine replicas, the prefix-affinity hit
rate with a shared system prompt, and the memory of each replica (RSS and PSS: pages of a mapped
converted directory are shared between replicas on one node, so PSS counts them once).

    python benchmarks/bench_ray.py                        # 12 x 768 model, q8 directory, 16 streams
    python benchmarks/bench_ray.py --layers 24 --embd 2048 --streams 16 --requests 48

It writes a random-weight RWKV-5.2 checkpoint, converts it (`rwkv-engine convert -q q8`) so that
replicas map one file, serves it on a local Ray instance with `--replicas 1` and then 2 (the same
process and the same requests, so the rows compare), and sends chat requests that all start with
the same long system prompt from `--streams` concurrent clients. On a 2-core machine a second
replica has no core of its own: expect little gain there; the table shows what routing keeps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SYSTEM = (
    "You are a helpful, careful assistant for a small hardware shop. You answer questions about "
    "tools, opening hours and orders in two sentences or fewer, you never invent prices, and when "
    "a question is unclear you ask one short question back. "
) * 6


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _replica_memory() -> list[tuple[int, float, float]]:
    """(pid, RSS MB, PSS MB) of every engine replica process on this node."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if "EngineReplica" not in cmd:
                continue
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        kb = {k: int(v) for k, v in re.findall(r"^(Rss|Pss):\s+(\d+) kB", rollup, re.M)}
        out.append((int(pid), kb.get("Rss", 0) / 1024, kb.get("Pss", 0) / 1024))
    return out


async def _drive(url: str, model: str, streams: int, requests: int, max_tokens: int) -> tuple[float, int, list[float]]:
    """(seconds, completion tokens, time to first token of each request) for `requests` chats."""
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    tokens, ttfts = 0, []

    async def client() -> None:
        nonlocal tokens
        async with httpx.AsyncClient(timeout=600) as http:
            while not queue.empty():
                i = queue.get_nowait()
                body = {
                    "model": model,
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "top_p": 0.5,
                    "seed": i,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Customer {i}: do you sell a size {i % 9 + 1} wrench?"},
                    ],
                }
                t0 = time.perf_counter()
                first = None
                async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                            first = time.perf_counter() - t0
                        if chunk.get("usage"):
                            tokens += chunk["usage"]["completion_tokens"]
                ttfts.append(first or 0.0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    return time.perf_counter() - t0, tokens, ttfts


def run_one(model_dir: Path, replicas: int, args) -> dict:
    import ray
    from ray import serve

    from rwkv_engine.serve.ray import build_app, free_port

    ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1", object_store_memory=256 << 20)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app(
            [
                str(model_dir),
                "--replicas",
                str(replicas),
                "--max-batch",
                str(args.max_batch),
                "--replica-cpus",
                str(args.replica_cpus),
                "--prefill-chunk",
                str(args.prefill_chunk),
            ]
        ),
        name="rwkv-engine",
        route_prefix="/",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_drive(url, model_dir.name, 2, 2, 4))  # warm-up (kernels, caches)
        before = _metrics(url)
        seconds, tokens, ttfts = asyncio.run(_drive(url, model_dir.name, args.streams, args.requests, args.max_tokens))
        time.sleep(2.5)  # replicas publish metrics every second
        after = _metrics(url)
        memory = _replica_memory()
    finally:
        serve.shutdown()
        ray.shutdown()
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    routed = sum(v for k, v in delta.items() if k.startswith("rwkv_engine_route_total"))
    affinity = sum(v for k, v in delta.items() if k.startswith("rwkv_engine_route_total") and 'route="affinity"' in k)
    hits = delta.get("rwkv_engine_prompt_cache_hits_total", 0.0)
    misses = delta.get("rwkv_engine_prompt_cache_misses_total", 0.0)
    ttfts.sort()
    return {
        "replicas": replicas,
        "tok_s": tokens / seconds,
        "requests": args.requests,
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
        "affinity": affinity / routed if routed else 0.0,
        "cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "rss_mb": [round(r, 1) for _, r, _ in memory],
        "pss_mb": [round(p, 1) for _, _, p in memory],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=128, help="also the routing key's length in tokens")
    ap.add_argument("--replica-cpus", type=float, default=1.0)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "rwkv-bench-ray")
    args = ap.parse_args()

    from rwkv_engine import testing

    args.workdir.mkdir(parents=True, exist_ok=True)
    tag = f"v52-{args.layers}x{args.embd}"
    pth, model_dir = args.workdir / f"{tag}.pth", args.workdir / f"{tag}-q8"
    if not model_dir.exists():
        sd = testing.random_state_dict(
            "5.2", n_layer=args.layers, n_embd=args.embd, vocab_size=65536, head_size=64, seed=0
        )
        testing.save_pth(sd, pth)
        del sd
        subprocess.run(
            [sys.executable, "-m", "rwkv_engine", "convert", str(pth), str(model_dir), "-q", "q8"], check=True
        )
        pth.unlink()
    info = open("/proc/cpuinfo").read()
    cpu = re.search(r"^model name\s*:\s*(.*)$", info, re.M).group(1)
    isa = "AVX-512" if " avx512f" in info else "AVX2" if " avx2" in info else "no AVX2"
    print(
        f"CPU: {cpu} ({isa}), {os.cpu_count()} cores; model {tag} q8 ({model_dir}); {args.streams} streams, "
        f"{args.requests} chats of {args.max_tokens} tokens sharing a {len(SYSTEM)}-character system prompt"
    )
    rows = [run_one(model_dir, n, args) for n in (1, 2)]
    print(
        "| replicas | aggregate tok/s | x 1 replica | TTFT p50 / p99 s | routed by affinity | prompt-cache hit rate | RSS MB per replica | PSS MB per replica |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['replicas']} | {r['tok_s']:.1f} | {r['tok_s'] / rows[0]['tok_s']:.2f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} "
            f"| {r['affinity']:.0%} | {r['cache_hit_rate']:.0%} | {', '.join(map(str, r['rss_mb']))} | {', '.join(map(str, r['pss_mb']))} |"
        )


if __name__ == "__main__":
    main()
