"""What constrained decoding costs, on the World vocabulary (65536 tokens).

    python benchmarks/bench_structured.py [--steps 200] [--rounds 3]

1. Grammar engines, llguidance against xgrammar, same schema, same random walks (rounds
   alternate the two): building the engine's tokenizer from the World vocabulary, compiling
   the schema (for llguidance, whose compilation is lazy, the first mask is included), the mean
   and 95th-percentile time of one next-token mask, and how many walks ended in JSON that
   validates (`jsonschema`). A walk draws uniformly among the allowed tokens (leaning to
   structural ones so that walks end), which exercises every kind of token the vocab has,
   the byte tokens of partial UTF-8 characters included.
2. The engine's sampler: ms per `Sampler.sample_batch` on random logits for a batch of 1 and 8
   with 0, 1 and all rows constrained (a JSON schema of an endless array, so rows never
   finish), and for scale the ms of one decode forward of the 0.1B World shape at that batch.

Machines are noisy and shared: read the numbers of one run against each other.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
ENDLESS = {"type": "array", "items": {"type": "string", "maxLength": 8}}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        from rwkv_engine import structured

        t0 = time.perf_counter()
        structured.grammar_tokenizer.cache_clear()
        self.llt = structured.grammar_tokenizer(tok, 65536)
        self.tokenizer_s = time.perf_counter() - t0
        import llguidance

        self.llg = llguidance
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=structured.JSON_OPTIONS)

    def compile(self):
        m = self.llg.LLMatcher(self.llt, self.grammar, log_level=0)
        bm = torch.full((1, 2048), -1, dtype=torch.int32)
        m.unsafe_compute_mask_ptr(bm.data_ptr(), 2048 * 4)  # lazy: the first mask builds the lexer
        return m

    def walker(self):
        m = self.llg.LLMatcher(self.llt, self.grammar, log_level=0)
        return (lambda bm: m.unsafe_compute_mask_ptr(bm.data_ptr(), 2048 * 4)), m.consume_token


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar

        self.xgr = xgrammar
        t0 = time.perf_counter()
        vocab = [tok.decode_bytes([i]) for i in range(65536)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=65536, stop_token_ids=[0])
        self.tokenizer_s = time.perf_counter() - t0
        self.info = info

    def compile(self):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        return self.compiled

    def walker(self):
        m = self.xgr.GrammarMatcher(self.compiled)
        return (lambda bm: m.fill_next_token_bitmask(bm, 0)), m.accept_token


def walk(engine, tok, seed: int, steps: int, structural: list[bool]) -> tuple[list[float], bytes | None]:
    """One random walk; (mask seconds per step, the JSON bytes if it ended)."""
    from rwkv_engine.structured import unpack_bits

    rng = random.Random(seed)
    fill, accept = engine.walker()
    bm = torch.full((1, 2048), -1, dtype=torch.int32)
    out, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill(bm)
        times.append(time.perf_counter() - t0)
        allowed = unpack_bits(bm, 65536)[0].nonzero()[:, 0].tolist()
        if 0 in allowed and (rng.random() < 0.9 or allowed == [0]):
            return times, tok.decode_bytes(out)
        allowed = [t for t in allowed if t != 0]
        preferred = [t for t in allowed if structural[t]]
        t = rng.choice(preferred if preferred and rng.random() < 0.7 else allowed)
        assert accept(t)
        out.append(t)
    return times, None


def bench_engines(tok, args) -> None:
    import jsonschema

    structural = [any(c in tok.decode_bytes([i]) for c in b'"}],0123456789') for i in range(65536)]
    engines = [LLGuidance(tok), XGrammar(tok)]
    stats = {e.name: {"compile": [], "mask": [], "valid": 0, "ended": 0, "walks": 0} for e in engines}
    for r in range(args.rounds):
        for e in engines if r % 2 == 0 else engines[::-1]:
            s = stats[e.name]
            t0 = time.perf_counter()
            e.compile()
            s["compile"].append(time.perf_counter() - t0)
            for seed in range(r * 10, r * 10 + 10):
                times, out = walk(e, tok, seed, args.steps, structural)
                s["mask"] += times[1:]  # (the first mask of a walk is the compile's, for llguidance)
                s["walks"] += 1
                if out is not None:
                    s["ended"] += 1
                    try:
                        jsonschema.validate(json.loads(out), SCHEMA)
                        s["valid"] += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
    print(
        "\n| engine | tokenizer from vocab s | compile ms (median) | mask ms mean | mask ms p95 | valid / ended walks |"
    )
    print("|---|---|---|---|---|---|")
    for e in engines:
        s = stats[e.name]
        mask = sorted(s["mask"])
        print(
            f"| {e.name} | {e.tokenizer_s:.2f} | {1e3 * statistics.median(s['compile']):.1f} | "
            f"{1e3 * statistics.mean(mask):.3f} | {1e3 * mask[int(0.95 * len(mask))]:.3f} | "
            f"{s['valid']} / {s['ended']} (of {s['walks']}) |"
        )


def bench_sampler(tok, args) -> None:
    import rwkv_engine
    from rwkv_engine import SamplingParams
    from rwkv_engine.sampling import Sampler
    from rwkv_engine.structured import json_grammar
    from rwkv_engine.testing import random_state_dict, save_pth

    grammar = json_grammar(ENDLESS, tok, 65536)
    params = SamplingParams(temperature=1.0, top_p=0.3, presence_penalty=0.5, frequency_penalty=0.5)
    with tempfile.TemporaryDirectory() as d:
        path = save_pth(
            random_state_dict(version="5.2", n_layer=12, n_embd=768, vocab_size=65536, head_size=64, seed=1),
            Path(d) / "small.pth",
        )
        model = rwkv_engine.load(path)
    gen = torch.Generator().manual_seed(0)
    print("\n| batch | constrained rows | sample_batch ms / step | x unconstrained | forward ms / step (0.1B) |")
    print("|---|---|---|---|---|")
    for B in (1, 8):
        if True:
            _, state = model.forward(torch.zeros(B, 1, dtype=torch.long))
            t0 = time.perf_counter()
            for _ in range(5):
                model.forward(torch.zeros(B, 1, dtype=torch.long), state=state)
            forward_ms = 1e3 * (time.perf_counter() - t0) / 5
        base = None
        for n in sorted({0, 1, B}):
            samplers = [
                Sampler(params.replace(seed=b), 65536, constraint=grammar.constraint() if b < n else None)
                for b in range(B)
            ]
            times = []
            for _ in range(args.steps):
                logits = torch.randn(B, 65536, generator=gen) * 3
                t0 = time.perf_counter()
                Sampler.sample_batch(samplers, logits)
                times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            base = base or ms
            print(f"| {B} | {n} | {ms:.2f} | {ms / base:.2f} | {forward_ms:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="mask steps per walk / sampler steps per row count")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two grammar engines")
    args = ap.parse_args()
    from rwkv_engine.tokenizer import WorldTokenizer

    tok = WorldTokenizer()
    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}")
    bench_engines(tok, args)
    bench_sampler(tok, args)


if __name__ == "__main__":
    main()
