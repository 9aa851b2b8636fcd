"""How the native kernels are built and cached (the API is in `rwkv_engine.kernels.native`).

The kernels are written once (kernels.cpp: GEMVs, dequantization, the int4 quantizer; step.cpp:
the fused decode step of models/native_step.py) on the SIMD layer of simd.h, and compiled per
ISA level into a plain shared library (no torch headers: seconds to build); bindings.cpp (the
torch extension) loads the level's library and calls through its table of entry points (api.h).
Both are cached under torch's extension directory (`~/.cache/torch_extensions`, or
`$TORCH_EXTENSIONS_DIR`), keyed by the sources, flags, compiler, torch version and (the bindings) interpreter, and built
from copies of the sources in that directory, so checkouts of the same sources share one build.
Later processes only load them (well under a second). The build needs a C++20 compiler (gcc >=
10; `$CXX`, else `c++`) and, for the bindings, `ninja` on PATH (`pip install ninja`).

ISA levels (`LEVELS`; each CPU runs the best one it supports):

    avx2     x86-64 with AVX2, FMA and F16C (Haswell, Zen 1 and later): the x86 baseline
    avx512   x86-64 with AVX-512 F/BW/VL/DQ (Skylake-SP, Ice Lake, Zen 4 and later)
    avx512_vnni  avx512 + VNNI (vpdpwssd / vpdpbusd: the int8 kernel's int16 and the int4
             kernel's int8 dot products in one instruction; Cascade Lake, Ice Lake, Zen 4 and later)
    avx512_bf16  avx512_vnni + AVX512-BF16 (vdpbf16ps: bf16 weights times activations that are
             bf16 already, two products per fp32 lane; Cooper Lake, Sapphire Rapids, Zen 4 and later)
    neon     ARM64 (Advanced SIMD is part of ARMv8-A: Apple Silicon, Graviton, phones)
    neon_dotprod  neon + the ARMv8.2 dot product instructions (sdot: the int4 kernel's int8 dot
             products; Apple M1, Graviton 2, Cortex-A55/A76 and later)

Within a level, choices per CPU family are made at load from cpuid's vendor and family
(`tuning`, `TUNINGS`): the AVX-512 levels build their int8 / int4 / K-quant GEMVs on 512-bit vectors where
the core runs 512-bit instructions at full width and it pays (Intel: "int512") and on 256-bit
ones elsewhere ("int256": Zen 4 splits them, and on Zen 5 the 512-bit int8 GEMV lost at batch 1;
docs/performance.md, kernel design choices). The same sources, compiled with the tuning's defines; `native.using("avx512_bf16/int256")` and
bench_kernels.py `--baseline isa:avx512_bf16/int256` run another one, and `+OPTION`s (OPTIONS:
the AMX path off, or emulated) are for tests and A/B runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: torch's lock file only
    fcntl = None

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_BINDING_SOURCES = ("bindings.cpp",)  # the torch extension, built with the baseline level's flags
_KERNEL_SOURCES = ("kernels.cpp", "step.cpp", "api.cpp", "quantize.cpp", "amx.cpp")  # one shared library per level
_HEADERS = ("amx.h", "api.h", "kernels.h", "numeric.h", "pool.h", "quantize.h", "simd.h", "step.h")
_BINDING_HEADERS = ("api.h", "kernels.h", "quantize.h", "step.h")  # what bindings.cpp includes
# -ffp-contract=off: no silent a*b+c -> fma, so quantize_q4 repeats the reference's roundings
# and every level rounds where the source says.
_CFLAGS = ("-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off", "-DNDEBUG")
_LDFLAGS = ("-fopenmp",)
ENV = "RWKV_ENGINE_ISA"


@dataclass(frozen=True)
class Level:
    """An ISA level: the compiler flags of its build and the CPU features it needs."""

    name: str
    arch: str  # platform.machine(), normalized: x86_64 / aarch64
    flags: tuple[str, ...]
    features: frozenset[str]  # /proc/cpuinfo flags (x86) / Features (ARM)


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
LEVELS = (  # per architecture, lowest first
    Level("avx2", "x86_64", _AVX2, frozenset({"avx2", "fma", "f16c"})),
    Level(
        "avx512",
        "x86_64",
        _AVX2 + _AVX512,
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    ),
    Level(
        "avx512_vnni",
        "x86_64",
        _AVX2 + _AVX512 + ("-mavx512vnni",),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
    ),
    Level(
        "avx512_bf16",
        "x86_64",
        _AVX2 + _AVX512 + ("-mavx512vnni", "-mavx512bf16"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}),
    ),
    Level("neon", "aarch64", ("-march=armv8-a",), frozenset()),
    Level("neon_dotprod", "aarch64", ("-march=armv8.2-a+dotprod",), frozenset({"asimddp"})),
)


def level(name: str) -> Level:
    for lv in LEVELS:
        if lv.name == name:
            return lv
    raise ValueError(f"unknown ISA level {name!r}; known: {', '.join(lv.name for lv in LEVELS)}")


def _arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _cpu_features() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def supported_levels() -> list[tuple[Level, str]]:
    """Every level of this machine's architecture with '' where the CPU runs it, else the reason."""
    arch, feats = _arch(), _cpu_features()
    out = []
    for lv in LEVELS:
        if lv.arch != arch:
            continue
        if feats is None:  # no feature list: trust torch for AVX2 and assume nothing above the baseline
            ok = lv.name == "neon" or (lv.name == "avx2" and torch.cpu._is_avx2_supported())
            out.append((lv, "" if ok else "the CPU's features are unknown"))
            continue
        missing = sorted(lv.features - feats)
        out.append((lv, f"the CPU lacks {', '.join(missing)}" if missing else ""))
    return out


