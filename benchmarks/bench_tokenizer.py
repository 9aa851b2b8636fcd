"""World tokenizer speed: ours (native C trie, pure-Python fallback) beside the reference.

    python benchmarks/bench_tokenizer.py [--mb 5] [--repeat 3] [--seed 0]

Builds a deterministic mixed corpus (English-like prose, code, CJK, emoji, whitespace; see
rwkv_engine/testing/corpus.py), then measures encode and decode MB/s (of UTF-8 input / output)
for each tokenizer in the same run, best of --repeat, with the ratio to the reference
`rwkv.rwkv_tokenizer.TRIE_TOKENIZER`, and checks that every tokenizer gives the reference's ids
and text back. The machine is shared and noisy: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def best_time(fn, repeat: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=5.0, help="corpus size in MB (default 5)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement, best kept")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import rwkv
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    from rwkv_engine.testing.corpus import mixed_corpus
    from rwkv_engine.tokenizer import WorldTokenizer, native_available

    text = mixed_corpus(int(args.mb * 1e6), seed=args.seed)
    size = len(text.encode("utf-8"))
    print(f"corpus: {size / 1e6:.2f} MB, {len(text):,} chars, seed {args.seed}, best of {args.repeat}")

    tokenizers = []
    start = time.perf_counter()
    ref = TRIE_TOKENIZER(os.path.join(os.path.dirname(rwkv.__file__), "rwkv_vocab_v20230424.txt"))
    tokenizers.append(("reference TRIE_TOKENIZER", ref, time.perf_counter() - start))
    if native_available():
        start = time.perf_counter()
        tokenizers.append(("ours, native", WorldTokenizer(native=True), time.perf_counter() - start))
    else:
        print("ours, native: NOT BUILT (pip install -e . or python setup.py build_ext --inplace)")
    start = time.perf_counter()
    tokenizers.append(("ours, pure Python", WorldTokenizer(native=False), time.perf_counter() - start))

    rows = []
    ref_ids = None
    ok = True
    for name, tok, load_s in tokenizers:
        enc_s, ids = best_time(lambda: tok.encode(text), args.repeat)
        dec_s, back = best_time(lambda: tok.decode(ids), args.repeat)
        if ref_ids is None:
            ref_ids = ids
        agrees = ids == ref_ids and back == text
        ok &= agrees
        rows.append((name, load_s, size / enc_s / 1e6, size / dec_s / 1e6, len(ids), agrees))

    ref_enc, ref_dec = rows[0][2], rows[0][3]
    print(f"tokens: {len(ref_ids):,} ({size / len(ref_ids):.2f} bytes/token)")
    print()
    print(
        f"{'tokenizer':<26} {'load s':>7} {'encode MB/s':>12} {'x ref':>7} "
        f"{'decode MB/s':>12} {'x ref':>7}  ids+text == reference"
    )
    for name, load_s, enc, dec, _n, agrees in rows:
        print(
            f"{name:<26} {load_s:>7.2f} {enc:>12.1f} {enc / ref_enc:>7.1f} "
            f"{dec:>12.1f} {dec / ref_dec:>7.1f}  {'yes' if agrees else 'NO'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
