"""Soak and fault test of `rwkv-engine serve`: many streams for minutes, with misbehaving clients.

    python benchmarks/soak_server.py                          # 8 streams, 3 minutes, the 0.1B shape
    python benchmarks/soak_server.py --streams 16 --minutes 10
    python benchmarks/soak_server.py --shape tiny --minutes 1  # a 2 x 64 model: the HTTP side only
    python benchmarks/soak_server.py --scenario fairness       # short prompts behind a long one
    python benchmarks/soak_server.py --scenario slow-reader    # clients that never read their answer

A random-weight checkpoint (bench_engine.py's, bf16; or a tiny 2-layer one) is served by a server
subprocess on a free loopback port (127.0.0.1 only: nothing here reaches the network), with short
header and body timeouts so stalled sockets are closed within the run. For --minutes, all at once:

* --streams stream workers, each in a loop: a streamed completion (random prompt, 16-160
  tokens, end-of-text banned); one in --disconnect-rate of them is dropped after a few events.
  Each stream must end with its finish chunk and `data: [DONE]`.
* one malformed-request worker: bad JSON, wrong types, out-of-range values, a 5000-digit
  logit_bias key, an unknown model, a foreign Host header, a cross-site Origin, a body cut
  short by a client that closes, a request line of garbage. Each must get its 4xx (or, for the
  cut body, nothing) and never a 5xx.
* one stalling worker: up to --stalled sockets at a time that send half a request (half the
  headers, or the headers and half the body) and then nothing; the server must close each
  within its timeout (plus slack).
* a monitor: every 5 s the server's RSS (from /proc) and the latency of a keep-alive /health.

Every loop ends at the deadline; the script then stops the server with SIGTERM (it must exit 0)
and prints: outcomes and errors by kind, p50 / p99 time to first token, aggregate tok/s (tokens
of all streams / the time until the last stream ended), RSS over time, the server's /metrics error counts and the number of
tracebacks in its log (must be 0).

--scenario fairness: --shorts short streamed completions (a few words, 8 tokens each) at once on
an idle server, then a streamed completion of a --long-words word prompt and, 1 s later, the same
short completions again. It prints the shorts' time to first token p50 / p99 alone and behind the
long prompt, and their ratio: the engine prefills round-robin, so a short prompt waits for a few
chunks of the long one, not for all of it. (--max-batch is shorts + 1: no short waits for a slot.)

--scenario slow-reader: --streams normal stream workers run while --slow-readers clients each ask
for a big answer (a prompt's echo with log-probabilities, several MB) and never read it. The
server (--write-timeout 3) must cut each off a few seconds after it stops taking bytes; printed:
how long each was held and what it got, the normal streams' time to first token, and the
server's RSS before, at most, and after.

Machines are noisy and shared: the numbers are for one machine at one time; name the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bench_engine import SHAPES, make_checkpoint
from bench_server import WORDS, wait_ready

MODEL = "soak"
HEADER_TIMEOUT = 3
BODY_TIMEOUT = 3


def checkpoint(work: Path, shape: str) -> Path:
    if shape == "tiny":
        from rwkv_engine import testing

        path = work / "soak-tiny.pth"
        if not path.exists():
            testing.save_pth(
                testing.random_state_dict("5.2", n_layer=2, n_embd=64, vocab_size=65536, head_size=16), path
            )
        return path
    path = work / f"rwkv5-{shape}.pth"
    make_checkpoint(path, "5.2", shape)
    return path


def start_server(ckpt: Path, args, log_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "rwkv_engine",
        "serve",
        str(ckpt),
        "--served-model-name",
        MODEL,
        "--port",
        "0",
        "--log-level",
        "warning",
        "--dtype",
        args.dtype,
        "--max-batch",
        str(args.streams),
        "--max-queue",
        "64",
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--shutdown-timeout",
        "5",
        *extra,
    ]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, wait_ready(proc, log_path)


class Tally:
    def __init__(self):
        self.outcomes = collections.Counter()  # what happened, expected or not
        self.errors = collections.Counter()  # what should not have happened, by kind
        self.ttft: list[float] = []
        self.tokens = 0
        self.rss: list[tuple[float, float, float]] = []  # (t, MiB, /health ms)
        self.stall_close: list[float] = []
        self.streams_end = 0.0  # when the last stream worker stopped (time.monotonic)

    def error(self, kind: str) -> None:
        self.errors[kind] += 1


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


async def stream_worker(url: str, rng: random.Random, deadline: float, tally: Tally, disconnect_rate: float):
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < deadline:
            drop = rng.random() < disconnect_rate
            body = {
                "model": MODEL,
                "prompt": prompt(rng),
                "max_tokens": rng.randint(16, 160),
                "stream": True,
                "temperature": rng.choice([0, 0.7, 1.0]),
                "top_p": 0.9,
                "logit_bias": {"0": -100},
                "stream_options": {"include_usage": True},
            }
            t0, first, events, done, finish, usage = time.perf_counter(), None, 0, False, None, None
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        tally.error(f"stream: HTTP {r.status_code}")
                        await asyncio.sleep(0.5)
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            tally.error(f"stream: error event ({chunk['error'].get('code')})")
                            continue
                        if chunk["choices"]:
                            events += 1
                            if first is None:
                                first = time.perf_counter() - t0
                            finish = chunk["choices"][0]["finish_reason"] or finish
                        usage = chunk.get("usage") or usage
                        if drop and events >= 3:
                            break
            except httpx.HTTPError as e:
                tally.error(f"stream: {type(e).__name__}")
                continue
            if first is not None:
                tally.ttft.append(first)
            if drop and not done:
                tally.outcomes["stream dropped by the client"] += 1
                tally.tokens += events
            elif done and finish in ("stop", "length") and usage:
                tally.outcomes["stream complete"] += 1
                tally.tokens += usage["completion_tokens"]
            else:
                tally.error("stream: ended without finish and [DONE]")
    tally.streams_end = max(tally.streams_end, time.monotonic())


def _bad_requests(url: str) -> list[tuple[str, bytes | dict, dict, int | None]]:
    """(label, body, headers, expected status); None = the client closes mid-body, nothing expected."""
    port = url.rsplit(":", 1)[1]
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    return [
        ("bad JSON", b'{"model": "soak", "prompt": ', {}, 400),
        ("not an object", b"[1, 2]", {}, 400),
        ("string max_tokens", {**ok, "max_tokens": "10"}, {}, 400),
        ("negative temperature", {**ok, "temperature": -1}, {}, 400),
        ("5000-digit logit_bias key", {**ok, "logit_bias": {"1" * 5000: 1}}, {}, 400),
        ("unknown model", {**ok, "model": "gpt-4o"}, {}, 404),
        ("unknown field", {**ok, "max_tokenz": 1}, {}, 400),
        ("token id outside the vocabulary", {**ok, "prompt": [1, 10**9]}, {}, 400),
        ("foreign Host", ok, {"Host": f"evil.example:{port}"}, 403),
        ("cross-site Origin", ok, {"Origin": "http://evil.example"}, 403),
        ("cut body", b"", {}, None),
        ("garbage request line", b"", {}, 400),
    ]


async def malformed_worker(url: str, rng: random.Random, deadline: float, tally: Tally):
    host, port = url.removeprefix("http://").split(":")
    cases = _bad_requests(url)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while time.monotonic() < deadline:
            label, body, headers, status = rng.choice(cases)
            try:
                if label == "cut body":
                    _, w = await asyncio.open_connection(host, int(port))
                    w.write(b'POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 300\r\n\r\n{"mo')
                    await w.drain()
                    w.close()
                    tally.outcomes["malformed: cut body"] += 1
                elif label == "garbage request line":
                    r, w = await asyncio.open_connection(host, int(port))
                    w.write(b"\x16\x03\x01 not http at all\r\n\r\n")
                    answer = await asyncio.wait_for(r.read(), 30)
                    w.close()
                    got = int(answer.split()[1]) if answer.startswith(b"HTTP/1.1 ") else None
                    tally.outcomes[f"malformed: {label}"] += 1
                    if got != status:
                        tally.error(f"malformed: {label} got {got}")
                else:
                    kw = (
                        {"content": body, "headers": {"content-type": "application/json", **headers}}
                        if isinstance(body, bytes)
                        else {"json": body, "headers": headers}
                    )
                    r = await http.post("/v1/completions", **kw)
                    tally.outcomes[f"malformed: {label}"] += 1
                    if r.status_code != status or "error" not in r.json():
                        tally.error(f"malformed: {label} got {r.status_code}")
            except (OSError, asyncio.TimeoutError, httpx.HTTPError) as e:
                tally.error(f"malformed: {label}: {type(e).__name__}")
            await asyncio.sleep(rng.uniform(0.02, 0.2))


async def stall_one(host: str, port: int, rng: random.Random, tally: Tally):
    half_body = rng.random() < 0.5
    data = (
        b'POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 200\r\n\r\n{"model"'
        if half_body
        else b"POST /v1/completions HTTP/1.1\r\nHost: local"
    )
    limit = (BODY_TIMEOUT if half_body else HEADER_TIMEOUT) + 10
    t0 = time.monotonic()
    try:
        r, w = await asyncio.open_connection(host, port)
        w.write(data)
        await w.drain()
        answer = await asyncio.wait_for(r.read(), limit)
        w.close()
    except asyncio.TimeoutError:
        tally.error("stall: still open after its timeout")
        return
    except OSError as e:
        tally.error(f"stall: {type(e).__name__}")
        return
    tally.stall_close.append(time.monotonic() - t0)
    want = b"HTTP/1.1 408" if half_body else b""
    if not answer.startswith(want) or (not half_body and answer):
        tally.error(f"stall: unexpected answer {answer[:20]!r}")
    tally.outcomes["stalled socket closed by the server"] += 1


async def stall_worker(url: str, rng: random.Random, deadline: float, tally: Tally, at_once: int):
    host, port = url.removeprefix("http://").split(":")
    running: set[asyncio.Task] = set()
    while time.monotonic() < deadline:
        while len(running) < at_once:
            running.add(asyncio.create_task(stall_one(host, int(port), rng, tally)))
        finished, running = await asyncio.wait(running, timeout=1, return_when=asyncio.FIRST_COMPLETED)
    if running:
        await asyncio.wait(running)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def monitor(url: str, pid: int, start: float, deadline: float, tally: Tally):
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while True:
            t0 = time.perf_counter()
            try:
                ok = (await http.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                tally.error("health: not 200")
            tally.rss.append((time.monotonic() - start, rss_mib(pid), 1000 * (time.perf_counter() - t0)))
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(5.0, max(0.0, deadline - time.monotonic())))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(tally: Tally, start: float, metrics_text: str, log: str, exit_code: int, args) -> None:
    seconds = tally.streams_end - start
    print(
        f"\nsoak: {args.streams} streams, {seconds / 60:.1f} min, shape {args.shape}, "
        f"disconnect rate {args.disconnect_rate}, {args.stalled} stalled sockets at a time"
    )
    print("\noutcomes:")
    for kind, n in sorted(tally.outcomes.items()):
        print(f"  {n:7d}  {kind}")
    print("\nerrors by kind:" + ("" if tally.errors else " none"))
    for kind, n in sorted(tally.errors.items()):
        print(f"  {n:7d}  {kind}")
    print(
        f"\ntime to first token: p50 {1000 * percentile(tally.ttft, 0.5):.0f} ms, "
        f"p99 {1000 * percentile(tally.ttft, 0.99):.0f} ms ({len(tally.ttft)} streams)"
    )
    print(f"aggregate: {tally.tokens} tokens in {seconds:.0f} s = {tally.tokens / seconds:.1f} tok/s")
    if tally.stall_close:
        print(
            f"stalled sockets closed after: p50 {statistics.median(tally.stall_close):.1f} s, "
            f"max {max(tally.stall_close):.1f} s"
        )
    print("\n  t (s)   RSS (MiB)   /health (ms)")
    for t, mib, ms in tally.rss:
        print(f"  {t:5.0f}   {mib:9.0f}   {ms:12.1f}")
    print("\nserver /metrics:")
    for line in metrics_text.splitlines():
        if line.startswith(("rwkv_engine_http_errors_total", "rwkv_engine_requests_total")):
            print("  " + line)
    print(f"server log: {log.count('Traceback')} tracebacks; exit status after SIGTERM: {exit_code}")


async def soak(url: str, pid: int, args) -> Tally:
    tally = Tally()
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    rng = random.Random(args.seed)
    tasks = [
        stream_worker(url, random.Random(rng.random()), deadline, tally, args.disconnect_rate)
        for _ in range(args.streams)
    ]
    tasks += [
        malformed_worker(url, random.Random(rng.random()), deadline, tally),
        stall_worker(url, random.Random(rng.random()), deadline, tally, args.stalled),
        monitor(url, pid, start, deadline, tally),
    ]
    await asyncio.gather(*tasks)
    return tally


# --- scenario: short prompts behind a long one ---------------------------------------------------


async def first_token_seconds(http: httpx.AsyncClient, body: dict) -> float:
    """Seconds from sending a streamed completion to its first text chunk; the stream is read to its end."""
    t0, first = time.perf_counter(), None
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"text":"' in line.replace(" ", ""):
                first = time.perf_counter() - t0
    return first if first is not None else float("nan")


async def fairness(url: str, args) -> None:
    rng = random.Random(args.seed)
    short = [{"model": MODEL, "prompt": prompt(rng), "max_tokens": 8, "temperature": 0} for _ in range(args.shorts)]
    long_prompt = " ".join(rng.choice(WORDS) for _ in range(args.long_words))
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=httpx.Limits(max_connections=200)) as http:
        await asyncio.gather(*(first_token_seconds(http, b) for b in short[:2]))  # warm the paths
        alone = await asyncio.gather(*(first_token_seconds(http, b) for b in short))
        long_body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 8, "temperature": 0}
        long_task = asyncio.create_task(first_token_seconds(http, long_body))
        await asyncio.sleep(1.0)
        behind = await asyncio.gather(*(first_token_seconds(http, b) for b in short))
        long_ttft = await long_task
    tokens = len(
        httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": long_prompt}, timeout=300).json()["tokens"]
    )

    def line(name, values):
        return (
            f"  {name:<28} p50 {1000 * percentile(values, 0.5):8.0f} ms   p99 {1000 * percentile(values, 0.99):8.0f} ms"
        )

    print(f"\nfairness: {args.shorts} short streamed completions, alone and 1 s after a {tokens}-token prompt")
    print(f"(shape {args.shape}, --max-batch {args.shorts + 1}, --prefill-chunk 256)")
    print(line("short prompts alone", alone))
    print(line("behind the long prompt", behind))
    print(
        f"  ratio behind / alone: p50 {percentile(behind, 0.5) / percentile(alone, 0.5):.1f}x, "
        f"p99 {percentile(behind, 0.99) / percentile(alone, 0.99):.1f}x; "
        f"the long prompt's own first token: {long_ttft:.1f} s"
    )


# --- scenario: clients that never read their answer -------------------------------------------------


async def slow_reader(host: str, port: int, ids: list[int], out: list) -> None:
    """Ask for a big answer with a tiny receive window, then stop reading; note when the server cuts it off."""
    import socket

    body = json.dumps({"model": MODEL, "prompt": [ids], "echo": True, "logprobs": 5, "max_tokens": 0, "n": 2}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    await loop.sock_sendall(sock, head + body)
    first = await loop.sock_recv(sock, 4096)
    length = int(first.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]) if b"content-length: " in first else -1
    await asyncio.sleep(20)  # not reading; then see what is left and whether the server hung up
    got, closed_at = len(first), None
    try:
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5):
            got += len(chunk)
        closed_at = time.monotonic()
    except (ConnectionResetError, BrokenPipeError):
        closed_at = time.monotonic()
    except TimeoutError:
        pass
    sock.close()
    out.append((first.split(b"\r\n", 1)[0].decode(errors="replace"), length, got, closed_at is not None))


async def slow_readers(url: str, pid: int, args) -> None:
    host, port = url.removeprefix("http://").split(":")
    rng = random.Random(args.seed)
    tally = Tally()
    rss_before = rss_mib(pid)
    peak = [rss_before]

    async def watch(stop: asyncio.Event):
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mib(pid))
            await asyncio.sleep(0.2)

    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(stop))
    deadline = time.monotonic() + 60 * args.minutes
    results: list = []
    ids = [1 + rng.randrange(60000) for _ in range(args.reader_tokens)]
    t0 = time.monotonic()
    await asyncio.gather(
        *(stream_worker(url, random.Random(rng.random()), deadline, tally, 0.0) for _ in range(args.streams)),
        *(slow_reader(host, int(port), ids, results) for _ in range(args.slow_readers)),
    )
    stop.set()
    await watcher
    await asyncio.sleep(2)
    print(f"\nslow readers: {args.slow_readers} clients that never read a big answer, beside {args.streams} streams")
    print(f"(shape {args.shape}, --write-timeout 3, {time.monotonic() - t0:.0f} s)")
    for i, (status, length, got, closed) in enumerate(results):
        print(
            f"  reader {i}: {status}, answer {length / 1e6:.1f} MB, received {got / 1e6:.1f} MB, "
            + ("cut off by the server" if closed else "STILL OPEN after 25 s")
        )
    print(
        f"  normal streams: {tally.outcomes['stream complete']} complete, errors {dict(tally.errors) or 'none'}; "
        f"time to first token p50 {1000 * percentile(tally.ttft, 0.5):.0f} ms, "
        f"p99 {1000 * percentile(tally.ttft, 0.99):.0f} ms"
    )
    print(f"  server RSS: {rss_before:.0f} MiB before, {peak[0]:.0f} MiB at most, {rss_mib(pid):.0f} MiB after")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8, help="concurrent stream workers (= --max-batch)")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--shape", choices=["tiny", *SHAPES], default="0.1B")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--disconnect-rate", type=float, default=0.2, help="share of streams the client drops")
    ap.add_argument("--stalled", type=int, default=20, help="stalled sockets held open at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rwkv-engine-bench"))
    ap.add_argument("--scenario", choices=["soak", "fairness", "slow-reader"], default="soak")
    ap.add_argument("--shorts", type=int, default=16, help="fairness: short completions at once")
    ap.add_argument("--long-words", type=int, default=14000, help="fairness: words of the long prompt")
    ap.add_argument("--slow-readers", type=int, default=4, help="slow-reader: clients that never read")
    ap.add_argument("--reader-tokens", type=int, default=6000, help="slow-reader: prompt tokens each echoes")
    args = ap.parse_args()
    if not 0 < args.minutes <= 24 * 60 or args.streams < 1:
        raise SystemExit("--minutes must be in (0, 1440] and --streams >= 1")
    args.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(args.workdir, args.shape)
    log_path = args.workdir / "soak_server.log"
    if args.scenario != "soak":
        extra = ["--write-timeout", "3"]
        if args.scenario == "fairness":
            args.streams = args.shorts + 1  # (the --max-batch start_server passes)
            extra += ["--max-prompt-tokens", str(4 * args.long_words + 64)]
        proc, url = start_server(ckpt, args, log_path, *extra)
        try:
            if args.scenario == "fairness":
                asyncio.run(fairness(url, args))
            else:
                asyncio.run(slow_readers(url, proc.pid, args))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        print(f"server log: {log_path.read_text().count('Traceback')} tracebacks")
        return
    proc, url = start_server(ckpt, args, log_path)
    try:
        start = time.monotonic()
        tally = asyncio.run(soak(url, proc.pid, args))
        metrics_text = httpx.get(url + "/metrics", timeout=30).text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = proc.wait()
    report(tally, start, metrics_text, log_path.read_text(), exit_code, args)


if __name__ == "__main__":
    main()
