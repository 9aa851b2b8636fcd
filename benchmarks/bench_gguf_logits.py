"""Our logits on llama.cpp's own GGUF files against llama.cpp's logits on the same files.

    python benchmarks/bench_gguf_logits.py                  # 4 x 256 RWKV-7, vocab 65536
    python benchmarks/bench_gguf_logits.py --layers 12 --width 768   # the 0.1B shape
    python benchmarks/bench_gguf_logits.py --version 6.0 --types F16,Q4_K_M

A random RWKV-6/7 checkpoint is written in the Hugging Face / flash-linear-attention layout with the
World vocabulary and converted by llama.cpp's convert_hf_to_gguf.py (the llama-cpp-python sdist's
tree that bench_peers.py fetches, builds and caches) to F16 and Q8_0; the other types (Q4_0,
Q4_K_M, Q6_K, ...) are made from the F16 file by that build's `llama-quantize`, as a user makes
them. llama.cpp's logits come from llama-cpp-python where it is installed (`pip install
llama-cpp-python==0.3.36`), else from benchmarks/llama_logits.cpp built against the same build's
libraries; ours from `rwkv_engine.load(gguf, dtype="fp32")` (K-quant matrices run from their
blocks, Q8_0 as q8, as a user loads the file), for every position of one prompt. The table shows
the relative RMS difference of the logits (ours vs llama.cpp's on the same file, and each against
the fp32 .pth), how often the top token agrees, and the agreement scaled to the type: ours vs
llama.cpp divided by llama.cpp vs the .pth (the type's own error).

The target: every quantized type's scaled agreement at most F16's. The two engines read the same
weights and differ in their arithmetic: llama.cpp multiplies quantized matrices with activations
rounded to 8 bits per 256 columns (per 32 for Q8_0), we round them per 32 columns (int4 and
K-quants; K-quant prefill on the AVX2 level per 256, as llama.cpp; int16 per 64 for q8) or keep
fp32 (dense, and K-quant prefill through dequantized tiles where the CPU has bf16 matrix
instructions), so a type's difference from llama.cpp is a fraction of its own error. Measured with the 0.1B shape (12 x 768): docs/checkpoints.md.
Without llama.cpp's build tools (cmake, a compiler) the script says so and stops.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from bench_peers import LLAMA_CPP_PYTHON, VOCAB, build_llama, check_run, llama_tree, missing_tools

ROOT = Path(__file__).resolve().parents[1]


def logits_tool(tree: Path) -> Path:
    """benchmarks/llama_logits.cpp built once against the static libraries of bench_peers.py's
    llama.cpp build (rebuilt when the source changes)."""
    src = ROOT / "benchmarks" / "llama_logits.cpp"
    build = tree / "build"
    exe = tree / "rwkv-engine-llama-logits"  # beside the build, which bench_peers.py owns
    if exe.exists() and exe.stat().st_mtime >= src.stat().st_mtime:
        return exe
    libs = [build / "src" / "libllama.a"] + [build / "ggml" / "src" / f"libggml{x}.a" for x in ("", "-cpu", "-base")]
    cxx = os.environ.get("CXX") or "c++"
    inc = ["-I", tree / "include", "-I", tree / "ggml" / "include"]
    check_run([cxx, "-O2", "-std=c++17", *inc, src, *libs, "-fopenmp", "-lpthread", "-ldl", "-o", exe], "llama_logits")
    return exe


def llama_logits(path: Path, ids: list[int], threads: int, tool: Path | None):
    """llama.cpp's logits [len(ids), vocab] for every position (llama-cpp-python, else `tool`)."""
    import numpy as np

    if tool is None:
        from llama_cpp import Llama

        llm = Llama(str(path), n_ctx=len(ids) + 8, logits_all=True, verbose=False, n_threads=threads, n_batch=len(ids))
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.f32"
        check_run([tool, path, str(threads), out, *map(str, ids)], "llama_logits")
        return torch.from_numpy(np.fromfile(out, dtype=np.float32).reshape(len(ids), -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="7", choices=["6.0", "7"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_K_M,Q6_K", help="GGUF types (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 2), help="llama.cpp build jobs")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rwkv-engine-bench",
    )
    args = ap.parse_args()
    if missing := missing_tools():
        print(
            f"bench_gguf_logits: skipped: building llama.cpp (the peer) needs {' and '.join(missing)}", file=sys.stderr
        )
        return
    import rwkv_engine
    from rwkv_engine import testing

    tree = llama_tree(args.cache)
    bins = build_llama(tree, args.jobs)
    try:
        import llama_cpp  # noqa: F401

        tool = None
    except ImportError:
        tool = logits_tool(tree)
    types = [t for t in args.types.split(",") if t]
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
        for t in ("F16", "Q8_0"):
            files[t] = d / f"m-{t}.gguf"
            check_run(
                [sys.executable, tree / "convert_hf_to_gguf.py", hf, "--outtype", t.lower(), "--outfile", files[t]],
                "convert_hf_to_gguf.py",
                env=env,
            )
        for t in types:
            if t not in files:
                files[t] = d / f"m-{t}.gguf"
                check_run(
                    [bins / "llama-quantize", files["F16"], files[t], t, str(args.threads)], f"llama-quantize {t}"
                )
        src = rwkv_engine.load(pth, dtype="fp32", progress=False).forward(ids, all_logits=True)[0]

        def rel(a, b):
            return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

        def agree(a, b):
            return float((a.argmax(-1) == b.argmax(-1)).float().mean())

        print(
            f"RWKV-{args.version} {args.layers} x {args.width}, vocab 65536, {args.tokens} tokens; llama.cpp of "
            f"llama-cpp-python {LLAMA_CPP_PYTHON} ({'llama-cpp-python' if tool is None else 'llama_logits.cpp'}); "
            f"{args.threads} threads"
        )
        print("| GGUF | ours vs llama.cpp | top-1 agree | ours vs .pth | llama.cpp vs .pth | scaled agreement |")
        print("|---|---|---|---|---|---|")
        for t in types:
            path = files[t]
            theirs = llama_logits(path, ids, args.threads, tool)
            ours = rwkv_engine.load(path, dtype="fp32", progress=False).forward(ids, all_logits=True)[0]
            print(
                f"| {t} | {rel(ours, theirs):.2e} | {agree(ours, theirs):.3f} | {rel(ours, src):.2e} | "
                f"{rel(theirs, src):.2e} | {rel(ours, theirs) / rel(theirs, src):.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
