"""What one decode step of the server costs per row, phase by phase (issue 38 item 3).

    python benchmarks/bench_decode_rows.py [--rows 16 64] [--steps 12] [--threads 2]

Builds the 0.1B RWKV-7 shape (12 x 768, World vocabulary) with random weights (bf16), puts
`--rows` rows in a `serve.decode.DecodeBatch` as the engine does (a `Sampler`, a `TextStream`
and a sink per row; the sink hands events to an asyncio loop on another thread, as
serve/jobs.py does), and runs decode steps. Prints the mean seconds per step of each phase
`DecodeBatch.step` reports: forward, sample (deciding the tokens: bias, penalties, the draw,
log-probabilities) and stream (detokenizing, stop strings, the events).

The rows cycle through the kinds a server sees: greedy; temperature + top_p; the chat preset
(presence and frequency penalties, top_p 0.3); logit_bias with top_k; a stop string and
logprobs. A random model's distribution is flat (its top_p 0.85 nucleus holds tens of
thousands of tokens), the costliest case for a top-p cut; `--peaked` scales the logits' spread
up by feeding the sampler logits x 8 instead (a trained model's shape: a nucleus of a few tokens).

Machines are noisy and shared: read the numbers of one run against each other.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
from pathlib import Path

import torch

import rwkv_engine
from rwkv_engine import testing
from rwkv_engine.generation import TextStream
from rwkv_engine.sampling import Sampler, SamplingParams
from rwkv_engine.serve import decode
from rwkv_engine.serve.messages import Request
from rwkv_engine.serve.metrics import Metrics
from rwkv_engine.serve.work import Group, Row
from rwkv_engine.tokenizer import WorldTokenizer

KINDS = {
    "greedy": SamplingParams(temperature=0.0),
    "top_p": SamplingParams(temperature=1.0, top_p=0.85, seed=1),
    "penalties": SamplingParams(temperature=1.0, top_p=0.3, presence_penalty=0.5, frequency_penalty=0.5, seed=2),
    "bias": SamplingParams(temperature=0.7, top_k=40, logit_bias={11: 2.0, 33: -5.0, 261: 1.5}, seed=3),
    "stop+logprobs": SamplingParams(temperature=1.0, top_p=0.9, stop=("\n\nUser:", "###"), seed=4),
}


def checkpoint(path: Path) -> Path:
    if not path.exists():
        sd = testing.random_state_dict("7", n_layer=12, n_embd=768, vocab_size=65536, head_size=64)
        testing.save_pth(testing.cast(sd, torch.bfloat16), path)
    return path


def make_rows(model, tokenizer, n: int, loop: asyncio.AbstractEventLoop) -> list[tuple[Row, object]]:
    metrics = Metrics()
    received = []
    entries = []
    for i in range(n):
        name = list(KINDS)[i % len(KINDS)]
        params = KINDS[name].replace(max_tokens=None, stop_token_ids=())
        request = Request([1, 2, 3], params, logprobs=2 if name == "stop+logprobs" else None)

        def sink(event, _r=received):
            loop.call_soon_threadsafe(_r.append, event)

        group = Group(i, request, sink, metrics, lambda g: None)
        row = Row(group, 0, Sampler(params, 65536), TextStream(tokenizer, params))
        group.rows = [row]
        row.decoding, row.next_token = True, 1000 + i
        entries.append((row, model.new_state(1)))
    return entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peaked", action="store_true", help="sample from logits x 8 (a few-token nucleus)")
    ap.add_argument("--checkpoint", default="/tmp/rwkv7-0.1B-random-bf16.pth")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = rwkv_engine.load(checkpoint(Path(args.checkpoint)), dtype="bf16", progress=False)
    tokenizer = WorldTokenizer()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    if args.peaked:
        plain = decode.decode_rows

        def peaked(*a, **kw):
            logits, after = plain(*a, **kw)
            return logits * 8, after

        decode.decode_rows = peaked
    print(f"rwkv-engine {rwkv_engine.__file__}, torch {torch.__version__}, {args.threads} threads")
    print(f"rows kinds (cycled): {', '.join(KINDS)}; logits {'x 8 (peaked)' if args.peaked else 'as the model gives'}")
    print(f"{'rows':>5} {'forward ms':>11} {'sample ms':>10} {'stream ms':>10} {'sample+stream us/row':>21}")
    for n in args.rows:
        batch = decode.DecodeBatch(model, "bench")
        batch.join(make_rows(model, tokenizer, n, loop))
        times = []
        for step in range(args.steps + 2):
            t = batch.step()
            if step >= 2:  # warm-up steps
                times.append(t)
        assert len(batch) == n, "a row ended"
        fwd, smp, stm = (statistics.mean(t[i] for t in times) * 1e3 for i in range(3))
        print(f"{n:>5} {fwd:>11.1f} {smp:>10.2f} {stm:>10.2f} {(smp + stm) * 1e3 / n:>21.0f}")
    loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
