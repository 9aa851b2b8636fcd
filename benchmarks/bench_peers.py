"""Prefill and decode speed and peak memory of rwkv-engine beside llama.cpp, on the same random
RWKV-7 weights, in one run.

    python benchmarks/bench_peers.py                       # RWKV-7 1.5B shape (24 x 2048, vocab 65536)
    python benchmarks/bench_peers.py --small               # 0.1B shape (12 x 768), prompt 128, decode 16
    python benchmarks/bench_peers.py --formats 8,4 --rounds 3 --threads 2
    python benchmarks/bench_peers.py --formats q4_k_m,q6_k       # llama.cpp's own K-quant files, both sides

Each format compares our scheme with llama.cpp's of the same width: 16-bit is our bf16 (the .pth,
--dtype bf16) against GGUF F16, 8-bit our q8 (a converted directory) against Q8_0, 4-bit our q4
against Q4_0 (plain `llama-quantize`, as a llama.cpp user would make it). The K-quant formats run
one file on both sides: `llama-quantize`'s Q4_K_M or Q6_K GGUF, which rwkv-engine loads as it is
(its K-quant matrices run from their blocks; --dtype auto).

llama.cpp is a peer for this script only, never a dependency of the engine. The first run fetches
the sdist of llama-cpp-python (pip download; it carries llama.cpp under vendor/llama.cpp),
builds `llama-bench` and `llama-quantize` with cmake (Release, GGML_NATIVE, CPU only, static) into
--cache (default ~/.cache/rwkv-engine-bench) and reuses them afterwards; without cmake or a C/C++
compiler the script says so and skips. The random checkpoint and our converted copies are
bench_engine.py's (same --workdir, same files); the GGUF files are made from that checkpoint once:
written in the flash-linear-attention layout with the World vocabulary, converted by the tree's
own convert_hf_to_gguf.py (with its own gguf-py: the PyPI `gguf` lags behind it), quantized with
llama-quantize.

Every run is its own process: ours is `rwkv-engine bench --json` (peak RSS is its VmHWM), llama.cpp's
is `llama-bench -o json` (peak RSS from polling its /proc/PID/status VmHWM). The runs take turns for
--rounds rounds, every other round in reverse order, and the table shows medians (peak RSS: the
largest) and the ratios rwkv-engine / llama.cpp. Prefill is the best of --repeats passes of the whole
prompt in one call on both sides; decode is the median step (ours) and the median of --repeats passes
of --decode tokens (llama-bench).

Memory speed on a virtual machine can depend on the process: on this project's 2-core Zen 4 VM,
fresh memory read at 33-68 GB/s from one process to the next (and alike within a process), while
a file in the page cache keeps the memory it was read into. llama.cpp maps the GGUF by default, so
its decode is steady from run to run and ours is not; `--llama-load-mode none` makes llama-bench
read the model into fresh memory too, and the lines after the table show each of our runs' probe.

`--isa avx2` runs both sides as on an AVX2-only CPU: ours with RWKV_ENGINE_ISA=avx2 (the native
kernels' AVX2 build, fp32 GEMMs for 16-bit weights as on a CPU without AVX512-BF16) and torch's,
oneDNN's and MKL's kernels limited to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS), llama.cpp from a second build (tree/build-avx2: GGML_NATIVE off, so
AVX, AVX2, FMA, F16C, BMI2 and nothing of AVX-512 or AMX). On an AVX-512 machine that is the check of
the AVX2 code paths at their own speed, without an AVX2 machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# The checkpoint and converted copies are bench_engine.py's (this script's directory is on sys.path).
from bench_engine import SHAPES, converted_dir, make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"  # the PyPI sdist whose vendor/llama.cpp is the peer
VOCAB = "rwkv_vocab_v20230424.txt"  # convert_hf_to_gguf.py reads the World vocabulary from the model dir
# width: (our scheme, llama.cpp type); "gguf": ours runs llama.cpp's file itself
FORMATS = {
    "16": ("bf16", "F16"),
    "8": ("q8", "Q8_0"),
    "4": ("q4", "Q4_0"),
    "q4_k_m": ("gguf", "Q4_K_M"),
    "q6_k": ("gguf", "Q6_K"),
}
# ISA extensions worth naming beside a CPU benchmark (x86 /proc/cpuinfo "flags", ARM64 "Features")
ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimdhp",
    "asimddp",
    "i8mm",
    "bf16",
    "sve",
    "sve2",
)


# --- pure helpers ------------------------------------------------------------------------------


def cpu_summary(cpuinfo: str) -> tuple[str, list[str]]:
    """(CPU model name, the ISA_FLAGS it has) from the text of /proc/cpuinfo. On x86 the name
    carries the family and model numbers: virtual machines often show a bare "AMD EPYC"."""
    fields, flags = {}, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:
            flags = set(value.split())
        else:
            fields.setdefault(key, value.strip())
    model = fields.get("model name") or fields.get("hardware") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return model, [f for f in ISA_FLAGS if f in flags]


def parse_llama_bench(text: str) -> dict:
    """The numbers of `llama-bench -o json` for one model with one -p and one -n: prefill tok/s
    (best repetition), decode tok/s (median repetition), the build commit and the CPU it names."""
    tests = json.loads(text)
    pp = [t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0]
    tg = [t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0]
    if len(pp) != 1 or len(tg) != 1:
        raise ValueError(f"expected one prefill and one decode test in llama-bench's output, got {len(tests)} tests")
    return {
        "prefill_tok_s": max(pp[0]["samples_ts"]),
        "decode_tok_s": statistics.median(tg[0]["samples_ts"]),
        "build_commit": pp[0].get("build_commit", "?"),
        "cpu_info": pp[0].get("cpu_info", ""),
    }


def our_label(width: str) -> str:
    """Our side of a format: our scheme, or for llama.cpp's own file "the same file"."""
    ours, theirs = FORMATS[width]
    return f"{theirs} (same file)" if ours == "gguf" else ours


