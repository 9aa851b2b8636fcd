"""benchmarks/bench_kernels.py's step section on a small random checkpoint (ours only: a baseline
build would compile a second set of kernels)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_kernels  # noqa: E402

from rwkv_engine import testing  # noqa: E402
from rwkv_engine.kernels import native  # noqa: E402


@pytest.mark.skipif(native.load() is None, reason="native kernels unavailable here")
def test_step_section_times_decode_steps_per_batch(tmp_path, capsys):
    ckpt = testing.save_pth(testing.random_state_dict("7", n_layer=2, n_embd=64, vocab_size=256), tmp_path / "m.pth")
    threads = torch.get_num_threads()
    try:
        assert (
            bench_kernels.main(
                ["--only", "step", "--model", str(ckpt), "--batches", "1,3", "--steps", "4", "--threads", "1"]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert [r[0] for r in rows] == ["| 1", "| 3"]
    assert all(float(r[-1].rstrip(" |")) > 0 for r in rows)  # tok/s


def test_step_section_needs_an_existing_model(tmp_path, capsys):
    for extra in ([], ["--model", str(tmp_path / "missing")]):
        with pytest.raises(SystemExit) as e:
            bench_kernels.main(["--only", "step", *extra])
        assert e.value.code == 2 and "--only step needs --model" in capsys.readouterr().err
