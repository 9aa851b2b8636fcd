"""Our logits on llama.cpp's own GGUF files against llama.cpp's logits on the same files.

    python benchmarks/bench_gguf_logits.py                  # 4 x 256 RWKV-7, vocab 65536, F16 / Q8_0 / Q4_0
    python benchmarks/bench_gguf_logits.py --version 6.0 --layers 6 --width 512

A random RWKV-6/7 checkpoint is written in the Hugging Face / flash-linear-attention layout with the
World vocabulary and converted by llama.cpp's convert_hf_to_gguf.py (the llama-cpp-python sdist's
tree that bench_peers.py fetches and caches) to F16 and Q8_0; Q4_0 is made from the F16 file by
llama.cpp's own quantizer (llama_model_quantize, through the llama-cpp-python package). llama.cpp's
logits come from llama-cpp-python (`pip install llama-cpp-python==0.3.36`: it builds llama.cpp),
ours from `rwkv_engine.load(gguf, dtype="fp32")`, for every position of one prompt. The table
shows the relative RMS difference of the logits (ours vs llama.cpp's on the same file, and each
against the fp32 .pth) and how often the top token agrees. llama.cpp multiplies quantized matrices
with 8-bit-quantized activations, we with fp32 ones, so its differences from the .pth are larger.
Without llama-cpp-python the script says so and stops.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_peers import LLAMA_CPP_PYTHON, VOCAB, llama_tree

ROOT = Path(__file__).resolve().parents[1]


def llama_logits(path: Path, ids: list[int], threads: int):
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=len(ids) + 8, logits_all=True, verbose=False, n_threads=threads, n_batch=len(ids))
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))


def quantize_q4_0(src: Path, dst: Path, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError("llama_model_quantize failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="7", choices=["6.0", "7"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rwkv-engine-bench",
    )
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(f"bench_gguf_logits: skipped: needs llama-cpp-python=={LLAMA_CPP_PYTHON}", file=sys.stderr)
        return
    import rwkv_engine
    from rwkv_engine import testing

    tree = llama_tree(args.cache)
    sd = testing.random_state_dict(
        args.version, n_layer=args.layers, n_embd=args.width, vocab_size=65536, head_size=64, seed=1
    )
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 65530, (args.tokens,), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        pth = testing.save_pth(sd, d / "m.pth")
        hf = testing.save_hf_dir(sd, d / "hf", args.version)
        shutil.copy(ROOT / "rwkv_engine" / "data" / VOCAB, hf / VOCAB)
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the tree's gguf-py
        files = {}
        for t in ("f16", "q8_0"):
            files[t.upper()] = d / f"m-{t}.gguf"
            subprocess.run(
                [sys.executable, tree / "convert_hf_to_gguf.py", hf, "--outtype", t, "--outfile", files[t.upper()]],
                check=True,
                env=env,
                capture_output=True,
            )
        files["Q4_0"] = d / "m-q4_0.gguf"
        quantize_q4_0(files["F16"], files["Q4_0"], args.threads)
        src = rwkv_engine.load(pth, dtype="fp32", progress=False).forward(ids, all_logits=True)[0]

        def rel(a, b):
            return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

        def agree(a, b):
            return float((a.argmax(-1) == b.argmax(-1)).float().mean())

        print(
            f"RWKV-{args.version} {args.layers} x {args.width}, vocab 65536, {args.tokens} tokens; "
            f"llama.cpp of llama-cpp-python {LLAMA_CPP_PYTHON}; {args.threads} threads"
        )
        print("| GGUF | ours vs llama.cpp | top-1 agree | ours vs .pth | llama.cpp vs .pth |")
        print("|---|---|---|---|---|")
        for t, path in files.items():
            theirs = llama_logits(path, ids, args.threads)
            ours = rwkv_engine.load(path, dtype="fp32", progress=False).forward(ids, all_logits=True)[0]
            print(
                f"| {t} | {rel(ours, theirs):.2e} | {agree(ours, theirs):.3f} | {rel(ours, src):.2e} | "
                f"{rel(theirs, src):.2e} |"
            )


if __name__ == "__main__":
    main()
