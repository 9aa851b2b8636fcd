"""The bandwidth probe of `rwkv-engine bench` (cli/bench.py read_bandwidth): its buffer is capped and
never sized by the CPU's cache, it reads several patterns (our own GEMVs among them), and bench's
peak RSS is the model's alone (issue 28 R11: 16 x a 300 MB L3 was a 4.8 GB buffer in the peak)."""

import builtins
import io
import json
import subprocess
import sys

import pytest

from rwkv_engine import testing
from rwkv_engine.cli import bench
from rwkv_engine.kernels import native


def test_probe_buffer_is_capped_and_follows_the_free_memory(monkeypatch):
    monkeypatch.setattr(bench, "_mem_available_bytes", lambda: 64 << 30)
    assert bench.probe_bytes() == bench.PROBE_CAP_BYTES == 1 << 30
    monkeypatch.setattr(bench, "_mem_available_bytes", lambda: 1 << 30)  # a small machine: a quarter
    assert bench.probe_bytes() == 256 << 20
    monkeypatch.setattr(bench, "_mem_available_bytes", lambda: None)
    assert bench.probe_bytes() == bench.PROBE_CAP_BYTES


def test_probe_never_reads_the_cache_size(monkeypatch):
    opened = []
    real = builtins.open

    def spy(file, *a, **k):
        opened.append(str(file))
        return real(file, *a, **k)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    bench.probe_bytes()
    bench.read_bandwidth(repeats=1, nbytes=16 << 20)
    assert not [f for f in opened if "/cache" in f], opened


def test_probe_reports_the_best_of_its_patterns():
    r = bench.read_bandwidth(repeats=2, nbytes=32 << 20)
    assert r["buffer_mb"] == 32
    expected = {"sum", "sum_1_thread", "strided"} | ({"gemv_q8", "gemv_bf16"} if native.load() else set())
    assert set(r["patterns"]) == expected
    assert all(v > 0 for v in r["patterns"].values())
    assert r["gb_s"] == max(r["patterns"].values()) == r["patterns"][r["pattern"]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak RSS reset is Linux's (clear_refs)")
def test_bench_peak_rss_excludes_the_probe(tmp_path):
    sd = testing.random_state_dict("5.2", n_layer=2, n_embd=64, vocab_size=1024, head_size=16, seed=3)
    path = testing.save_pth(sd, tmp_path / "tiny.pth")
    cmd = [sys.executable, "-m", "rwkv_engine", "bench", str(path), "--prompt-len", "8", "--decode-tokens", "2"]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert 0 < r["memory_probe_mb"] <= 1024
    assert r["memory_read_gb_s"] == max(r["memory_read_patterns_gb_s"].values())
    assert r["memory_read_pattern"] in r["memory_read_patterns_gb_s"]
    assert r["decode_bound_tok_s"] > 0
    # the tiny model and torch take a few hundred MB; the probe's GB buffer is not in the peak
    if r["memory_probe_mb"] == 1024:
        assert r["peak_rss_mb"] < 1024, r
