"""7B-class models on a small machine: write a random 7B-shape checkpoint once, convert it to q8 and
q4, and bench the .pth, the converted directories and quantize-on-load, printing peak RSS.

    python benchmarks/bench_big.py                         # RWKV-7, 32 x 4096, vocab 65536, bf16 .pth
    python benchmarks/bench_big.py --version 5.2           # the RWKV-5.2 shape instead
    python benchmarks/bench_big.py --steps convert-q4,bench-q4 --scratch /work/bigscratch

The checkpoint (about 15 GB) is written once into --scratch (never inside a git tree) and kept
for re-runs; so are the converted directories (`--clean` removes them all at the end). It is
written without holding it in memory: torch.save lays out the zip-format file with every
storage left empty (torch.serialization.skip_data, from fake tensors of the right shapes), then
each block's random tensors are made and written into their places, one block at a time. The
file is checked to load with torch.load(mmap=True) before it is used.

Every step runs in its own process (its peak RSS is its own: the CLI's VmHWM for bench, the
child's ru_maxrss for convert; this parent never imports torch) and first checks the memory
available (MemAvailable in /proc/meminfo): with less than the step needs plus --margin GB, it
waits (polling every 30 s, at most --wait minutes) and then skips the step with a message, so
it neither swaps nor meets the OOM killer while other work shares the machine.

Targets on a 24 GB machine (the big-models issue): q4 convert <= 6 GB peak, q4 bench <= 5.5 GB,
bf16 bench <= 16.5 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(n_layer=32, n_embd=4096, vocab_size=65536, head_size=64)
# GB each step needs at most (its target, or the measured peak with some room), checked before it starts
NEEDS = {
    "write": 3.0,
    "convert-q8": 7.0,
    "convert-q4": 6.0,
    "bench-q8": 8.5,
    "bench-q4": 5.5,
    "bench-pth-q4": 6.0,
    "bench-pth": 16.5,
}
STEPS = ("write", "convert-q8", "convert-q4", "bench-q8", "bench-q4", "bench-pth-q4", "bench-pth")
TARGETS = {"convert-q4": 6000, "bench-q4": 5500, "bench-pth-q4": 5500, "bench-pth": 16500}


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def wait_for_memory(step: str, need: float, margin: float, wait_min: float) -> bool:
    deadline = time.time() + wait_min * 60
    while True:
        avail = mem_available_gb()
        if avail >= need + margin:
            return True
        if time.time() >= deadline:
            print(
                f"[{step}] skipped: {avail:.1f} GB available, it needs {need:.1f} GB + {margin:.1f} GB margin",
                flush=True,
            )
            return False
        print(f"[{step}] waiting for memory: {avail:.1f} GB available, need {need + margin:.1f} GB", flush=True)
        time.sleep(30)


def run_child(cmd: list[str]) -> tuple[int, str, float, str]:
    """(exit status, "wall s / CPU s", peak RSS MB of the child, stdout). The CPU seconds (user +
    system, all threads) are what the step costs on a machine others share; on an idle machine
    with T cores it takes about CPU / T seconds."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    times = f"{time.perf_counter() - t:.0f} s / CPU {usage.ru_utime + usage.ru_stime:.0f} s"
    return p.returncode, times, usage.ru_maxrss / 1024, out


# --- writing the checkpoint (in a child process: python bench_big.py --write-only PATH) -------------


def write_checkpoint(path: Path, version: str) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rwkv_engine import testing

    L, C, V, N = SHAPE["n_layer"], SHAPE["n_embd"], SHAPE["vocab_size"], SHAPE["head_size"]

    def block(i: int) -> dict:
        """Layer i's tensors (bf16), from a one-layer random model seeded by i."""
        sd = testing.random_state_dict(version, n_layer=1, n_embd=C, vocab_size=16, head_size=N, seed=1000 + i)
        return {
            k.replace("blocks.0.", f"blocks.{i}.", 1): v.to(torch.bfloat16)
            for k, v in sd.items()
            if k.startswith("blocks.0.") and ".ln0." not in k
        }

    template = block(0)
    gen = torch.Generator().manual_seed(7)
    ln0 = {"blocks.0.ln0.weight": torch.ones(C), "blocks.0.ln0.bias": torch.zeros(C)}
    ln_out = {"ln_out.weight": torch.ones(C), "ln_out.bias": torch.zeros(C)}
    shapes = {"emb.weight": (V, C), **{k: (C,) for k in ln0}}
    for i in range(L):
        shapes.update({k.replace("blocks.0.", f"blocks.{i}.", 1): tuple(v.shape) for k, v in template.items()})
    shapes.update({**{k: (C,) for k in ln_out}, "head.weight": (V, C)})
    tmp = path.with_name(path.name + ".partial")
    with FakeTensorMode():
        skeleton = {k: torch.empty(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, tmp)
    del skeleton
    import zipfile

    with zipfile.ZipFile(tmp) as z:
        infos = {i.filename.split("/", 1)[1]: i for i in z.infolist()}
    index = {k: j for j, k in enumerate(shapes)}  # torch.save numbers storages in pickling (dict) order
    fd = os.open(tmp, os.O_RDWR)
    with open(tmp, "rb") as f:

        def offset(key: str) -> int:
            info = infos[f"data/{index[key]}"]
            f.seek(info.header_offset)
            head = f.read(30)
            return (
                info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
            )

        fingerprints = {}

        def put(key: str, t) -> None:
            t = t.to(torch.bfloat16).contiguous()
            assert tuple(t.shape) == shapes[key], (key, t.shape)
            data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            assert len(data) == infos[f"data/{index[key]}"].file_size
            pos, done = offset(key), 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], pos + done)
            fingerprints[key] = t.reshape(-1)[:64].float().sum().item()

        t0 = time.perf_counter()
        put("emb.weight", torch.randn(V, C, generator=gen))
        for k, v in {**ln0, **ln_out}.items():
            put(k, v)
        put("head.weight", torch.randn(V, C, generator=gen) * (2.0 / C**0.5))
        for i in range(L):
            for k, v in (template if i == 0 else block(i)).items():
                put(k, v)
            print(f"  block {i + 1}/{L} written ({time.perf_counter() - t0:.0f} s)", flush=True)
    os.fsync(fd)
    os.close(fd)
    back = torch.load(tmp, mmap=True, weights_only=True)
    for k in list(shapes)[:3] + list(shapes)[-3:]:
        assert back[k].reshape(-1)[:64].float().sum().item() == fingerprints[k], f"{k} did not land in its place"
    del back
    os.rename(tmp, path)