def choose_level(requested: str | None = None) -> tuple[Level | None, str]:
    """(level, reason): the best level this CPU runs, or the requested one (RWKV_ENGINE_ISA) when
    the CPU runs it; (None, why) where there is none."""
    levels = supported_levels()
    runnable = [lv for lv, why in levels if not why]
    if not levels:
        return None, f"no native kernels for CPU architecture {_arch()!r}"
    if not runnable:
        return None, f"this CPU runs none of the ISA levels ({levels[0][1]} for {levels[0][0].name})"
    if requested in (None, ""):
        return runnable[-1], ""
    if requested == "none":
        return None, f"{ENV}=none"
    names = [lv.name for lv, _ in levels]
    if requested not in names:
        return None, f"{ENV}={requested!r} is not an ISA level of this machine (one of: none, {', '.join(names)})"
    why = dict((lv.name, why) for lv, why in levels)[requested]
    if why:
        return None, f"{ENV}={requested}: {why}"
    return level(requested), ""


def cpu_family() -> tuple[str, int] | None:
    """(vendor, family) of the CPU, cpuid's vendor string and family as /proc/cpuinfo gives them
    ("GenuineIntel", 6), ("AuthenticAMD", 26); None where unknown."""
    vendor, family = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id":
                    vendor = value.strip()
                elif key == "cpu family":
                    family = int(value)
                if vendor is not None and family is not None:
                    return vendor, family
    except (OSError, ValueError):
        pass
    return None


# Per-CPU-family choices within a level, made at load from cpuid (the same sources, compiled with
# these defines; the library's name says which): the int8 / int4 / K-quant GEMVs on 512-bit
# vectors (simd.h v512) or 256-bit ones. Intel's AVX-512 cores run 512-bit instructions at full
# width: all three at 512 bits there. AMD Zen 5 (family 26) does too, but there the 512-bit int8 GEMV won at batch
# 4-8 and lost at batch 1, and the int4 one lost (docs/performance.md, kernel design choices); batch 1
# decides: 256-bit, as on Zen 4 and older, which split 512-bit instructions (simd.h).
TUNINGS = {
    "int256": (),
    "int8_512": ("-DRWKV_INT8_512",),
    "int512": ("-DRWKV_INT8_512", "-DRWKV_INT4_512", "-DRWKV_KQ_512"),
}
# Build options added to a tuning ('LEVEL/TUNING+OPTION'). The AMX tiles of amx.cpp are opt-in
# ('+amx', e.g. native.using("avx512_bf16/+amx")) until they have run on AMX hardware: only
# their scalar emulation ('+amx_emulate', on any x86 CPU) has been tested. Without either option
# a build has no AMX path ('+no_amx' says so explicitly).
OPTIONS = {"amx": (), "no_amx": (), "amx_emulate": ("-DRWKV_AMX_EMULATE",)}


