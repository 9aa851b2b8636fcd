"""The native kernels at every ISA level (kernels/native: LEVELS, RWKV_ENGINE_ISA).

- Every level is compiled on every machine (a level of another architecture with its cross
  compiler, e.g. aarch64-linux-gnu-g++), so a compile error in a level this CPU cannot run fails.
- Every level this CPU runs is run against the PyTorch references (a condensed set of
  test_native_kernels / test_native_step, which run the level in use in full), batched = alone
  bit for bit included.
- ARM64 on an x86 machine: the standalone driver selftest.cpp, cross-compiled, runs under
  qemu-aarch64 on cases whose expected results come from the PyTorch reference; the same cases
  run natively at the level in use.
The terminal summary lists which levels ran and which were skipped, and why (conftest.py).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from rwkv_engine.kernels import native
from rwkv_engine.kernels.native import build
from rwkv_engine.quant import primitives as P

from . import test_kernels_v7 as TW
from . import test_kquant as TQ
from . import test_lora as TL
from . import test_native_kernels as TK
from . import test_native_step as TS
from .test_lora import ckpts  # noqa: F401  (fixture)
from .test_native_step import checkpoints  # noqa: F401  (fixture)

# Every level with this CPU's tuning, and the AVX-512 levels also with the others (native.TUNINGS:
# 256- or 512-bit int8 / int4 GEMVs): avx512 (no VNNI: other int instructions) with both at 512
# bits, avx512_bf16 with each.
LEVELS = (
    [lv.name for lv in native.LEVELS]
    + ["avx512/int512"] * (native.tuning("avx512") != "int512")
    + [f"avx512_bf16/{t}" for t in native.TUNINGS if t != native.tuning("avx512_bf16")]
)
# Compilers for a level of another architecture than this machine's (Debian's cross compilers).
CROSS = {"aarch64": "aarch64-linux-gnu-g++", "x86_64": "x86_64-linux-gnu-g++"}
# level -> what happened to it in this run ("compiled", "ran", "skipped: why"), for the summary.
REPORT: dict[str, list[str]] = {}


def _note(name: str, what: str) -> None:
    REPORT.setdefault(name, []).append(what)


def _compiler_for(lv: native.Level) -> str:
    return build.compiler() if lv.arch == build._arch() else CROSS[lv.arch]


@pytest.mark.parametrize("name", LEVELS)
def test_every_level_compiles(name):
    lv = native.parse_spec(name)[0]
    cxx = _compiler_for(lv)
    if shutil.which(cxx) is None:
        _note(name, f"compile skipped: no {cxx}")
        pytest.skip(f"{name}: no {cxx} on PATH (Debian: g++-{lv.arch.replace('_', '-')}-linux-gnu)")
    # A level this CPU runs is built as it is loaded (the run tests load it); one it cannot run is
    # only compiled, unoptimised (a third of the time: the run tests never load it here).
    check_only = bool(_why_not_runnable(name))
    assert native.build_kernels(name, cxx=cxx, check_only=check_only).exists()
    _note(name, "compiled" + " (-O0 check)" * check_only)


def _why_not_runnable(name: str) -> str:
    name = name.partition("/")[0]
    for lv, why in native.supported_levels():
        if lv.name == name:
            return why
    return f"not this machine's architecture ({build._arch()})"


@pytest.fixture(params=LEVELS)
def level_in_use(request):
    """Each level this CPU runs, in use for the test (the level chosen at load again after)."""
    name = request.param
    if native.load() is None:
        pytest.skip("native kernels unavailable here (see log)")
    why = _why_not_runnable(name)
    if why:
        _note(name, f"run skipped: {why}")
        pytest.skip(f"{name}: {why}")
    with native.using(name) as ops:
        assert ops.isa() == name.partition("/")[0]
        yield name
    _note(name, f"ran {request.node.name.split('[')[0]}")


def test_level_gemvs_match_reference(level_in_use):
    for wdt in TK.DTYPES:
        TK.test_gemv_dense_matches_reference(37, 96, wdt)
        TK.test_gemv_dense_matches_reference(64, 2048, wdt)
    for N, K, gs in [(37, 96, None), (64, 2048, 32), (130, 64, 64), (5, 160, 32)]:
        TK.test_gemv_q8_matches_reference(N, K, gs, col=gs == 32)
    for N, K, gs in [(64, 2048, 32), (37, 96, 32), (130, 64, 64), (3, 448, 64), (64, 2048, 128)]:
        TK.test_gemv_q4_matches_reference(N, K, gs, col=gs == 64)
    TK.test_gemv_rows_of_a_batch_equal_each_row_alone(53, 2048 + 96)
    TK.test_gemv_rows_of_a_batch_equal_each_row_alone(11, 1040)
    TK.test_bf16_activations_take_the_bf16_dot_product_where_the_level_has_it()
    TK.test_activation_rounding_with_an_outlier_activation()
    TK.test_q4_rounds_x_as_the_reference_bit_for_bit()
    TK.test_dequant_tiles_equal_reference(torch.bfloat16)
    TK.test_quantize_q4_gives_the_reference_bytes(32, True, False)
    for qtype in TQ.KQUANT_TYPES:  # K-quants: the spec, ggml's values, batched = alone
        TQ.test_gemv_kq_matches_reference(qtype, 37, 768)
        TQ.test_native_dequant_is_gguf_bit_for_bit(qtype)
    TQ.test_gemv_kq_rows_of_a_batch_equal_each_row_alone()
    TQ.test_gemv_kq_nan_or_inf_in_x_gives_non_finite_rows(torch.float32)


def test_level_wkv7_matches_reference(level_in_use):
    for N in (8, 64):
        TW.test_native_wkv7_matches_naive(N, "mixed")
    TW.test_native_wkv7_rows_of_a_batch_equal_each_row_alone()


def test_level_decode_step_matches_pytorch(level_in_use, checkpoints, ckpts):  # noqa: F811
    for version, fmt in [
        ("7", ("bf16", "q4")),
        ("5.2", ("fp32", None)),
        ("6.0", ("fp16", None)),
        ("4", ("fp32", "q8")),
    ]:
        TS.test_native_step_matches_pytorch_modules(checkpoints, version, fmt)
    TS.test_rows_are_independent_in_the_native_step(checkpoints)
    TL.test_native_step_with_16_bit_lora(ckpts, "7", "bf16", None)  # 16-bit LoRA products
    TL.test_native_step_with_16_bit_lora(ckpts, "6.0", "fp16", None)
    TL.test_native_rows_are_independent_with_16_bit_lora(ckpts, "7", None)


def _isa_in_subprocess(value: str | None) -> tuple[str, str]:
    """(stdout, stderr) of a fresh process that loads the kernels with RWKV_ENGINE_ISA=value."""
    env = {k: v for k, v in os.environ.items() if k != native.ENV}
    if value is not None:
        env[native.ENV] = value
    code = "from rwkv_engine.kernels import native; print(native.isa())"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), r.stderr


def test_env_forces_a_level_or_turns_the_kernels_off():
    if native.load() is None:
        pytest.skip("native kernels unavailable here (see log)")
    best = [lv.name for lv, why in native.supported_levels() if not why][-1]
    assert _isa_in_subprocess(None)[0] == best == native.isa()
    lowest = native.supported_levels()[0][0].name
    assert _isa_in_subprocess(lowest)[0] == lowest
    out, err = _isa_in_subprocess("none")
    assert out == "None" and err.count("RWKV_ENGINE_ISA=none") == 1
    out, err = _isa_in_subprocess("avx1024")
    assert out == "None" and "'avx1024' is not an ISA level" in err and err.count("\n") == 1


def test_tuning_follows_the_cpu_family():
    intel, zen4, zen5 = ("GenuineIntel", 6), ("AuthenticAMD", 25), ("AuthenticAMD", 26)
    assert [native.tuning("avx512_bf16", c) for c in (intel, zen4, zen5)] == ["int512", "int256", "int256"]
    assert native.tuning("avx2", intel) == "int256" and native.tuning("neon", intel) == ""
    assert native.tuning_flags("int512") == (
        "-DRWKV_INT8_512",
        "-DRWKV_INT4_512",
        "-DRWKV_KQ_512",
        "-DRWKV_NO_AMX",
    )  # AMX: opt-in
    lib = native.library_path("avx512_bf16/int8_512")
    assert lib.name.startswith("avx512_bf16_int8_512_") and lib != native.library_path("avx512_bf16/int256")


def test_choose_level_follows_the_cpu_features(monkeypatch):
    monkeypatch.setattr(build, "_arch", lambda: "x86_64")
    monkeypatch.setattr(build, "_cpu_features", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw"})
    assert native.choose_level()[0].name == "avx2"  # no avx512vl / dq
    lv, why = native.choose_level("avx512")
    assert lv is None and "avx512dq, avx512vl" in why
    monkeypatch.setattr(build, "_cpu_features", lambda: {"sse2", "avx"})
    lv, why = native.choose_level()
    assert lv is None and "lacks avx2, f16c, fma" in why
    monkeypatch.setattr(build, "_arch", lambda: "aarch64")
    monkeypatch.setattr(build, "_cpu_features", lambda: {"fp", "asimd"})
    assert native.choose_level()[0].name == "neon"
    monkeypatch.setattr(build, "_cpu_features", lambda: {"fp", "asimd", "asimddp"})
    assert native.choose_level()[0].name == "neon_dotprod"
    monkeypatch.setattr(build, "_arch", lambda: "riscv64")
    assert native.choose_level()[0] is None


def test_builds_are_shared_between_checkouts(tmp_path):
    # Two copies of the same sources (two checkouts of one commit) give one cached build.
    lv = native.supported_levels()[0][0]
    if shutil.which(build.compiler()) is None:
        pytest.skip("no C++ compiler")
    copy = tmp_path / "native"
    shutil.copytree(build._HERE, copy)
    assert native.build_kernels(lv, src=copy) == native.build_kernels(lv)
    (copy / "kernels.cpp").write_text((copy / "kernels.cpp").read_text() + "\n// changed\n")
    assert native.library_path(lv, src=copy) != native.library_path(lv)


# --- kernel cases: ARM64 under qemu, the level in use natively ---------------------------------

_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _case(op: int, params, *tensors) -> bytes:
    p = list(params) + [0] * (6 - len(params))
    return struct.pack("<7q", op, *p) + b"".join(_raw(t) for t in tensors)


def _from_raw(b: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    if dtype in (torch.bfloat16, torch.float16):
        return torch.from_numpy(np.frombuffer(b, dtype=np.int16).copy()).view(dtype).reshape(shape)
    np_dt = {torch.float32: np.float32, torch.uint8: np.uint8}[dtype]
    return torch.from_numpy(np.frombuffer(b, dtype=np_dt).copy()).reshape(shape)


@pytest.mark.parametrize("name", [lv.name for lv in native.LEVELS if lv.arch == "aarch64"] + ["in-use"])
def test_kernel_cases_against_pytorch(tmp_path, name):
    """The kernel cases below, run by the standalone program selftest.cpp: the ARM64 levels under
    qemu-aarch64 (natively on ARM64), and the level in use natively (on x86 the other levels are
    run by the test_level_* tests above)."""
    if name == "in-use":
        name = native.isa()
        if name is None:
            pytest.skip("native kernels unavailable here (see log)")
    lv = native.level(name)
    native_run = lv.arch == build._arch()
    cxx = build.compiler() if native_run else CROSS["aarch64"]
    runner = [] if native_run else ["qemu-aarch64", "-cpu", "max", "-L", "/usr/aarch64-linux-gnu"]
    if native_run and _why_not_runnable(name):
        _note(name, f"run skipped: {_why_not_runnable(name)}")
        pytest.skip(f"{name}: {_why_not_runnable(name)}")
    for tool in [cxx] + runner[:1]:
        if shutil.which(tool) is None:
            _note(name, f"qemu run skipped: no {tool}")
            pytest.skip(f"no {tool} (Debian: g++-aarch64-linux-gnu, qemu-user)")
    exe = native.build_kernels(lv, cxx=cxx, selftest=True)
    g = torch.Generator().manual_seed(13)
    cases, checks = [], []  # checks: (nbytes of the result, fn(result bytes))

    def add(case: bytes, nbytes: int, check):
        cases.append(case)
        checks.append((nbytes, check))

    def gemv_checks(name, y_of_batch, ref, B, xdt, tol):
        """y [B, N] against ref; then, when B > 1, each row alone must give the same bits."""

        def check(b):
            y = _from_raw(b, xdt, ref.shape)
            assert TK.rel_rms(y, ref) < tol, (name, B, xdt, TK.rel_rms(y, ref))
            y_of_batch[B] = y

        return check

    for N, K in [(37, 96), (20, 448), (16, 2048)]:
        for wdt in TK.DTYPES:
            w = torch.randn(N, K, generator=g).to(wdt)
            for B, xdt in [(1, torch.float32), (5, torch.bfloat16), (8, torch.float32)]:
                x = torch.randn(B, K, generator=g).to(xdt)
                ref = x.double() @ w.double().T
                add(
                    _case(0, [N, K, B, _DT[wdt], _DT[xdt]], w, x),
                    B * N * x.element_size(),
                    gemv_checks(f"dense {wdt}", {}, ref, B, xdt, TK._round_out(None, xdt)),
                )
    # int8 / int4: the spec (x rounded to int16 per 64 columns / int8 per 32) and batched = alone,
    # bit for bit
    x_all = torch.randn(6, 2048 + 64, generator=g)
    for kind, N, K, gs in [
        ("q8", 24, 2048, None),
        ("q8", 24, 2048, 32),
        ("q8", 7, 96, 32),
        ("q4", 24, 2048, 32),
        ("q4", 9, 2048 + 64, 64),
        ("q4", 24, 2048, 128),
        ("q4", 5, 96, 32),
    ]:
        w = torch.randn(N, K, generator=g)
        if kind == "q8":
            q, s = P.quantize_int8(w, gs)
            wd, tensors, op, G = P.dequantize_int8(q, s).double(), (q, s), 1, s.shape[1]
        else:
            q, s, z = P.quantize_int4(w, gs)
            wd, tensors, op, G = P.dequantize_int4(q, s, z).double(), (q, s, z), 2, s.shape[1]
        x = x_all[:, :K].contiguous()
        ref = (P.round_activations_int16 if kind == "q8" else P.round_activations_int8)(x).double() @ wd.T
        rows = {}
        add(
            _case(op, [N, K, 6, G, 0], *tensors, x),
            6 * N * 4,
            gemv_checks(f"{kind} g{gs}", rows, ref, 6, torch.float32, 2e-5),
        )
        for i in range(6):

            def alone(b, i=i, N=N, rows=rows, name=f"{kind} g{gs}"):
                assert torch.equal(_from_raw(b, torch.float32, (1, N)), rows[6][i : i + 1]), (name, i)

            add(_case(op, [N, K, 1, G, 0], *tensors, x[i : i + 1]), N * 4, alone)
    # the native step's LoRA products (C -> D and D -> C, tiles cut unevenly; rows of 1 KB and more
    # go a group of rows at a time, and up to 4 rows of x share a weight load): fp32 math on the
    # stored fp32 / bf16 / fp16 values, and each row of a batch the bits it gives alone
    for K, N in [(320, 24), (40, 1100)]:
        for wdt in TK.DTYPES:
            w = torch.randn(K, N, generator=g).to(wdt)
            x = torch.randn(5, K, generator=g)
            ref = x.double() @ w.double()
            rows = {}
            add(
                _case(5, [K, N, 5, _DT[wdt]], w, x),
                5 * N * 4,
                gemv_checks(f"lora {wdt}", rows, ref, 5, torch.float32, 1e-6),
            )
            for i in range(5):

                def lora_alone(b, i=i, N=N, rows=rows, name=f"lora {wdt}"):
                    assert torch.equal(_from_raw(b, torch.float32, (1, N)), rows[5][i : i + 1]), (name, i)

                add(_case(5, [K, N, 1, _DT[wdt]], w, x[i : i + 1]), N * 4, lora_alone)
    # the RWKV-7 WKV over a sequence (SIMD heads of 16 and 64, the plain loop for 8): the recurrence,
    # and each row of a batch the bits it gives alone
    for N in (8, 16, 64):
        r_, k_, v_, log_w, a_, b_, state = TW._inputs(2, 21, 2, N, TW.DECAYS["mixed"], seed=N)
        ins = [r_, k_, v_, torch.exp(log_w), a_, b_]
        y_ref, s_ref = TW.wkv7_naive(*(t.double() for t in (r_, k_, v_, log_w, a_, b_, state)))
        n, ns = r_.numel(), state.numel()
        rows = {}

        def wkv_check(b, N=N, y_ref=y_ref, s_ref=s_ref, n=n, rows=rows):
            y = _from_raw(b[: 4 * n], torch.float32, y_ref.shape)
            s = _from_raw(b[4 * n :], torch.float32, s_ref.shape)
            assert TK.rel_rms(y, y_ref) < 1e-5 and TK.rel_rms(s, s_ref) < 1e-5, ("wkv7", N)
            rows["y"], rows["s"] = y, s

        add(_case(6, [2, 21, 2, N], *ins, state), 4 * (n + ns), wkv_check)

        def wkv_alone(b, N=N, n=n, rows=rows):
            y = _from_raw(b[: 2 * n], torch.float32, rows["y"][1:].shape)
            assert torch.equal(y, rows["y"][1:]) and torch.equal(
                _from_raw(b[2 * n :], torch.float32, rows["s"][1:].shape), rows["s"][1:]
            ), ("wkv7 row alone", N)

        add(_case(6, [1, 21, 2, N], *(t[1:] for t in ins), state[1:]), 2 * (n + ns), wkv_alone)
    # K-quants (random valid blocks): the spec (x rounded to int8 per 32 columns) and batched =
    # alone bit for bit; the decoder: the gguf package's values bit for bit
    for qtype, N, K in [("Q4_K", 24, 2048), ("Q5_K", 9, 768), ("Q6_K", 17, 1280)]:
        blocks, tid = TQ.random_blocks(qtype, N, K, seed=N), TQ.ktype_id(qtype)
        w = TQ.gguf_weight(qtype, blocks, K)
        x = x_all[:, :K].contiguous()
        rows = {}
        add(
            _case(7, [N, K, 6, tid, 0], blocks, x),
            6 * N * 4,
            gemv_checks(qtype, rows, TQ.spec(x, w), 6, torch.float32, 2e-5),
        )
        for i in range(6):

            def kq_alone(b, i=i, N=N, rows=rows, name=qtype):
                assert torch.equal(_from_raw(b, torch.float32, (1, N)), rows[6][i : i + 1]), (name, i)

            add(_case(7, [N, K, 1, tid, 0], blocks, x[i : i + 1]), N * 4, kq_alone)
        for ot in (torch.float32, torch.bfloat16):

            def kq_dequant(b, N=N, K=K, w=w, ot=ot, name=qtype):
                assert torch.equal(_from_raw(b, ot, (N, K)), w.to(ot)), (name, ot)

            add(_case(8, [N, K, tid, _DT[ot]], blocks), N * K * ot.itemsize, kq_dequant)
    # dequantization and the int4 quantizer: the reference's bits and bytes
    w = torch.randn(11, 256, generator=g)
    q, s, z = P.quantize_int4(w, 64)
    add(
        _case(3, [11, 256, 4, _DT[torch.bfloat16]], q, s, z),
        11 * 256 * 2,
        lambda b: (
            torch.equal(_from_raw(b, torch.bfloat16, (11, 256)), P.dequantize_int4(q, s, z).bfloat16())
            or pytest.fail("dequant_q4")
        ),
    )
    for gs, search in [(32, True), (128, False)]:
        shrinks = torch.tensor(list(P.SEARCH_SHRINKS) if search else [1.0], dtype=torch.float32)
        ref = P.quantize_int4(w, gs, search=search)
        G = 256 // gs

        def qcheck(b, ref=ref, G=G):
            got = (
                _from_raw(b[: 11 * 128], torch.uint8, (11, 128)),
                _from_raw(b[11 * 128 : 11 * 128 + 22 * G], torch.float16, (11, G)),
                _from_raw(b[11 * 128 + 22 * G :], torch.float16, (11, G)),
            )
            for a, r in zip(got, ref):
                assert torch.equal(a, r), "quantize_q4"

        add(_case(4, [11, 256, gs, len(shrinks)], w, shrinks), 11 * 128 + 2 * 22 * G, qcheck)

    (tmp_path / "cases").write_bytes(b"".join(cases))
    r = subprocess.run(
        [*runner, str(exe), str(tmp_path / "cases"), str(tmp_path / "out")], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"level {name}" and f"{len(cases)} cases" in r.stdout
    out = (tmp_path / "out").read_bytes()
    assert len(out) == sum(n for n, _ in checks)
    pos = 0
    for n, check in checks:
        check(out[pos : pos + n])
        pos += n
    _note(name, f"ran {len(cases)} kernel cases {'natively' if native_run else 'under qemu-aarch64'}")