# --- the steps ------------------------------------------------------------------------------------


def bench_cmd(model: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rwkv_engine",
        "bench",
        model,
        "--json",
        "--prompt-len",
        "64",
        "--decode-tokens",
        "8",
        "--repeats",
        "1",
        *extra,
    ]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--version", default="7", choices=["7", "5.2"])
    ap.add_argument(
        "--scratch", default="/work/bigscratch", help="where the checkpoint and outputs live (default: %(default)s)"
    )
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--margin", type=float, default=4.0, help="GB to leave free for others (default: %(default)s)")
    ap.add_argument("--wait", type=float, default=10.0, help="minutes to wait for memory before skipping a step")
    ap.add_argument(
        "--clean", action="store_true", help="delete the checkpoint and the converted directories at the end"
    )
    ap.add_argument("--write-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write_only:
        write_checkpoint(Path(args.write_only), args.version)
        return 0
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    tag = f"rwkv{args.version.replace('.', '')}-7b"
    pth, q8, q4 = scratch / f"{tag}.pth", scratch / f"{tag}-q8", scratch / f"{tag}-q4"
    steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        ap.error(f"unknown step(s) {bad}; choose from {STEPS}")
    rows = []
    for step in steps:
        if step == "write" and pth.exists():
            print(f"[write] {pth} exists ({pth.stat().st_size / 1e9:.1f} GB): kept", flush=True)
            continue
        if step != "write" and not pth.exists():
            print(f"[{step}] skipped: {pth} is missing (run the write step)", flush=True)
            continue
        if not wait_for_memory(step, NEEDS[step], args.margin, args.wait):
            rows.append((step, "skipped (memory)", "", "", "", ""))
            continue
        if step == "write":
            print(f"[write] writing {pth} (RWKV-{args.version}, {SHAPE})", flush=True)
            code, secs, rss, _ = run_child(
                [sys.executable, __file__, "--version", args.version, "--write-only", str(pth)]
            )
            rows.append((step, "ok" if code == 0 else f"failed ({code})", f"{rss:.0f}", secs, "", ""))
            if code:
                break
            continue
        if step.startswith("convert"):
            out = q8 if step.endswith("q8") else q4
            if out.exists():
                print(f"[{step}] {out} exists: kept", flush=True)
                continue
            code, secs, rss, stdout = run_child(
                [sys.executable, "-m", "rwkv_engine", "convert", str(pth), str(out), "-q", step.split("-")[1]]
            )
            print(f"[{step}] {stdout.strip()}", flush=True)
            ok = code == 0
            size = sum(f.stat().st_size for f in out.iterdir()) / 1e9 if ok else 0
            rows.append((step, "ok" if ok else f"failed ({code})", f"{rss:.0f}", secs, f"{size:.2f} GB", ""))
            continue
        model, extra = {
            "bench-q8": (q8, ()),
            "bench-q4": (q4, ()),
            "bench-pth-q4": (pth, ("-q", "q4")),
            "bench-pth": (pth, ("--dtype", "auto")),
        }[step]
        if not Path(model).exists():
            print(f"[{step}] skipped: {model} is missing", flush=True)
            continue
        code, secs, rss, stdout = run_child(bench_cmd(str(model), *extra))
        if code:
            rows.append((step, f"failed ({code})", f"{rss:.0f}", "", "", ""))
            continue
        r = json.loads(stdout.strip().splitlines()[-1])
        print(f"[{step}] {json.dumps(r)}", flush=True)
        rows.append(
            (
                step,
                f"ok ({r['dtype']})",
                f"{r['peak_rss_mb']:.0f}",
                f"load {r['load_s']:.1f} s",
                f"prefill {r['prefill_tok_s']:.1f} tok/s",
                f"decode {r['decode_tok_s']:.2f} tok/s",
            )
        )
    print(
        f"\nRWKV-{args.version} 7B shape ({SHAPE['n_layer']} x {SHAPE['n_embd']}, vocab {SHAPE['vocab_size']}), "
        f"{os.cpu_count()} CPUs, MemTotal {mem_total_gb():.0f} GB"
    )
    print(f"{'step':14} {'result':22} {'peak RSS MB':>11}  {'time (wall / CPU)':26} {'':22} {''}")
    for step, res, rss, a, b, c in rows:
        target = TARGETS.get(step)
        flag = "" if target is None or not rss else (" (target <= %d)" % target)
        print(f"{step:14} {res:22} {rss:>11}  {a:26} {b:22} {c}{flag}")
    if args.clean:
        import shutil

        for p in (q8, q4):
            shutil.rmtree(p, ignore_errors=True)
        pth.unlink(missing_ok=True)
    return 0


def mem_total_gb() -> float:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) / 2**20


if __name__ == "__main__":
    sys.exit(main())