def tuning(lv: Level | str, cpu: tuple[str, int] | None = None) -> str:
    """The name (a key of TUNINGS) of level lv's build for this CPU, or for `cpu` (cpu_family())."""
    lv = level(lv) if isinstance(lv, str) else lv
    if not lv.name.startswith("avx512"):
        return "int256" if lv.arch == "x86_64" else ""
    vendor, _family = cpu or cpu_family() or ("", 0)  # (Zen 5, family 26: see above)
    return "int512" if vendor == "GenuineIntel" else "int256"


def tuning_flags(tune: str) -> tuple[str, ...]:
    """The compiler flags of a tuning: a key of TUNINGS (or ''), then '+OPTION's."""
    base, *opts = tune.split("+")
    if base and base not in TUNINGS or any(o not in OPTIONS for o in opts):
        raise ValueError(f"unknown tuning {tune!r}; known: {', '.join(TUNINGS)}, each with +{', +'.join(OPTIONS)}")
    flags = TUNINGS.get(base, ()) + tuple(f for o in opts for f in OPTIONS[o])
    return flags if {"amx", "amx_emulate"} & set(opts) else (*flags, "-DRWKV_NO_AMX")


def parse_spec(spec: str) -> tuple[Level, str]:
    """'LEVEL' or 'LEVEL/TUNING' (e.g. avx512_bf16/int256, avx512_bf16/int512+no_amx; '/+no_amx':
    this CPU's tuning with the option), for A/B runs and tests -> (level, tuning)."""
    name, _, tune = spec.partition("/")
    lv = level(name)
    if tune.startswith("+"):
        tune = tuning(lv) + tune
    tuning_flags(tune)
    return lv, tune or tuning(lv)


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _digest(parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
    return h.hexdigest()[:12]


def _cache_dir() -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory("rwkv_engine_native", False)).parent


def _copy_sources(names, dest: Path, src: Path = _HERE) -> None:
    """The sources and headers into dest, so a build never names a checkout's own paths (two
    checkouts of the same sources then share one build instead of rebuilding each other's)."""
    dest.mkdir(parents=True, exist_ok=True)
    for n in names:
        data = (src / n).read_bytes()
        if not (dest / n).exists() or (dest / n).read_bytes() != data:
            tmp = dest / f".{n}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, dest / n)


def _compiler_version(cxx: str) -> bytes:
    return subprocess.run([cxx, "--version"], capture_output=True, check=True).stdout


def library_path(
    lv: Level | str,
    cxx: str | None = None,
    out_dir: Path | None = None,
    src: Path = _HERE,
    selftest: bool = False,
    tune: str | None = None,
    check_only: bool = False,
) -> Path:
    """Where build_kernels keeps the build of these arguments (its name holds the digest of the
    sources, flags and compiler)."""
    return _build_plan(lv, cxx, out_dir, src, selftest, tune, check_only)[0]


def _build_plan(lv, cxx, out_dir, src, selftest, tune, check_only=False):
    lv, tune = parse_spec(lv) if isinstance(lv, str) else (lv, tune)
    tune = tuning(lv) if tune is None else tune
    cxx = cxx or compiler()
    if selftest:
        sources = ("selftest.cpp",) + tuple(s for s in _KERNEL_SOURCES if s != "api.cpp")
        flags = _CFLAGS + lv.flags + tuning_flags(tune)
    else:
        sources = _KERNEL_SOURCES
        flags = _CFLAGS + lv.flags + tuning_flags(tune) + ("-fPIC", "-shared", "-fvisibility=hidden")
    if check_only:  # every template and intrinsic compiled, none optimised: a third of the time
        flags = tuple("-O0" if f == "-O3" else f for f in flags)
    key = _digest([(src / s).read_bytes() for s in sources + _HEADERS] + [flags, _LDFLAGS, _compiler_version(cxx)])
    out_dir = out_dir or _cache_dir() / "rwkv_engine_kernels"
    name = lv.name + (f"_{tune.replace('+', '_')}" if tune else "")
    lib = out_dir / f"{name}_{key}{'_selftest' if selftest else '.so'}"
    return lib, lv, cxx, sources, flags, key, out_dir


