"""Rerank throughput: documents read together (`embedding.Reranking`) against each read alone.

    python benchmarks/bench_rerank.py                      # 0.1B shape (RWKV-7), all cores
    python benchmarks/bench_rerank.py --threads 2 --docs 64
    python benchmarks/bench_rerank.py --dry-run            # a tiny shape, one round: proves it runs

A random-weight EmbeddingRWKV embedder of the shape and a reranker over it are written once into
--workdir. Each round scores --docs documents against one query with the engine's piece budget
(--prefill-chunk), no cache, two ways, alternating (so both columns come from the same minutes):

* together: `Reranking` as the server runs it (groups of budget // query length documents in
  length order, the uncached prefixes of one length in a group read as one batch);
* alone: each document prefix read by itself in pieces of the budget (`model.prefill`), then the
  query on top of the group's states (`Reranker.score_ids`): how Reranking read them before.

Two document sets: every document of --length tokens ("equal"), and lengths spread evenly over
[--length / 4, 2 * --length] ("spread"). Reported: documents per second (median of rounds) and
the ratio. Machines are noisy and shared: compare numbers from the same run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

SHAPES = {"0.1B": (12, 768), "1.5B": (24, 2048), "tiny": (2, 64)}  # (n_layer, n_embd)


def load(work: Path, shape: str):
    import rwkv_engine
    from rwkv_engine import testing
    from rwkv_engine.embedding import load_reranker

    L, C = SHAPES[shape]
    head = 64 if C >= 64 else 16
    work.mkdir(parents=True, exist_ok=True)
    emb, rr = work / f"embed-{shape}.pth", work / f"rerank-{shape}.pth"
    if not emb.exists():
        testing.save_pth(testing.random_embedder_state_dict(L, C, head_size=head, seed=1), emb)
    if not rr.exists():
        testing.save_pth(testing.random_reranker_state_dict(2, C, head_size=head, seed=2, layers=[0, L - 1]), rr)
    model = rwkv_engine.load(emb, progress=False)
    return model, load_reranker(model, rr, progress=False)


def documents(n: int, length: int, spread: bool) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(n + length + spread)
    lengths = [length] * n if not spread else [length // 4 + (i * (2 * length - length // 4)) // n for i in range(n)]
    return [torch.randint(1, 65000, (k,), generator=g).tolist() for k in lengths]


def together(reranker, docs, query, budget):
    from rwkv_engine.embedding import Reranking

    job = Reranking(reranker, docs, query, budget)
    while not job.done:
        job.step()
    return job.scores


def alone(reranker, docs, query, budget):
    import torch

    from rwkv_engine.state import State

    model, rows, scores = reranker.embedder, max(1, budget // len(query)), []
    with torch.inference_mode():
        for first in range(0, len(docs), rows):
            states = []
            for ids in docs[first : first + rows]:
                state = None
                for pos in range(0, len(ids), budget):
                    state = model.prefill(ids[pos : pos + budget], state)
                states.append(state)
            scores.append(torch.sigmoid(reranker.score_ids(State.cat(states), query)))
    return torch.cat(scores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="0.1B", help="comma-separated, of " + ", ".join(SHAPES))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--docs", type=int, default=64, help="documents per round")
    ap.add_argument("--length", type=int, default=48, help="tokens per document (the equal set)")
    ap.add_argument("--query", type=int, default=12, help="query tokens (with the end token)")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="the piece budget")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/rwkv-engine-bench")
    ap.add_argument("--dry-run", action="store_true", help="a tiny shape, few documents, one round")
    args = ap.parse_args()
    if args.dry_run:
        args.shapes, args.docs, args.rounds = "tiny", 8, 1

    import torch

    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, {args.docs} documents, query {args.query} tokens, budget {args.prefill_chunk}")
    print(f"{'shape':<6} {'set':<7} {'together docs/s':>16} {'alone docs/s':>13} {'ratio':>6} {'max |diff|':>11}")
    for shape in args.shapes.split(","):
        model, reranker = load(Path(args.workdir), shape)
        query = list(range(100, 100 + args.query - 1)) + [65535]
        for name, spread in (("equal", False), ("spread", True)):
            docs = documents(args.docs, args.length, spread)
            rates = {"together": [], "alone": []}
            diff = 0.0
            for _ in range(args.rounds):
                got = {}
                for way, run in (("together", together), ("alone", alone)):
                    t0 = time.perf_counter()
                    got[way] = run(reranker, docs, query, args.prefill_chunk)
                    rates[way].append(len(docs) / (time.perf_counter() - t0))
                diff = max(diff, float((got["together"] - got["alone"]).abs().max()))
            a, b = statistics.median(rates["together"]), statistics.median(rates["alone"])
            print(f"{shape:<6} {name:<7} {a:>16.1f} {b:>13.1f} {a / b:>6.2f} {diff:>11.1e}", flush=True)


if __name__ == "__main__":
    main()
