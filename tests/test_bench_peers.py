"""The pure helpers of benchmarks/bench_peers.py (the benchmark itself builds llama.cpp and is not
run by the suite)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_peers  # noqa: E402


def test_cpu_summary_x86_and_arm():
    x86 = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu sse avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 avx512vbmi\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    assert bench_peers.cpu_summary(x86) == (
        "AMD EPYC (family 25, model 17)",
        ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"],
    )
    arm = "processor\t: 0\nFeatures\t: fp asimd asimdhp asimddp i8mm sve\nCPU implementer\t: 0x41\n"
    assert bench_peers.cpu_summary(arm)[1] == ["asimd", "asimdhp", "asimddp", "i8mm", "sve"]


def test_parse_llama_bench_takes_best_prefill_and_median_decode():
    # the shape of `llama-bench -o json` (tools/llama-bench/llama-bench.cpp, json_printer), trimmed
    def test(n_prompt, n_gen, ts):
        return {
            "build_commit": "0c1e570",
            "cpu_info": "AMD EPYC",
            "n_threads": 2,
            "n_prompt": n_prompt,
            "n_gen": n_gen,
            "avg_ts": sum(ts) / len(ts),
            "samples_ts": ts,
        }

    out = bench_peers.parse_llama_bench(
        json.dumps([test(512, 0, [90.0, 120.0, 100.0]), test(0, 64, [20.0, 30.0, 22.0])])
    )
    assert out == {"prefill_tok_s": 120.0, "decode_tok_s": 22.0, "build_commit": "0c1e570", "cpu_info": "AMD EPYC"}


def test_table_ratios_are_ours_over_theirs_and_missing_sides_show_a_dash():
    ours = {"prefill_tok_s": 60.0, "decode_tok_s": 15.0, "peak_rss_mb": 2000}
    theirs = {"prefill_tok_s": 40.0, "decode_tok_s": 20.0, "peak_rss_mb": 1600}
    lines = bench_peers.table([("8", "q8", "Q8_0", ours, theirs), ("4", "q4", "Q4_0", None, theirs)]).splitlines()
    assert lines[2] == "| 8-bit | q8 / Q8_0 | 60.0 / 40.0 | 1.50 | 15.00 / 20.00 | 0.75 | 2000 / 1600 | 1.25 |"
    assert lines[3] == "| 4-bit | q4 / Q4_0 | - / 40.0 | - | - / 20.00 | - | - / 1600 | - |"


def test_summarize_medians_speeds_and_keeps_the_largest_peak():
    runs = [{"prefill_tok_s": p, "decode_tok_s": d, "peak_rss_mb": m} for p, d, m in [(1, 9, 5), (3, 7, 8), (2, 8, 6)]]
    assert bench_peers.summarize(runs) == {"prefill_tok_s": 2, "decode_tok_s": 8, "peak_rss_mb": 8}


def test_probe_lines_list_our_runs_probes_and_decode_speeds():
    runs = {
        "rwkv-engine bf16": [
            {"memory_read_gb_s": 35.18, "decode_tok_s": 10.95},
            {"memory_read_gb_s": 62.5, "decode_tok_s": 14.88},
        ],
        "llama.cpp F16": [{"decode_tok_s": 12.1}],
    }
    assert bench_peers.probe_lines(runs) == ["rwkv-engine bf16: probe GB/s 35.2, 62.5; decode tok/s 10.95, 14.88"]