def build_kernels(
    lv: Level | str,
    cxx: str | None = None,
    out_dir: Path | None = None,
    src: Path = _HERE,
    selftest: bool = False,
    tune: str | None = None,
    check_only: bool = False,
) -> Path:
    """The kernel library of level `lv` (built with `cxx` unless cached): the path of its .so;
    with `selftest`, the standalone test program of selftest.cpp instead. `tune`: a tuning
    (tuning_flags; None: this CPU's, `tuning`); `lv` may also name one, as 'LEVEL/TUNING'.

    Any level of any architecture can be built where a compiler for it is given (the tests build
    the ARM64 level with aarch64-linux-gnu-g++); a failed build raises RuntimeError with the
    compiler's message. `src`: another copy of this directory (benchmarks/bench_kernels.py
    --baseline builds a git revision's kernels). `check_only`: built without optimisation, to
    show that a level compiles where it cannot run (GCC still inlines every always_inline
    intrinsic at -O0, so a target mismatch fails as at -O3); never loaded."""
    lib, lv, cxx, sources, flags, key, out_dir = _build_plan(lv, cxx, out_dir, src, selftest, tune, check_only)
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    src_dir = out_dir / f"src_{key}"
    _copy_sources(sources + _HEADERS, src_dir, src)
    fd, tmp = tempfile.mkstemp(prefix=f".{lv.name}_", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *flags, *[str(src_dir / s) for s in sources], "-o", tmp, *_LDFLAGS]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        Path(tmp).unlink(missing_ok=True)  # the compiler may have removed it already
        raise RuntimeError(f"building the {lv.name} kernels failed:\n{' '.join(cmd)}\n{r.stderr.strip()[-3000:]}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, lib)  # atomic: a concurrent process sees the whole library or none
    return lib


LOCK_NAME = "rwkv_engine.lock"


@contextlib.contextmanager
def build_lock(build_dir: Path, what: str):
    """Held while building in build_dir: an exclusive flock on build_dir/LOCK_NAME, which the OS
    releases when its holder dies (torch's own lock file outlives a killed build, and torch waits
    on it forever). A waiter says on stderr whom it waits for; once it holds the lock, any torch
    lock file left in build_dir is a killed build's (every builder takes this lock first)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / LOCK_NAME
    with open(path, "a+") as f:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "?"
                print(
                    f"rwkv-engine: waiting for process {holder}, which is building {what} (lock {path})",
                    file=sys.stderr,
                    flush=True,
                )
                fcntl.flock(f, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)  # closing the file releases the flock


def _bindings_dir(base: Level) -> tuple[str, Path]:
    """(extension name, build directory) of the bindings: keyed by everything that goes into
    their build, interpreter and include paths too (two virtualenvs on one cache would otherwise
    rebuild each other's extension, ninja seeing other include paths each time)."""
    from torch.utils import cpp_extension

    srcs = _BINDING_SOURCES + _BINDING_HEADERS
    key = [(_HERE / s).read_bytes() for s in srcs]
    key += [_CFLAGS + base.flags, torch.__version__, sys.executable, sysconfig.get_paths()["include"]]
    key += [tuple(cpp_extension.include_paths())]
    name = "rwkv_engine_native_" + _digest(key)
    return name, Path(cpp_extension._get_build_directory(name, False))


def _load_bindings(base: Level, name: str, build_dir: Path, verbose: bool):
    from torch.utils import cpp_extension

    _copy_sources(_BINDING_SOURCES + _BINDING_HEADERS, build_dir / "src")
    return cpp_extension.load(
        name=name,
        sources=[str(build_dir / "src" / s) for s in _BINDING_SOURCES],
        extra_cflags=list(_CFLAGS + base.flags),
        extra_ldflags=list(_LDFLAGS) + ["-ldl"],
        build_directory=str(build_dir),
        verbose=verbose,
    )


def load_module(lv: Level, verbose: bool = False):
    """The bindings (built unless cached) using the kernels of level `lv`; raises where a build fails."""
    base = next(x for x in LEVELS if x.arch == lv.arch)
    name, build_dir = _bindings_dir(base)
    with build_lock(build_dir, "the native kernels"):
        building = not (build_dir / f"{name}.so").exists() or not library_path(lv).exists()
        if building:  # minutes of silence otherwise, on a first run
            print(
                f"rwkv-engine: building the native kernels for this CPU ({lv.name}), once: 1-3 minutes",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.perf_counter()
        ops = _load_bindings(base, name, build_dir, verbose)
        ops.use_kernels(str(build_kernels(lv)))
        if building:
            print(f"rwkv-engine: native kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return ops
