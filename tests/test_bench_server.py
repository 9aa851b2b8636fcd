"""The pure helpers of benchmarks/bench_server.py's mixed workload and peers (the benchmark itself
starts servers and is not run by the suite)."""

import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_server  # noqa: E402
import server_peers  # noqa: E402

from rwkv_engine import WorldTokenizer  # noqa: E402


def test_stream_reader_takes_sse_and_bare_json_cut_anywhere():
    objs = [{"choices": [{"text": "a}{b", "finish_reason": None}]}, {"choices": [], "usage": {"completion_tokens": 2}}]
    sse = "".join(f"data: {json.dumps(o)}\n\n" for o in objs) + "data: [DONE]\n\n"
    bare = "".join(json.dumps(o) for o in objs)  # rwkvserve: objects back to back
    rng = random.Random(0)
    for text in (sse, bare):
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), 6))
            reader, got = bench_server.StreamReader(), []
            for a, b in zip([0, *cuts], [*cuts, len(text)]):
                got += reader.feed(text[a:b])
            assert got == objs and not reader.buf.strip()


def test_percentile_interpolates_between_ranks():
    assert bench_server.percentile([3, 1, 2, 4], 50) == 2.5
    assert bench_server.percentile([5.0], 99) == 5.0
    assert bench_server.percentile(list(range(101)), 99) == 99
    assert math.isnan(bench_server.percentile([], 50))


def test_all_decoding_rate_counts_only_when_every_stream_decodes():
    # Two streams: A decodes over [0, 10] (11 chunks, 21 tokens: 2 after each first), B over [5, 15].
    a = {"times": [float(t) for t in range(0, 11)], "tokens": 21}
    b = {"times": [float(t) for t in range(5, 16)], "tokens": 21}
    # Both decode during (5, 10]: A's chunks at 6..10 and B's at 6..10, 2 tokens each, over 5 s.
    assert bench_server.all_decoding_rate([a, b], 2) == 20 / 5
    assert math.isnan(bench_server.all_decoding_rate([a], 2))  # never two at once


def test_prompt_texts_have_exact_token_counts():
    tok = WorldTokenizer()
    lengths = bench_server.prompt_lengths(12)
    assert lengths == bench_server.prompt_lengths(12) and min(lengths) >= 20 and max(lengths) <= 600
    texts = bench_server.prompt_texts(tok, lengths, salt="0.4")
    assert [len(tok.encode(t)) for t in texts] == lengths
    assert len({t[:12] for t in texts}) == len(texts)  # distinct from the start: no shared prefix to cache


def test_table_ratios_say_how_many_times_better_we_are():
    ours = {"c": 4, "output_tok_s": 30.0, "all_decoding_tok_s": math.nan, "ttft_p50_ms": 100.0}
    ours |= {"ttft_p99_ms": 200.0, "itl_p50_ms": 10.0, "itl_p99_ms": 40.0}
    theirs = dict(ours, output_tok_s=10.0, ttft_p50_ms=300.0, itl_p99_ms=20.0)
    table = bench_server.mixed_table({"rwkv-engine": [ours], "peer": [theirs]}, [4])
    row = table.splitlines()[-1].split(" | ")
    assert row[1:] == ["x vs peer", "3.00x", "-", "3.00x", "1.00x", "1.00x", "0.50x |"]


def test_rwkvserve_model_dir_from_a_checkpoint(tmp_path):
    from rwkv_engine.testing import random_state_dict, save_pth

    sd = random_state_dict(version="7", n_layer=2, n_embd=64, vocab_size=65536, head_size=16, seed=1)
    ckpt = save_pth(sd, tmp_path / "m.pth")
    out = server_peers.rwkvserve_model_dir(tmp_path, ckpt)
    config = json.loads((out / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["head_size_a"]) == (2, 64, 16)
    assert config["dim_ffn"] == sd["blocks.0.ffn.key.weight"].shape[0]
    assert config["dim_mv_lora"] == sd["blocks.1.att.v1"].shape[1]
    assert (out / "model.pth").resolve() == ckpt.resolve() and (out / "rwkv_vocab_v20230424.txt").exists()
