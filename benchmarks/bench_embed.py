"""Embedding throughput against the model's own prefill, and what an embedding job costs the chats.

    python benchmarks/bench_embed.py                    # 0.1B and 1.5B shapes (RWKV-7), all cores
    python benchmarks/bench_embed.py --shapes 0.1B --threads 2
    python benchmarks/bench_embed.py --dry-run          # tiny shapes, one round: proves it runs

Random-weight checkpoints of each shape are written once into --workdir: an EmbeddingRWKV
embedder (RWKV-7 blocks and its task heads) for (a), an RWKV-7 language model for (b).

(a) In one process, alternating rounds (so both columns come from the same minutes): embedding
    tokens/s of `rwkv_engine.embedding.Embedding` over --texts inputs of --length tokens with a
    budget of --batch rows (the pieces the server reads with --prefill-chunk = batch x length),
    against `model.prefill` of the same [batch, length] ids (the forward alone: no pooling, no
    task head). The ratio is what pooling and batching cost on top of the forward.
(b) A live `rwkv-engine serve` of the language model (which embeds with mean pooling): the time
    to first token of --chats streamed chats started together, alone, and again while a
    /v1/embeddings request of --job-texts texts is being read. Rounds alternate the two. The
    ratio is what the job costs a chat's first token (the engine gives it one prefill piece per
    turn; docs/server.md).

Machines are noisy and shared: compare numbers from the same run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_server import wait_ready

SHAPES = {"0.1B": (12, 768), "1.5B": (24, 2048), "tiny": (2, 64)}  # (n_layer, n_embd)


def checkpoints(work: Path, shape: str) -> tuple[Path, Path]:
    """(embedder, language model) checkpoints of `shape`, written once."""
    from rwkv_engine import testing

    L, C = SHAPES[shape]
    head = 64 if C >= 64 else 16
    work.mkdir(parents=True, exist_ok=True)
    emb, lm = work / f"embed-{shape}.pth", work / f"lm7-{shape}.pth"
    if not emb.exists():
        testing.save_pth(testing.random_embedder_state_dict(L, C, head_size=head, seed=1), emb)
    if not lm.exists():
        testing.save_pth(testing.random_state_dict("7", L, C, 65536, head, seed=2), lm)
    return emb, lm


def throughput(path: Path, args) -> None:
    """(a): embedding vs prefill tokens/s, alternating rounds in this process."""
    import torch

    import rwkv_engine
    from rwkv_engine.embedding import Embedding

    model = rwkv_engine.load(path, progress=False)
    g = torch.Generator().manual_seed(0)
    texts = torch.randint(1, 65535, (args.texts, args.length), generator=g)
    seqs = [t.tolist() + [65535] for t in texts]  # (the end token, as `encode` adds it)
    ids = torch.tensor(seqs[: args.batch])
    budget = args.batch * (args.length + 1)

    def embed_round() -> float:
        t0 = time.perf_counter()
        job = Embedding(model, seqs, budget=budget)
        while not job.done:
            job.step()
        return job.tokens / (time.perf_counter() - t0)

    def prefill_round() -> float:
        t0 = time.perf_counter()
        n = 0
        with torch.inference_mode():
            while n < len(seqs):
                model.prefill(ids)
                n += args.batch
        return n * ids.shape[1] / (time.perf_counter() - t0)

    embed_round(), prefill_round()  # warm-up
    e, p = [], []
    for _ in range(args.rounds):
        e.append(embed_round())
        p.append(prefill_round())
    me, mp = statistics.median(e), statistics.median(p)
    print(
        f"  (a) batch {args.batch} x {args.length + 1} tokens, {args.texts} texts: "
        f"embed {me:,.0f} tok/s, prefill {mp:,.0f} tok/s, embed/prefill {me / mp:.2f}"
    )


def start_server(path: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-c",
        "import sys; from rwkv_engine.cli import main; sys.exit(main())",
        "serve",
        str(path),
        "--port",
        "0",
        "--log-level",
        "warning",
        "--max-batch",
        str(args.chats),
        "--prefill-chunk",
        str(args.prefill_chunk),
        "--served-model-name",
        "bench",
        "--max-embedding-inputs",
        str(max(2048, args.job_texts)),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, wait_ready(proc, log, timeout=600)


async def ttft(client, url: str, i: int, tokens: int) -> float:
    """Seconds from sending a streamed chat to its first content."""
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": f"Tell me about river number {i} and its stones."}],
        "max_tokens": tokens,
        "stream": True,
        "logit_bias": {"0": -100},
    }
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        first = None
        async for line in r.aiter_lines():  # (read to the end: the chat keeps its batch row until then)
            if first is None and line.startswith("data: {"):
                if any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                    first = time.perf_counter() - t0
    if first is not None:
        return first
    raise RuntimeError("a chat produced no content")


async def chats_round(url: str, args, with_job: bool) -> list[float]:
    import httpx

    async with httpx.AsyncClient() as client:
        job = None
        if with_job:
            texts = [f"Document {i} about gardens, lanterns and copper, part {i % 7}." for i in range(args.job_texts)]
            job = asyncio.create_task(
                client.post(url + "/v1/embeddings", json={"model": "bench", "input": texts}, timeout=3600)
            )
            await asyncio.sleep(args.job_head_start)
        times = await asyncio.gather(*(ttft(client, url, i, args.chat_tokens) for i in range(args.chats)))
        if job is not None:
            if job.done():
                print("  (note: the embedding job ended before the chats did; use more --job-texts)")
            r = await job
            r.raise_for_status()
        return list(times)


def latency(path: Path, args) -> None:
    """(b): TTFT of the chats alone and during an embedding job, alternating rounds."""
    log = Path(args.workdir) / "bench_embed_server.log"
    proc, url = start_server(path, args, log)
    try:
        alone, during = [], []
        for _ in range(args.rounds):
            alone += asyncio.run(chats_round(url, args, False))
            during += asyncio.run(chats_round(url, args, True))
        ma, md = statistics.median(alone), statistics.median(during)
        print(
            f"  (b) TTFT of {args.chats} streamed chats: alone median {ma * 1000:.0f} ms (max {max(alone) * 1000:.0f}), "
            f"during a {args.job_texts}-text embedding job median {md * 1000:.0f} ms (max {max(during) * 1000:.0f}), "
            f"ratio {md / ma:.2f}"
        )
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.1B,1.5B", help="comma-separated, of " + ", ".join(SHAPES))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--texts", type=int, default=256, help="(a) inputs per round")
    ap.add_argument("--length", type=int, default=31, help="(a) tokens per input (+ the end token)")
    ap.add_argument("--batch", type=int, default=8, help="(a) rows per forward")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--chat-tokens", type=int, default=16)
    ap.add_argument("--job-texts", type=int, default=1000)
    ap.add_argument("--job-head-start", type=float, default=0.5, help="(b) seconds the job runs before the chats")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--skip", choices=["throughput", "latency"], help="leave one part out")
    ap.add_argument("--workdir", default="/tmp/rwkv-engine-bench")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, small sizes, one round: proves it runs")
    args = ap.parse_args()
    if args.dry_run:
        args.shapes, args.texts, args.length, args.rounds = "tiny", 16, 7, 1
        args.job_texts, args.chat_tokens, args.job_head_start = 100, 4, 0.05
    import torch

    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; {'DRY RUN (no timing claims)' if args.dry_run else ''}")
    for shape in args.shapes.split(","):
        emb, lm = checkpoints(Path(args.workdir), shape)
        print(f"{shape} (RWKV-7, {SHAPES[shape][0]} x {SHAPES[shape][1]}):")
        if args.skip != "throughput":
            throughput(emb, args)
        if args.skip != "latency":
            latency(lm, args)


if __name__ == "__main__":
    main()
