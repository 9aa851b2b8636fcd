"""The one-shot GPU check (issue 26): parity, prefill, batched decode, memory, the HBM bound, the
`rwkv` package as the peer, all in one run that prints as it goes. Run it through
benchmarks/gpu_check.sh (it installs the tree and the carried wheels first).

    python benchmarks/gpu_check.py                 # on a CUDA machine: 1.5B shapes, then 7.2B if time remains
    python benchmarks/gpu_check.py --dry-run       # every phase on the CPU with tiny shapes

Each phase is guarded: one that fails prints its error and the next one runs. Phases that would
not finish before the deadline (--budget seconds from the start) are skipped with a line. The
checkpoints are random (rwkv_engine.testing): speed and parity need shapes, not trained weights;
greedy agreement of random models is fragile (near-flat logits), so parity also prints the logits'
relative RMS along the reference's own path. Output goes to stdout and, with --out or $OUT, to
gpu_check.log there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Before torch / the engine import: no hub, and the `rwkv` package's plain paths unless a phase asks.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RWKV_JIT_ON", "0")
os.environ.setdefault("RWKV_CUDA_ON", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rwkv_engine import testing  # noqa: E402

FULL = {
    "7": dict(n_layer=24, n_embd=2048, vocab_size=65536, head_size=64),
    "5.2": dict(n_layer=24, n_embd=2048, vocab_size=65536, head_size=64),
    "7.2B": dict(n_layer=32, n_embd=4096, vocab_size=65536, head_size=64),
}
TINY = {
    "7": dict(n_layer=3, n_embd=256, vocab_size=512, head_size=64),  # big enough for q8 / q4 to quantize
    "5.2": dict(n_layer=2, n_embd=64, vocab_size=512, head_size=16),
    "7.2B": dict(n_layer=2, n_embd=128, vocab_size=512, head_size=32),
}


class Report:
    """Lines to stdout and to the log file, flushed at once (a run cut short keeps what it printed)."""

    def __init__(self, out: Path | None):
        self.file = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.file = open(out / "gpu_check.log", "a", buffering=1)

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")


class Check:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.t0 = time.monotonic()
        self.say = Report(Path(args.out) if args.out else None)
        self.cuda = torch.cuda.is_available() and not self.dry
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.shapes = TINY if self.dry else FULL
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.paths: dict[str, Path] = {}
        self.failed: list[str] = []

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    @contextlib.contextmanager
    def phase(self, name: str, needs: float = 0.0):
        """A guarded phase: its error is printed and the check goes on; skipped when fewer than
        `needs` seconds of the budget are left (a rough estimate of the phase's time)."""
        if not self.dry and self.left() < needs:
            self.say(f"== {name}: skipped, {self.left():.0f} s of the budget left (needs about {needs:.0f})")
            yield False
            return
        self.say(f"== {name}  (t={time.monotonic() - self.t0:.0f} s)")
        start = time.monotonic()
        try:
            yield True
        except Exception as e:  # one phase failing must not stop the others
            self.failed.append(name)
            self.say(f"   FAILED: {type(e).__name__}: {' '.join(str(e).split())[:400]}")
            for line in traceback.format_exc().strip().splitlines()[-6:]:
                self.say("   | " + line)
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.say(f"   ({time.monotonic() - start:.1f} s)")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def peak(self) -> str:
        if not self.cuda:
            return "n/a (cpu)"
        return f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    # --- phases -----------------------------------------------------------------------------

    def env(self) -> None:
        import platform

        self.say(f"   python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}")
        if self.cuda:
            p = torch.cuda.get_device_properties(0)
            self.say(
                f"   {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, bf16 {torch.cuda.is_bf16_supported()}"
            )
        for mod in ("triton", "fla", "rwkv", "einops"):
            try:
                m = __import__(mod)
                self.say(f"   {mod} {getattr(m, '__version__', '?')}")
            except Exception as e:
                self.say(f"   {mod}: not importable ({type(e).__name__}: {e})")
        self.say(f"   mode: {'DRY RUN on the CPU, tiny shapes' if self.dry else 'cuda'}; budget {self.args.budget} s")
        self.say(
            f"   TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')} RWKV_ENGINE_ISA={os.environ.get('RWKV_ENGINE_ISA', '')}"
        )

    def hbm(self) -> None:
        n = (64 << 20) if self.dry else (4 << 30)
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        self.sync()
        reps = 3 if self.dry else 20
        t = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        self.sync()
        dt = time.perf_counter() - t
        gbs = 2 * n * reps / dt / 1e9  # read + write
        self.hbm_gbs = gbs
        self.say(f"   device-to-device copy of {n / 2**30:.2f} GiB: {gbs:.0f} GB/s (read + write)")
        del src, dst

    def kernels(self) -> None:
        """Our step kernels and fla's prefill kernels against the naive recurrences, fp32."""
        from rwkv_engine.kernels.wkv5 import wkv5_naive
        from rwkv_engine.kernels.wkv7 import wkv7_naive

        try:
            from rwkv_engine.kernels.gpu import fla, step
        except ImportError as e:
            self.say(f"   rwkv_engine.kernels.gpu is not in this tree ({e}): the PyTorch WKV runs on CUDA")
            return
        g = torch.Generator().manual_seed(0)
        B, H, N = 2, 2, 16 if self.dry else 64

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(self.device)

        for T, what in ((1, "step"), (20 if self.dry else 128, "fla")):
            r, k, v = rand(B, T, H, N), rand(B, T, H, N), rand(B, T, H, N)
            log_w = -torch.exp(rand(B, T, H, N, scale=0.5)) * 0.6
            kk = torch.nn.functional.normalize(rand(B, T, H, N), dim=-1)
            a, b = -kk, kk * torch.sigmoid(rand(B, T, H, N))
            s0 = rand(B, H, N, N, scale=0.1)
            y0, st0 = wkv7_naive(r, k, v, log_w, a, b, s0)
            u = rand(H, N, scale=0.5)
            y5, st5 = wkv5_naive(r, k, v, log_w, u, s0)
            if what == "step":
                runs = {
                    "wkv7_step": (lambda: step.wkv7_step(r, k, v, log_w, a, b, s0), y0, st0),
                    "wkv5_step": (lambda: step.wkv5_step(r, k, v, log_w, u, s0), y5, st5),
                }
            else:
                if not (fla.importable() and (self.cuda or self.dry)):
                    self.say("   fla: not importable, skipped")
                    continue
                if self.dry and os.environ.get("TRITON_INTERPRET") == "1":
                    fla._ops()  # fla's kernels under the interpreter need the tests' three patches
                    sys.path.insert(0, str(ROOT / "tests"))
                    import gpu_interpreter

                    gpu_interpreter.install()
                runs = {
                    f"wkv7_fla T={T}": (lambda: fla.wkv7_fla(r, k, v, log_w, a, b, s0), y0, st0),
                    f"wkv6_fla T={T}": (lambda: fla.wkv6_fla(r, k, v, log_w, u, s0), y5, st5),
                }
            for name, (fn, y_ref, s_ref) in runs.items():
                try:
                    y, st = fn()
                    self.say(
                        f"   {name}: y rel RMS {testing.rel_rms(y.float().cpu(), y_ref.cpu()):.1e}, "
                        f"state {testing.rel_rms(st.float().cpu(), s_ref.cpu()):.1e}"
                    )
                except Exception as e:
                    self.say(f"   {name}: FAILED {type(e).__name__}: {' '.join(str(e).split())[:300]}")

    def checkpoint(self, name: str, version: str) -> Path:
        if name in self.paths:
            return self.paths[name]
        shape = self.shapes[name]
        t = time.perf_counter()
        torch.manual_seed(0)
        sd = testing.random_state_dict(version, **shape)
        path = testing.save_pth(testing.cast(sd, torch.bfloat16), self.tmp / f"{name.replace('.', '_')}.pth")
        del sd
        size = path.stat().st_size / 2**30
        self.say(f"   {name}: RWKV-{version} {shape} -> {size:.2f} GiB bf16 in {time.perf_counter() - t:.0f} s")
        self.paths[name] = path
        return path

    def load(self, name: str, device, dtype, quantization=None):
        import rwkv_engine

        return rwkv_engine.load(self.paths[name], device=device, dtype=dtype, quantization=quantization, progress=False)

    def parity(self, name: str) -> None:
        """CUDA fp32 / bf16 against the CPU fp32 engine: logits along the CPU's greedy path."""
        steps = 16 if self.dry else 64
        prompt = list(range(10, 26))
        cpu = self.load(name, "cpu", "fp32")
        t = time.perf_counter()
        ref_tokens = testing.greedy_tokens(cpu, prompt, steps)
        ref = testing.logits_along(cpu, prompt, ref_tokens)
        self.say(
            f"   cpu fp32 reference: {steps} greedy steps + the logits along them in {time.perf_counter() - t:.0f} s"
        )
        del cpu
        gates = {"fp32": 1e-4, "bf16": 3e-2}
        for dtype in ("fp32", "bf16"):
            model = self.load(name, self.device, dtype)
            got = testing.logits_along(model, prompt, ref_tokens).cpu()
            prefill = testing.rel_rms(got[: len(prompt)], ref[: len(prompt)])
            decode = testing.rel_rms(got[len(prompt) :], ref[len(prompt) :])
            own = testing.greedy_tokens(model, prompt, steps)
            agree = next((i for i, (x, y) in enumerate(zip(own, ref_tokens)) if x != y), steps)
            same = sum(x == y for x, y in zip(own, ref_tokens))
            ok = "ok" if max(prefill, decode) < gates[dtype] else f"OVER the {gates[dtype]:.0e} gate"
            self.say(
                f"   {self.device.type} {dtype}: logits rel RMS prefill {prefill:.2e}, decode {decode:.2e} ({ok}); "
                f"greedy: first {agree}/{steps} identical, {same}/{steps} equal"
            )
            del model
            self.reset_peak()

    def prefill(self, model, label: str, T: int) -> None:
        ids = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(3)).tolist()
        model.forward(ids)  # warm-up: kernels compile, autotune
        self.sync()
        reps = 1 if self.dry else 3
        t = time.perf_counter()
        for _ in range(reps):
            model.forward(ids)
        self.sync()
        dt = (time.perf_counter() - t) / reps
        self.say(f"   {label}: prefill {T} tokens {T / dt:,.0f} tok/s ({dt * 1e3:.1f} ms)")

    def decode(self, model, label: str, batches) -> None:
        """tok/s of one-token forwards of B rows (the graph runner on CUDA), state copied in and out
        as the engine does; and of the graph replay alone."""
        V = model.config.vocab_size
        for B in batches:
            if not self.dry and self.left() < 20:
                self.say(f"   {label} B={B}: skipped, budget spent")
                continue
            try:
                self.reset_peak()
                _, state = model.forward(torch.randint(0, V, (B, 4), generator=torch.Generator().manual_seed(B)))
                ids = torch.randint(0, V, (B, 1), generator=torch.Generator().manual_seed(B + 1))
                for _ in range(1 if self.dry else 2):  # capture + warm
                    _, state = model.forward(ids, state)
                self.sync()
                n = 1 if self.dry else max(8, min(64, 2048 // B))
                t = time.perf_counter()
                for _ in range(n):
                    _, state = model.forward(ids, state)
                self.sync()
                dt = (time.perf_counter() - t) / n
                line = f"   {label} B={B}: {B / dt:,.0f} tok/s ({dt * 1e3:.2f} ms/step)"
                if B == 1 and getattr(self, "hbm_gbs", None):  # batch 1 reads every weight once a token
                    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
                    gbs = weights / dt / 1e9
                    line += f"; streams {gbs:,.0f} GB/s of weights = {100 * gbs / self.hbm_gbs:.0f}% of the copy's"
                graphs = model._graphs[1] if getattr(model, "_graphs", None) else None
                if graphs is not None:
                    bucket = graphs.bucket(B)
                    bucket.run()
                    self.sync()
                    t = time.perf_counter()
                    for _ in range(n):
                        bucket.run()
                    self.sync()
                    replay = (time.perf_counter() - t) / n
                    line += f"; graph replay alone {B / replay:,.0f} tok/s ({replay * 1e3:.2f} ms)"
                self.say(line + f"; peak {self.peak()}")
                del state
            except Exception as e:
                self.failed.append(f"{label} B={B}")
                self.say(f"   {label} B={B}: FAILED {type(e).__name__}: {' '.join(str(e).split())[:300]}")

    def dense(self, name: str):
        """The model of checkpoint `name` on the device, bf16 (fp32 in a dry run: the CPU's bf16 is slow)."""
        return self.load(name, self.device, "bf16" if self.cuda else "fp32")

    def random_model(self, name: str):
        """A random model of shape `name` built on the device without a file (the 7.2B shape: a
        29 GB fp32 checkpoint written on the CPU would take minutes). Speed only: no parity."""
        from rwkv_engine.config import ModelConfig
        from rwkv_engine.models import RWKV

        shape = self.shapes[name]
        C = shape["n_embd"]
        ranks = testing.lora_ranks("7", C)
        cfg = ModelConfig(
            version="7", n_layer=shape["n_layer"], n_embd=C, vocab_size=shape["vocab_size"], ffn_dim=4 * C,
            dim_att=C, n_head=C // shape["head_size"], head_size=shape["head_size"],
            lora_decay=ranks["decay"], lora_iclr=ranks["iclr"], lora_value=ranks["value"],
            lora_gate=ranks["gate"],
        )  # fmt: skip
        dtype = torch.bfloat16 if self.cuda else torch.float32
        with torch.device(self.device):
            model = RWKV(cfg, dtype)
        g = torch.Generator(device=self.device).manual_seed(0)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(("ln1.weight", "ln2.weight", "ln_out.weight", "ln_x.weight")):
                    p.fill_(1.0)
                elif p.dim() == 2:
                    p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
                else:
                    p.normal_(0.0, 0.1, generator=g)
        model.requires_grad_(False)
        return model.eval()

    def speed(self, name: str, quantizations, batches, prefill_T: int = 512, build=None) -> None:
        """Prefill and decode tok/s of the dense model, then of q8 / q4 quantized from it on the
        device (the check's time is short: the loader's CPU quantizer takes minutes at 1.5B; the
        modules and kernels are the same ones `load(..., quantization=)` gives on CUDA)."""
        from rwkv_engine.quant import quantize_model
        from rwkv_engine.quant.cuda import convert_for_cuda

        prompt = torch.randint(0, 512, (8 if self.dry else 64,), generator=torch.Generator().manual_seed(5)).tolist()
        ref = None
        for q in quantizations:
            if not self.dry and self.left() < 40:
                self.say(f"   {name} {q or 'dense'}: skipped, budget spent")
                continue
            self.reset_peak()
            t = time.perf_counter()
            model = build() if build is not None else self.dense(name)
            label = f"{name} {q or ('bf16' if self.cuda else 'fp32')}"
            if q is not None:
                quantize_model(model, q)
                swapped = convert_for_cuda(model) if (self.cuda or self.dry) else 0
                label += f" ({swapped} CUDA linears)"
            self.sync()
            self.say(f"   {label}: ready in {time.perf_counter() - t:.1f} s, weights {self.peak()}")
            if self.dry:
                model.graph_decode = True  # the graph runner's bookkeeping, run eagerly
            try:
                logits = model.forward(prompt)[0].float().cpu()
                if ref is None:
                    ref = logits
                else:
                    self.say(
                        f"   {label}: last-token logits rel RMS vs the dense model {testing.rel_rms(logits, ref):.3f}"
                    )
                if q is None:
                    self.prefill(model, label, 16 if self.dry else prefill_T)
                self.decode(model, label, batches[:1] if self.dry and q else batches)  # interpreted: slow
            finally:
                del model
                self.reset_peak()

    def peer(self, name: str) -> None:
        """The `rwkv` package at batch 1: its CUDA kernel build (RWKV_CUDA_ON=1), then without it."""
        path = self.paths[name]
        strategy = "cuda bf16" if self.cuda else "cpu fp32"
        modes = [("1", 180), ("0", 120)] if self.cuda else [("0", 120)]
        for cuda_on, limit in modes:
            if not self.dry and self.left() < limit / 2:
                self.say(f"   rwkv RWKV_CUDA_ON={cuda_on}: skipped, budget spent")
                continue
            env = dict(os.environ, RWKV_CUDA_ON=cuda_on, RWKV_JIT_ON="1", RWKV_V7_ON="1")
            env.pop("TRITON_INTERPRET", None)
            code = _PEER.format(path=str(path)[:-4], strategy=strategy, steps=4 if self.dry else 64)
            try:
                r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=limit)
                out = (r.stdout.strip().splitlines() or [""])[-1]
                if r.returncode == 0 and out.startswith("PEER"):
                    self.say(f"   rwkv {strategy} RWKV_CUDA_ON={cuda_on} B=1: {out[5:]}")
                else:
                    err = " ".join((r.stderr or r.stdout).strip().splitlines()[-3:])[:400]
                    self.say(f"   rwkv RWKV_CUDA_ON={cuda_on}: failed (exit {r.returncode}): {err}")
            except subprocess.TimeoutExpired:
                self.say(f"   rwkv RWKV_CUDA_ON={cuda_on}: no result within {limit} s (CUDA extension build?)")

    def run(self) -> int:
        a, dry = self.args, self.dry
        batches = (1, 3) if dry else (1, 8, 32, 64, 256)
        quants = (None, "q8", "q4")
        with self.phase("environment"):
            self.env()
        with self.phase("HBM bound: device-to-device copy") as go:
            if go:
                self.hbm()
        with self.phase("WKV kernels vs the naive recurrences (fp32)") as go:
            if go:
                self.kernels()
        with self.phase("random checkpoint: RWKV-7, 1.5B shape", needs=30) as go:
            if go:
                self.checkpoint("7", "7")
        with self.phase("parity RWKV-7: cuda fp32 / bf16 vs the cpu fp32 engine", needs=60) as go:
            if go:
                self.parity("7")
        with self.phase("speed RWKV-7 1.5B: prefill 512, decode by batch (bf16, q8, q4)", needs=90) as go:
            if go:
                self.speed("7", quants, batches)
        with self.phase("peer: the rwkv package, RWKV-7 1.5B, batch 1", needs=60) as go:
            if go:
                self.peer("7")
        if not a.skip_7b:
            with self.phase(
                "RWKV-7 7.2B shape (32 x 4096), random on the device: batch 1 and 64 (bf16)", needs=60
            ) as go:
                if go:
                    self.speed("7.2B", (None,), (1, 2) if dry else (1, 64), build=lambda: self.random_model("7.2B"))
        with self.phase("random checkpoint: RWKV-5.2, 1.5B shape", needs=30) as go:
            if go:
                self.checkpoint("5.2", "5.2")
        with self.phase("parity RWKV-5.2: cuda fp32 / bf16 vs the cpu fp32 engine", needs=60) as go:
            if go:
                self.parity("5.2")
        with self.phase("speed RWKV-5.2 1.5B: prefill 512, decode by batch (bf16)", needs=40) as go:
            if go:
                self.speed("5.2", (None,), batches)
        self.say(f"== done in {time.monotonic() - self.t0:.0f} s; failed phases: {', '.join(self.failed) or 'none'}")
        return 1 if self.failed else 0


_PEER = """
import time, torch
from rwkv.model import RWKV
m = RWKV(model={path!r}, strategy={strategy!r})
dev = "cuda" if "cuda" in {strategy!r} else "cpu"
out, state = m.forward(list(range(10, 26)), None)
tok = int(out.argmax())
for _ in range(3):
    out, state = m.forward([tok], state)
if dev == "cuda":
    torch.cuda.synchronize()
t = time.perf_counter()
for _ in range({steps}):
    out, state = m.forward([tok], state)
    tok = int(out.argmax())
if dev == "cuda":
    torch.cuda.synchronize()
dt = (time.perf_counter() - t) / {steps}
print(f"PEER {{1 / dt:,.1f}} tok/s ({{dt * 1e3:.2f}} ms/step)")
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="every phase on the CPU with tiny shapes")
    p.add_argument("--budget", type=float, default=450, help="seconds; phases that would run past it are skipped")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="also write gpu_check.log here ($OUT)")
    p.add_argument("--skip-7b", action="store_true", help="leave out the 7.2B shape")
    args = p.parse_args()
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
