"""`rwkv-engine bench MODEL`: load time, prefill and decode speed, peak memory, implied bandwidth.

Prefill runs `--batch` rows of `--prompt-len` tokens through one forward (best of the repeats);
decode then feeds one token per row per step from that state and reports the median step. The
token ids are fixed pseudo-random ids, so runs are comparable. Decode is memory-bound: every
step reads every weight but the embedding once, so bytes per step x steps per second is the
memory bandwidth the run achieved. Beside it, bench measures what this machine's memory delivers
to a streaming read on the same threads (read_bandwidth: the best of several read patterns, torch
sums and our own GEMVs over int8 / bf16 rows, over a buffer of at most 1 GB freed before the model
loads) and prints the decode speed that bandwidth allows at batch 1: the ceiling no engine passes
on this machine. The peak RSS is the model's: the probe's is reset away (Linux).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time

from ..errors import InputError
from . import common

HELP = "Measure load time, prefill and decode speed, peak memory and bandwidth of a model."


def add_arguments(parser) -> None:
    common.add_model_args(parser)
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per row (default: %(default)s)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="decode steps to time (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together (default: %(default)s)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="prefill repeats, best is reported (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _check(args) -> None:
    for name in ("prompt_len", "decode_tokens", "batch", "repeats"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def weight_bytes_per_step(model) -> int:
    """Bytes of parameters and buffers a decode step reads: everything but the embedding table."""
    if hasattr(model, "weight_bytes_per_step"):  # an exported program (rwkv_engine/export) knows its own
        return model.weight_bytes_per_step()
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("emb.") or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def measure(model, prompt_len: int, decode_tokens: int, batch: int, repeats: int) -> dict:
    import torch

    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, V, (batch, prompt_len), generator=g)
    model.forward(prompt[:, : min(prompt_len, 16)])  # warm up (allocator, native kernels)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        logits, state = model.forward(prompt)
        times.append(time.perf_counter() - t)
    prefill_s = min(times)
    tok = logits.argmax(-1, keepdim=True)
    for _ in range(2):  # warm up decode
        logits, state = model.forward(tok, state)
        tok = logits.argmax(-1, keepdim=True)
    steps = []
    for _ in range(decode_tokens):
        t = time.perf_counter()
        logits, state = model.forward(tok, state)
        steps.append(time.perf_counter() - t)
        tok = logits.argmax(-1, keepdim=True)
    step_s = statistics.median(steps)
    bytes_per_step = weight_bytes_per_step(model)
    return {
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "decode_tok_s": batch / step_s,
        "decode_step_ms": step_s * 1000,
        "weight_bytes_per_step": bytes_per_step,
        "bandwidth_gb_s": bytes_per_step / step_s / 1e9,
    }


PROBE_CAP_BYTES = 1 << 30  # the probe's buffer: big enough to stream from memory on any CPU's cache
PROBE_MIN_BYTES = 64 << 20


def _mem_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def probe_bytes() -> int:
    """The bandwidth probe's buffer: PROBE_CAP_BYTES, or a quarter of the available memory where that
    is less. Never sized by the cache: a CPU reporting a 300 MB L3 made 16 x LLC a 4.8 GB buffer.
    1 GB is 3x the largest L3 seen, and the passes of a median (each a full sweep) evict it anyway."""
    avail = _mem_available_bytes()
    cap = PROBE_CAP_BYTES if avail is None else min(PROBE_CAP_BYTES, avail // 4)
    return max(PROBE_MIN_BYTES, cap) // (1 << 20) * (1 << 20)


# The weights' own layout: a GEMV of our native kernels over the probe's buffer seen as int8 / bf16
# rows of this many bytes (the shapes of a 1.5B model's rows), with one row of x.
_PROBE_ROW_BYTES = 4096


def _probe_patterns(buf) -> dict:
    """name -> (bytes read, a function doing one pass) over the uint8 buffer `buf`."""
    import torch

    n = buf.numel()
    f32 = buf.view(torch.float32)
    patterns = {
        # torch's sum on all threads, and on one: a shared machine's other thread may be busy
        "sum": (n, lambda: f32.sum()),
        "sum_1_thread": (n, lambda: _one_thread(f32.sum)),
        # one float per 64-byte line: every line is still fetched whole, with far fewer instructions
        "strided": (n, lambda: f32.view(-1, 16)[:, 0].sum()),
    }
    from ..kernels import native

    ops = native.load()
    if ops is not None:
        rows = n // _PROBE_ROW_BYTES
        q = buf[: rows * _PROBE_ROW_BYTES].view(torch.int8).view(rows, _PROBE_ROW_BYTES)
        scales = torch.ones(rows, 1, dtype=torch.float16)
        w = q.view(torch.bfloat16)
        xq = torch.ones(1, _PROBE_ROW_BYTES, dtype=torch.bfloat16)
        xd = torch.ones(1, _PROBE_ROW_BYTES // 2, dtype=torch.bfloat16)
        patterns["gemv_q8"] = (q.numel(), lambda: ops.gemv_q8(xq, q, scales, None))
        patterns["gemv_bf16"] = (q.numel(), lambda: ops.gemv_dense(xd, w))
    return patterns


def _one_thread(fn):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def read_bandwidth(repeats: int = 7, nbytes: int | None = None) -> dict:
    """What this machine's memory delivers to a streaming read, on the threads in use: several access
    patterns over one buffer of `probe_bytes()` (in memory of the kind the weights are in: huge pages
    where the engine puts them there, see rwkv_engine/memory.py), their passes alternating; each
    pattern's median pass in GB/s (a shared machine's passes vary; the median is stable where the best
    is not), and the best pattern's: the bound an engine's decode may approach but not pass. The
    buffer is freed before this returns.

    {"gb_s": best, "pattern": its name, "patterns": {name: GB/s}, "buffer_mb": size}"""
    import torch

    from ..memory import huge_page_empty, huge_pages_available

    nbytes = nbytes or probe_bytes()
    if huge_pages_available():  # as the weights are (memory.to_huge_pages)
        buf = huge_page_empty((nbytes,), torch.uint8)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.view(torch.float32).fill_(1.0)
    patterns = _probe_patterns(buf)
    times = {name: [] for name in patterns}
    for _, fn in patterns.values():
        fn()  # warm up (the native kernels' threads, torch's)
    for _ in range(repeats):
        for name, (_, fn) in patterns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    gb_s = {name: patterns[name][0] / statistics.median(ts) / 1e9 for name, ts in times.items()}
    del patterns, buf
    best = max(gb_s, key=gb_s.get)
    return {"gb_s": gb_s[best], "pattern": best, "patterns": gb_s, "buffer_mb": nbytes >> 20}


def read_bandwidth_gb_s(repeats: int = 7) -> float:
    """GB/s of the best streaming-read pattern (read_bandwidth)."""
    return read_bandwidth(repeats)["gb_s"]


def reset_peak_rss() -> bool:
    """Resets this process's peak resident memory to its current one (Linux >= 4.0: clear_refs 5),
    so that a later peak_rss_mb counts what came after; whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """This process's peak resident memory. On Linux the VmHWM of /proc/self/status: getrusage's
    ru_maxrss survives exec, so a process started by a bigger one would report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def run(args) -> int:
    _check(args)
    import torch

    # The bandwidth probe first, its buffer freed and the peak reset before the model loads, so the
    # peak RSS is the model's own; where the peak cannot be reset, after the model's peak is read.
    probe = read_bandwidth() if reset_peak_rss() else None
    if probe is not None:
        reset_peak_rss()
    t0 = time.perf_counter()
    model = _load(args)  # no tokenizer: bench feeds token ids
    load_s = time.perf_counter() - t0
    r = measure(model, args.prompt_len, args.decode_tokens, args.batch, args.repeats)
    rss = peak_rss_mb()
    from ..memory import huge_page_bytes

    huge = huge_page_bytes()
    from ..kernels import native
    from ..quant.schemes import quantization_note

    isa = native.isa()
    if probe is None:
        probe = read_bandwidth()
    read_bw = probe["gb_s"]
    c = model.config
    result = {
        "model": str(args.model),
        "version": c.version,
        "n_layer": c.n_layer,
        "n_embd": c.n_embd,
        "dtype": str(model.dtype).removeprefix("torch."),
        "dtype_reason": model.dtype_reason,
        "matmul_dtype": _matmul_dtype(model),
        "quantization": model.quantization.name if model.quantization else None,
        "quantization_note": quantization_note(args.quantization, model.quantization),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "isa": isa,  # the native kernels' ISA level; None: the PyTorch paths
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "load_s": round(load_s, 3),
        "prefill_tok_s": round(r["prefill_tok_s"], 2),
        "decode_tok_s": round(r["decode_tok_s"], 2),
        "decode_step_ms": round(r["decode_step_ms"], 2),
        "peak_rss_mb": round(rss, 1),
        "huge_pages_mb": None if huge is None else round(huge / 2**20),  # of the process, weights and all
        "weight_bytes_per_token": r["weight_bytes_per_step"],
        "bandwidth_gb_s": round(r["bandwidth_gb_s"], 2),
        "memory_read_gb_s": round(read_bw, 2),  # the best pattern's
        "memory_read_pattern": probe["pattern"],
        "memory_read_patterns_gb_s": {k: round(v, 2) for k, v in probe["patterns"].items()},
        "memory_probe_mb": probe["buffer_mb"],  # freed before the model loads: not in peak_rss_mb
        "decode_bound_tok_s": round(read_bw * 1e9 / r["weight_bytes_per_step"], 2),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    note = f" ({args.quantization} asked: {result['quantization_note']})" if result["quantization_note"] else ""
    print(
        f"model           {result['model']} (RWKV-{c.version}, {c.n_layer} x {c.n_embd}, "
        f"{result['dtype']}, quantization {result['quantization']}{note}, {result['device']}, {result['threads']} threads)"
    )
    print(
        f"native kernels  {isa or 'off (PyTorch paths)'}" + (f" (ISA level; {native.ENV} picks another)" if isa else "")
    )
    print(f"dtype           {result['dtype']} ({result['dtype_reason']}), prefill matmuls in {result['matmul_dtype']}")
    print(f"load            {result['load_s']:.2f} s")
    print(f"prefill         {result['prefill_tok_s']:.1f} tok/s ({args.batch} x {args.prompt_len} tokens)")
    print(
        f"decode          {result['decode_tok_s']:.2f} tok/s (batch {args.batch}, median step {result['decode_step_ms']:.1f} ms)"
    )
    print(f"weights / step  {result['weight_bytes_per_token'] / 1e6:.1f} MB -> {result['bandwidth_gb_s']:.1f} GB/s")
    print(
        f"memory read     {result['memory_read_gb_s']:.1f} GB/s (best of {len(probe['patterns'])} read patterns: "
        f"{probe['pattern']}) -> batch-1 decode bound "
        f"{result['decode_bound_tok_s']:.1f} tok/s"
    )
    print(
        f"peak RSS        {result['peak_rss_mb']:.0f} MB"
        + (f" ({result['huge_pages_mb']} MB on huge pages)" if result["huge_pages_mb"] is not None else "")
    )
    return 0


def _matmul_dtype(model) -> str:
    """The dtype of the prefill GEMMs of the model's matrices on its device (quant.linear.compute_dtype)."""
    import torch

    from ..quant.linear import compute_dtype

    dt = model.dtype if model.dtype == torch.float32 else compute_dtype(model.dtype, model.device)
    return str(dt).removeprefix("torch.")


def _load(args):
    import rwkv_engine

    return rwkv_engine.load(
        args.model, device=args.device, dtype=args.dtype, quantization=args.quantization, group_size=args.group_size
    )
