"""`rwkv-engine bench MODEL`: load time, prefill and decode speed, peak memory, implied bandwidth.

Prefill runs `--batch` rows of `--prompt-len` tokens through one forward (best of the repeats);
decode then feeds one token per row per step from that state and reports the median step. The
token ids are fixed pseudo-random ids, so runs are comparable. Decode is memory-bound: every
step reads every weight but the embedding once, so bytes per step x steps per second is the
memory bandwidth the run achieved. Beside it, bench measures what this machine's memory delivers
to a plain streaming read on the same threads (an fp32 sum of at least 256 MB and 16 times the
last-level cache, median of 7 passes, in memory of the kind the weights are in: huge pages where
the engine puts them there, see rwkv_engine/memory.py) and prints the decode speed that bandwidth
allows at batch 1: the ceiling no engine passes on this machine.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

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


def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs; 32 MB where unknown)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError):
            pass
    return max(sizes, default=32 * 2**20)


def read_bandwidth_gb_s(repeats: int = 7) -> float:
    """GB/s of a streaming read (torch's sum, all threads) of a buffer at least 16 times the last
    level cache and 256 MB, so that no pass is served from the cache: the median of `repeats`
    passes (a shared machine's passes vary; the median is stable where the best is not)."""
    import torch

    from ..memory import huge_page_empty, huge_pages_available

    nbytes = max(256 * 2**20, 16 * last_level_cache_bytes())
    if huge_pages_available():  # as the weights are (memory.to_huge_pages)
        buf = huge_page_empty((nbytes // 4,), torch.float32).fill_(1.0)
    else:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


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

    t0 = time.perf_counter()
    model = _load(args)  # no tokenizer: bench feeds token ids
    load_s = time.perf_counter() - t0
    r = measure(model, args.prompt_len, args.decode_tokens, args.batch, args.repeats)
    rss = peak_rss_mb()  # before the bandwidth probe's buffer
    from ..memory import huge_page_bytes

    huge = huge_page_bytes()
    from ..kernels import native
    from ..quant.schemes import quantization_note

    isa = native.isa()
    read_bw = read_bandwidth_gb_s()
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
        "memory_read_gb_s": round(read_bw, 2),
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
        f"memory read     {result['memory_read_gb_s']:.1f} GB/s (streaming sum) -> batch-1 decode bound "
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
