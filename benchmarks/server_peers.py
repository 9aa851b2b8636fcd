"""The servers bench_server.py --peer puts beside ours, on the same random RWKV-7 weights.

* rwkvserve (PyPI, a plain-PyTorch OpenAI server for RWKV-7 with continuous batching): installed
  once into its own virtual environment under --cache (with this interpreter's packages visible,
  so it runs on the very torch build ours runs on, and nothing large is downloaded). It reads a
  model directory (config.json, model.pth, the World vocabulary), written once beside the
  checkpoint with model.pth a link to it. As shipped, its CPU path crashes on the first bf16 or
  fp16 request and then hangs every request: its WKV returns fp32 into a bf16 layer. The script
  applies a one-line patch to the venv's copy (the WKV output cast back to the layer's dtype)
  and says so. It is stopped by its PID: never with its own `--stop`, which kills every process
  that listens on the 10 ports above its own.
* llama.cpp's llama-server, from the llama-cpp-python sdist tree that bench_peers.py builds (the
  same build, the llama-server target), on the GGUF that bench_peers.py makes from the same
  checkpoint (F16 for our bf16, Q8_0 for our q8), with --parallel slots.

Each `Served` knows the request body of its server for one prompt (what a user of that server
sends to stream a completion at temperature 0 that runs to its length) and how to stop it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "bench"  # the API model id of every server
RWKVSERVE = "0.1.0"
# rwkvserve's CPU bf16 bug: the WKV's fp32 output goes on into bf16 layers (RuntimeError: expected
# m1 and m2 to have the same dtype). The fix casts it back to the dtype of the layer's activations.
RWKVSERVE_BUG = "y = cast(torch.Tensor, result_any[0])\n"
RWKVSERVE_FIX = "y = cast(torch.Tensor, result_any[0]).to(r.dtype)  # rwkv-engine bench: CPU bf16 fix\n"


@dataclass
class Served:
    """A server process of the benchmark: its base URL and the body of one streamed request."""

    name: str
    proc: subprocess.Popen
    url: str
    log: Path
    body: Callable[[str, int], dict]  # (prompt text, output tokens) -> the JSON body
    notes: list[str] = field(default_factory=list)  # said under the table

    def pause(self, paused: bool) -> None:
        """SIGSTOP / SIGCONT to the server's PID: a server that is not being measured must take no
        CPU. An idle rwkvserve polls its queue every millisecond: a third of a core of a 2-core
        machine (measured), which made our 2-thread prefill 2.7x slower while it ran."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM to the server's own PID, SIGKILL if it is still there after a minute."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(proc: subprocess.Popen, url: str, log: Path, timeout: float = 1800) -> None:
    """Until GET url/health answers 200 (SystemExit if the process exits or it never does)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{log.name}: the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{log.name}: the server did not come up in {timeout:.0f} s")


def ours_body(prompt: str, tokens: int) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# --- rwkvserve -------------------------------------------------------------------------------------


def rwkvserve_venv(cache: Path) -> Path:
    """The venv's python, rwkvserve installed into it once."""
    venv = cache / f"rwkvserve-{RWKVSERVE}" / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"installing rwkvserve {RWKVSERVE} into {venv} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    have = subprocess.run([python, "-c", "import rwkvserve"], capture_output=True).returncode == 0
    if not have:
        out = subprocess.run(
            [python, "-m", "pip", "install", "-q", f"rwkvserve=={RWKVSERVE}"], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise SystemExit(f"pip install rwkvserve=={RWKVSERVE} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return python


def rwkvserve_patch(python: Path, dtype: str) -> str:
    """Apply (or confirm) the one-line CPU dtype fix in the venv's rwkvserve; what was done, in words."""
    where = subprocess.run(
        [python, "-c", "import rwkvserve, os; print(os.path.dirname(rwkvserve.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    path = Path(where) / "models" / "rwkv7" / "model.py"
    text = path.read_text()
    if RWKVSERVE_FIX in text:
        return f"rwkvserve runs with a one-line patch for its CPU {dtype} dtype bug (in {path}, applied earlier)"
    if RWKVSERVE_BUG not in text:
        return f"rwkvserve: the line of its CPU dtype bug is not in {path}: running it as installed"
    if dtype == "fp32":
        return "rwkvserve runs unpatched (fp32, which its CPU path supports)"
    path.write_text(text.replace(" " * 12 + RWKVSERVE_BUG, " " * 12 + RWKVSERVE_FIX, 1))
    return (
        f"rwkvserve runs with a one-line patch for its CPU {dtype} dtype bug, applied now to {path}: "
        "the WKV output cast back to the layer's dtype (as shipped, the first request crashes and every later one hangs)"
    )


def rwkvserve_model_dir(work: Path, ckpt: Path) -> Path:
    """ckpt as the model directory rwkvserve reads: config.json from the tensor shapes, model.pth
    a link to the checkpoint, the World vocabulary."""
    import torch

    out = work / f"{ckpt.stem}-rwkvserve"
    if (out / "config.json").exists():
        return out
    sd = torch.load(ckpt, mmap=True, weights_only=True)
    L = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    V, C = sd["emb.weight"].shape
    att = "blocks.1.att."  # (layer 0 has no value LoRA in some files)
    if sd[att + "w1"].shape[1] != sd[att + "a1"].shape[1]:
        raise SystemExit("rwkvserve takes one LoRA rank for the decay and the in-context rate; this checkpoint has two")
    config = {
        "model_type": "rwkv7",
        "n_layer": L,
        "n_embd": C,
        "vocab_size": V,
        "head_size_a": sd[att + "r_k"].shape[1],
        "dim_att_lora": sd[att + "w1"].shape[1],
        "dim_mv_lora": sd[att + "v1"].shape[1],
        "dim_gate_lora": sd[att + "g1"].shape[1],
        "dim_ffn": sd["blocks.0.ffn.key.weight"].shape[0],
        "ctx_len": 1 << 20,
    }
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    import json

    (tmp / "model.pth").symlink_to(ckpt.resolve())
    vocab = Path(__file__).resolve().parents[1] / "rwkv_engine" / "data" / "rwkv_vocab_v20230424.txt"
    shutil.copy(vocab, tmp / vocab.name)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    os.replace(tmp, out)
    return out


def start_rwkvserve(work: Path, ckpt: Path, cache: Path, dtype: str, max_batch: int, threads: int) -> Served:
    python = rwkvserve_venv(cache)
    note = rwkvserve_patch(python, dtype)
    print(note, file=sys.stderr, flush=True)
    model_dir = rwkvserve_model_dir(work, ckpt)
    port = free_port()
    log = work / "bench_server-rwkvserve.log"
    cmd = [
        str(python.parent / "rwkvserve"),
        "--model-path",
        str(model_dir),
        "--model-name",
        MODEL,
        "--device",
        "cpu",
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-batch-size",
        str(max_batch),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_health(proc, url, log)

    def body(prompt: str, tokens: int) -> dict:
        # It has no ignore_eos, and its /v1/completions ignores max_tokens (100 tokens, always).
        return {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}

    notes = [
        note,
        f"rwkvserve {RWKVSERVE}: --dtype {dtype}, --max-batch-size {max_batch}, its default prefill chunk (512) "
        "and prefix cache; its /v1/completions ignores max_tokens (always 100 tokens) and has no ignore_eos; "
        "its stream is bare JSON objects, not SSE",
    ]
    return Served("rwkvserve", proc, url, log, body, notes)


# --- llama-server ----------------------------------------------------------------------------------


def start_llama_server(
    work: Path, ckpt: Path, cache: Path, llama_type: str, parallel: int, threads: int, jobs: int, ctx_per_slot: int
) -> Served:
    from bench_peers import build_llama, gguf_files, llama_tree, missing_tools

    if missing := missing_tools():
        raise SystemExit(f"--peer llama-server: building llama.cpp needs {' and '.join(missing)}")
    tree = llama_tree(cache)
    bins = build_llama(tree, jobs, targets=("llama-quantize", "llama-server"))
    gguf = gguf_files(work, ckpt, tree, bins, [llama_type], threads)[llama_type]
    version = subprocess.run([bins / "llama-server", "--version"], capture_output=True, text=True)
    port = free_port()
    log = work / "bench_server-llama-server.log"
    cmd = [
        str(bins / "llama-server"),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        MODEL,
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--parallel",
        str(parallel),
        "-c",
        str(ctx_per_slot * parallel),  # divided among the slots
        "--no-webui",
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_health(proc, url, log)

    def body(prompt: str, tokens: int) -> dict:
        return {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    build = (version.stdout + version.stderr).strip().splitlines()
    notes = [
        f"llama-server ({'; '.join(build[-2:]) or '?'}; llama-cpp-python sdist tree): {gguf.name}, "
        f"--parallel {parallel}, -c {ctx_per_slot} per slot, -t {threads}"
    ]
    return Served("llama-server", proc, url, log, body, notes)