def summarize(runs: list[dict]) -> dict:
    """Medians of the speeds over rounds, the largest peak RSS."""
    return {
        "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
    }


def probe_lines(runs: dict[str, list[dict]]) -> list[str]:
    """Our runs' streaming-read probes (`memory_read_gb_s`, each measured in its own process on
    memory allocated as the weights are), one line per scheme, so that the reader can see which
    runs drew fast memory."""
    out = []
    for label, rs in runs.items():
        rs = [r for r in rs if "memory_read_gb_s" in r]
        if label.startswith("rwkv-engine") and rs:
            probes = ", ".join(f"{r['memory_read_gb_s']:.1f}" for r in rs)
            decode = ", ".join(f"{r['decode_tok_s']:.2f}" for r in rs)
            out.append(f"{label}: probe GB/s {probes}; decode tok/s {decode}")
    return out


def table(rows: list[tuple[str, str, str, dict | None, dict | None]]) -> str:
    """A markdown table of (format, our scheme, llama.cpp type, our summary, theirs), with the
    ratios ours / theirs; a side that did not run shows "-"."""

    def cell(r, key, fmt):
        return format(r[key], fmt) if r else "-"

    def ratio(a, b, key):
        return f"{a[key] / b[key]:.2f}" if a and b else "-"

    lines = [
        "| format | rwkv-engine / llama.cpp | prefill tok/s | x | decode tok/s | x | peak RSS MB | x |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for width, ours_name, their_name, ours, theirs in rows:
        label = f"{width}-bit" if width.isdigit() else width
        lines.append(
            f"| {label} | {ours_name} / {their_name} "
            f"| {cell(ours, 'prefill_tok_s', '.1f')} / {cell(theirs, 'prefill_tok_s', '.1f')} "
            f"| {ratio(ours, theirs, 'prefill_tok_s')} "
            f"| {cell(ours, 'decode_tok_s', '.2f')} / {cell(theirs, 'decode_tok_s', '.2f')} "
            f"| {ratio(ours, theirs, 'decode_tok_s')} "
            f"| {cell(ours, 'peak_rss_mb', '.0f')} / {cell(theirs, 'peak_rss_mb', '.0f')} "
            f"| {ratio(ours, theirs, 'peak_rss_mb')} |"
        )
    return "\n".join(lines)


# --- building the peer ---------------------------------------------------------------------------


def missing_tools() -> list[str]:
    """What building llama.cpp needs and this machine lacks."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        missing.append("a C compiler (cc, gcc or clang)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    return missing


def log_step(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_run(cmd: list, what: str, log: Path | None = None, **kwargs) -> None:
    """Run cmd; on failure print the tail of its output and stop the benchmark."""
    out = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
    if log:
        log.write_text(out.stdout)
    if out.returncode != 0:
        sys.exit(
            f"bench_peers: {what} failed (exit {out.returncode}):\n{out.stdout[-3000:]}"
            + (f"\n(full output in {log})" if log else "")
        )


def llama_tree(cache: Path) -> Path:
    """The llama.cpp source tree of the llama-cpp-python sdist, fetched and unpacked once."""
    tree = cache / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    if (tree / "convert_hf_to_gguf.py").exists():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        log_step(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (it carries llama.cpp) ...")
        check_run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                tmp,
            ],
            "pip download of llama-cpp-python",
        )
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix):
                    m.name = m.name[len(prefix) :]
                    members.append(m)
            tar.extractall(Path(tmp) / "llama.cpp", members=members, filter="data")
        os.replace(Path(tmp) / "llama.cpp", tree)
    return tree


# GCC 12's <amxtileintrin.h> tells the compiler that ldtilecfg reads 8 bytes of its 64-byte
# configuration and that tileloadd reads no memory, so stores to a tile configuration or to a
# packed tile can be dropped or moved past the instruction: llama.cpp's AMX matrix kernels (built
# with GGML_NATIVE on an AMX CPU) then crash or compute garbage (seen: llama-bench segfaults in
# ggml_backend_amx_mul_mat on a Xeon with AMX). GCC 13 fixed the header. This one, found first
# through -I, declares what the instructions really read and write.
AMX_TILE_HEADER = """\
/* written by rwkv-engine's benchmarks/bench_peers.py for GCC 12: see AMX_TILE_HEADER there */
#ifndef _IMMINTRIN_H_INCLUDED
#error "include <immintrin.h>, not <amxtileintrin.h>"
#endif
#ifndef _AMXTILEINTRIN_H_INCLUDED
#define _AMXTILEINTRIN_H_INCLUDED
#if !defined(__AMX_TILE__)
#pragma GCC push_options
#pragma GCC target("amx-tile")
#define __RWKV_BENCH_AMX_TILE_OFF__
#endif
#if defined(__x86_64__)
typedef struct { unsigned char __bytes[64]; } __rwkv_bench_tilecfg;
static __inline void __attribute__((__always_inline__)) _tile_loadconfig(const void *__config) {
  __asm__ volatile("ldtilecfg\\t%X0" ::"m"(*(const __rwkv_bench_tilecfg *)__config));
}
static __inline void __attribute__((__always_inline__)) _tile_storeconfig(void *__config) {
  __asm__ volatile("sttilecfg\\t%X0" : "=m"(*(__rwkv_bench_tilecfg *)__config));
}
static __inline void __attribute__((__always_inline__)) _tile_release(void) { __asm__ volatile("tilerelease" ::); }
#define _tile_loadd(dst, base, stride) _tile_loadd_x(dst, base, stride)
#define _tile_loadd_x(dst, base, stride) \\
  __asm__ volatile("{tileloadd\\t(%0,%1,1), %%tmm" #dst "|tileloadd\\t%%tmm" #dst ", [%0+%1*1]}" \\
                   ::"r"((const void *)(base)), "r"((long)(stride)) : "memory")
#define _tile_stream_loadd(dst, base, stride) _tile_stream_loadd_x(dst, base, stride)
#define _tile_stream_loadd_x(dst, base, stride) \\
  __asm__ volatile("{tileloaddt1\\t(%0,%1,1), %%tmm" #dst "|tileloaddt1\\t%%tmm" #dst ", [%0+%1*1]}" \\
                   ::"r"((const void *)(base)), "r"((long)(stride)) : "memory")
#define _tile_stored(src, base, stride) _tile_stored_x(src, base, stride)
#define _tile_stored_x(src, base, stride) \\
  __asm__ volatile("{tilestored\\t%%tmm" #src ", (%0,%1,1)|tilestored\\t[%0+%1*1], %%tmm" #src "}" \\
                   ::"r"((void *)(base)), "r"((long)(stride)) : "memory")
#define _tile_zero(dst) _tile_zero_x(dst)
#define _tile_zero_x(dst) __asm__ volatile("tilezero\\t%%tmm" #dst ::)
#endif
#ifdef __RWKV_BENCH_AMX_TILE_OFF__
#undef __RWKV_BENCH_AMX_TILE_OFF__
#pragma GCC pop_options
#endif
#endif
"""


def amx_header_fix(tree: Path, cpu_flags: list[str]) -> str:
    """Compiler flags that put AMX_TILE_HEADER first on the include path, where the compiler is
    GCC 12 and the CPU has AMX ('' elsewhere)."""
    if "amx_tile" not in cpu_flags:
        return ""
    cc = shutil.which(os.environ.get("CC", "cc"))
    try:
        out = subprocess.run([cc, "-dumpfullversion"], capture_output=True, text=True).stdout if cc else ""
        if "clang" in subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.lower():
            return ""
    except OSError:
        return ""
    if not out.startswith("12."):
        return ""
    fix = tree / "rwkv-engine-amx-fix"
    fix.mkdir(exist_ok=True)
    (fix / "amxtileintrin.h").write_text(AMX_TILE_HEADER)
    log_step(f"GCC {out.strip()} on an AMX CPU: building llama.cpp with a fixed <amxtileintrin.h> ({fix})")
    return f"-I{fix}"


def build_llama(
    tree: Path, jobs: int, targets: tuple[str, ...] = ("llama-bench", "llama-quantize"), isa: str = "native"
) -> Path:
    """`targets` (llama-bench, llama-quantize, llama-server for bench_server.py --peer) built in
    tree/build for this CPU (GGML_NATIVE), or with isa "avx2" in tree/build-avx2 for any AVX2 CPU
    (GGML_NATIVE off: ggml's x86 defaults, AVX2 and no AVX-512); the directory of the binaries. A
    build made on a CPU with other flags is thrown away and made anew; one configured without
    the server is configured again (cmake keeps what it built)."""
    build = tree / ("build" if isa == "native" else f"build-{isa}")
    stamp = build / "rwkv-engine-cpu-flags.txt"
    flags = " ".join(cpu_summary(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")[1])
    extra = amx_header_fix(tree, flags.split()) if isa == "native" else ""
    if extra:
        flags += " +amx-header-fix"
    if stamp.exists() and stamp.read_text() != flags:
        log_step("the llama.cpp build was made for another CPU: building it again ...")
        shutil.rmtree(build)
    cache = build / "CMakeCache.txt"
    if not cache.exists() or "LLAMA_BUILD_SERVER:BOOL=ON" not in cache.read_text():
        log_step(f"configuring llama.cpp in {build} ...")
        check_run(
            [
                "cmake",
                "-S",
                tree,
                "-B",
                build,
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DGGML_NATIVE={'ON' if isa == 'native' else 'OFF'}",
                "-DLLAMA_OPENSSL=OFF",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=ON",
                "-DLLAMA_BUILD_UI=OFF",
                "-DGGML_CUDA=OFF",
                "-DGGML_VULKAN=OFF",
                "-DGGML_METAL=OFF",
                *([f"-DCMAKE_C_FLAGS={extra}", f"-DCMAKE_CXX_FLAGS={extra}"] if extra else []),
            ],
            "cmake configure of llama.cpp",
            log=tree / "cmake-configure.log",
        )
    bins = build / "bin"
    if not all((bins / t).exists() for t in targets):
        log_step(f"building {', '.join(targets)} with {jobs} jobs (many minutes on 2 cores) ...")
    check_run(
        ["cmake", "--build", build, "--target", *targets, "-j", str(jobs)],
        "building llama.cpp",
        log=tree / "cmake-build.log",
    )
    stamp.write_text(flags)
    return bins


def gguf_files(work: Path, ckpt: Path, tree: Path, bins: Path, types: list[str], threads: int) -> dict[str, Path]:
    """ckpt as GGUF files of the given llama.cpp types (F16, Q8_0, Q4_0), each made once into work."""
    f16 = work / f"{ckpt.stem}-llama.cpp-F16.gguf"
    if not f16.exists():
        import torch

        from rwkv_engine import testing

        fla = work / f"{ckpt.stem}-fla"
        log_step(f"writing {ckpt.name} in the flash-linear-attention layout and converting it to GGUF F16 ...")
        testing.save_hf_dir(torch.load(ckpt, mmap=True, weights_only=True), fla, "7")
        shutil.copy(ROOT / "rwkv_engine" / "data" / VOCAB, fla / VOCAB)
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the tree's gguf-py, not PyPI's
        tmp = f16.with_suffix(".tmp")
        check_run(
            [sys.executable, tree / "convert_hf_to_gguf.py", fla, "--outtype", "f16", "--outfile", tmp],
            "convert_hf_to_gguf.py",
            env=env,
        )
        os.replace(tmp, f16)
        shutil.rmtree(fla)
    out = {}
    for t in types:
        path = f16 if t == "F16" else work / f"{ckpt.stem}-llama.cpp-{t}.gguf"
        if not path.exists():
            log_step(f"quantizing to {t} ...")
            tmp = path.with_suffix(".tmp")
            check_run([bins / "llama-quantize", f16, tmp, t, str(threads)], f"llama-quantize {t}")
            os.replace(tmp, path)
        out[t] = path
    return out


# --- running both sides -------------------------------------------------------------------------


# Our process as on an AVX2-only CPU: our kernels' AVX2 build (and the fp32 GEMMs `compute_dtype`
# picks without AVX512-BF16), torch's own kernels, oneDNN's and MKL's limited to AVX2 too (torch's
# fp32 CPU matmul is MKL's: without the last one it ran AVX-512 code, 1.2-1.4x faster at 512 rows).
AVX2_ENV = {
    "RWKV_ENGINE_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def run_ours(model: Path, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "rwkv_engine",
        "bench",
        str(model),
        "--json",
        "--prompt-len",
        str(args.prompt_len),
        "--decode-tokens",
        str(args.decode),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ]
    if model.suffix == ".pth":
        cmd += ["--dtype", "bf16"]
    # `python -m` puts the working directory first on sys.path: the tree of this script is measured.
    env = os.environ | (AVX2_ENV if args.isa == "avx2" else {})
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_peak_rss(cmd: list[str]) -> tuple[int, str, str, float]:
    """Run cmd, polling its VmHWM (its own peak resident memory; ru_maxrss of a child would carry
    this process's peak over the exec). Returns exit code, stdout, stderr and the peak in MB."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        peak_kb = 0
        while p.poll() is None:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peak_kb = max(peak_kb, int(line.split()[1]))
            except (OSError, ValueError):
                pass  # exiting: its memory map is gone
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read(), err.read(), peak_kb / 1024


def run_llama(bins: Path, model: Path, args) -> dict:
    cmd = [
        str(bins / "llama-bench"),
        "-m",
        str(model),
        "-p",
        str(args.prompt_len),
        "-n",
        str(args.decode),
        "-t",
        str(args.threads),
        "-r",
        str(args.repeats),
        "-o",
        "json",
        "-lm",
        args.llama_load_mode,
    ]
    code, out, err, peak = run_peak_rss(cmd)
    if code != 0:
        raise RuntimeError(err[-2000:])
    return parse_llama_bench(out) | {"peak_rss_mb": round(peak)}


def our_version() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5B", choices=sorted(SHAPES))
    ap.add_argument("--small", action="store_true", help="shortcut for --shape 0.1B --prompt-len 128 --decode 16")
    ap.add_argument(
        "--formats", default="16,8,4", help="formats to compare, of 16, 8, 4, q4_k_m, q6_k (default: %(default)s)"
    )
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64, help="decode tokens timed per pass (default: %(default)s)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="prefill/decode passes per run, both engines (default: %(default)s)"
    )
    ap.add_argument("--rounds", type=int, default=2, help="runs of every configuration, taking turns (medians)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both engines (default: all cores)")
    ap.add_argument(
        "--workdir", default="/tmp/rwkv-engine-bench", help="checkpoints and converted copies (bench_engine's)"
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rwkv-engine-bench",
        help="where llama.cpp is unpacked and built (default: %(default)s)",
    )
    ap.add_argument(
        "--llama-load-mode",
        default="auto",
        choices=["auto", "none", "mmap"],
        help="llama-bench -lm: auto (default, as a user runs it: the GGUF mapped from the page cache) "
        "or none (read into memory allocated per run, as ours are)",
    )
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 2), help="build jobs (default: %(default)s)")
    ap.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="native: each side's best for this CPU; avx2: both limited to AVX2 (see above)",
    )
    args = ap.parse_args()
    if args.small:
        args.shape, args.prompt_len, args.decode = "0.1B", 128, 16
    widths = [w for w in args.formats.split(",") if w]
    if bad := [w for w in widths if w not in FORMATS]:
        ap.error(f"--formats: unknown width(s) {', '.join(bad)}; use some of {', '.join(FORMATS)}")
    if missing := missing_tools():
        print(f"bench_peers: skipped: building llama.cpp (the peer) needs {' and '.join(missing)}", file=sys.stderr)
        return

    tree = llama_tree(args.cache)
    bins = build_llama(tree, args.jobs, isa=args.isa)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"rwkv7-{args.shape}-bf16.pth"
    make_checkpoint(ckpt, "7", args.shape)
    ggufs = gguf_files(work, ckpt, tree, bins, [FORMATS[w][1] for w in widths], args.threads)
    # (label, width, runner)
    configs = []
    for w in widths:
        ours, theirs = FORMATS[w]
        model = {"bf16": ckpt, "gguf": ggufs[theirs]}.get(ours) or converted_dir(work, ckpt, ours)
        configs.append((f"rwkv-engine {our_label(w)}", w, lambda m=model: run_ours(m, args)))
        configs.append((f"llama.cpp {theirs}", w, lambda m=ggufs[theirs]: run_llama(bins, m, args)))

    runs: dict[str, list[dict]] = {label: [] for label, *_ in configs}
    for rnd in range(args.rounds):
        # Every other round in reverse order; a pause before each run lets the kernel reclaim the
        # last one's memory (bench_engine.py does the same).
        for label, _, runner in configs if rnd % 2 == 0 else configs[::-1]:
            time.sleep(5)
            try:
                runs[label].append(runner())
            except RuntimeError as e:
                print(f"{label} failed:\n{e}", file=sys.stderr)
                continue
            print(label, json.dumps(runs[label][-1]), file=sys.stderr, flush=True)

    model_name, isa = cpu_summary(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
    llama_runs = [r for label, rs in runs.items() if label.startswith("llama.cpp") for r in rs]
    our_runs = [r for label, rs in runs.items() if label.startswith("rwkv-engine") for r in rs]
    commit = llama_runs[0]["build_commit"] if llama_runs else "?"  # "unknown": the sdist carries no git history
    L, C, V = SHAPES[args.shape]
    limit = "" if args.isa == "native" else f" (both sides limited to {args.isa}: --isa)"
    print(f"\nCPU: {model_name}; ISA: {' '.join(isa) or '?'}{limit}; {args.threads} threads")
    print(
        f"rwkv-engine {our_version()}"
        + (f" (native level {our_runs[0]['isa']})" if our_runs and "isa" in our_runs[0] else "")
        + f"; llama.cpp {commit + ' ' if commit not in ('unknown', '?') else ''}(llama-cpp-python {LLAMA_CPP_PYTHON} sdist)"
    )
    print(
        f"RWKV-7 {args.shape} shape ({L} x {C}, vocab {V}), random weights; prompt {args.prompt_len} tokens, "
        f"decode {args.decode}; median of {args.rounds} alternating round(s); x = rwkv-engine / llama.cpp\n"
    )
    got = {label: summarize(rs) for label, rs in runs.items() if rs}
    rows = []
    for w in widths:
        theirs = FORMATS[w][1]
        rows.append((w, our_label(w), theirs, got.get(f"rwkv-engine {our_label(w)}"), got.get(f"llama.cpp {theirs}")))
    print(table(rows))
    print(
        "\nBy round (the probe reads memory allocated as our weights are; on a VM the same machine can give a"
        " process memory that reads at half the speed of another's):"
    )
    print("\n".join(probe_lines(runs)))


if __name__ == "__main__":
    main()
