"""Scale out on Ray: engine replicas behind one OpenAI endpoint (Ray Serve), batch inference on Ray Data.

    rwkv-engine serve MODEL --ray --replicas 2                  # a local Ray instance
    rwkv-engine serve MODEL --ray --ray-address auto --host 0.0.0.0 --api-key-file KEY --replicas 8
    rwkv-engine batch MODEL in.jsonl out.jsonl --ray --workers 4

    from ray import serve
    from rwkv_engine.serve.ray import build_app
    from rwkv_engine.settings import Config, EngineConfig, ModelSpec
    serve.run(build_app(Config(ModelSpec("out-q8"), EngineConfig(max_batch=8)), replicas=2), route_prefix="/")

Serving: HTTP -> Ray Serve's proxy -> `Ingress` (one replica) -> `EngineReplica` x N.

* `EngineReplica` loads the model and runs the engine and the very FastAPI app of
  `rwkv-engine serve` (`serve.server.build`, from the same settings): every endpoint, flag, error
  and metric is the single-process server's. The ingress forwards each HTTP request as it came
  (method, path, headers, body); the replica runs it through that app in-process (an ASGI call)
  and streams the response back chunk by chunk, server-sent events included.
* Routing (`PrefixAffinityRouter`, a Ray Serve request router, running in the ingress): a
  completion or chat request whose prompt holds at least one prefill chunk (--prefill-chunk
  tokens; a chat's prompt as the replicas' chat template renders it, which the ingress asks a
  replica for once) is keyed by the token ids of that first chunk, the granularity of the replicas'
  prompt-state caches. Keys sit on a consistent-hash ring of the replicas (64 points each), so
  requests that share a system prompt or a conversation go to the same replica and its cache
  hits. A rerank request is keyed by its documents (their texts as a set): the replicas cache
  each document's prefix state, so the same documents under another query (in any order) go
  where their states are. Embeddings have no key (any replica reads them as fast). The owner is
  passed over while its queue is more than `spill` (default --max-batch) requests longer than
  the shortest one; then, and for requests without a key, the replica with the shortest queue
  takes the request.
* `/metrics` on the endpoint: every replica's metrics summed sample by sample (replicas push
  theirs to a small collector actor every second, under their Serve application's name, so two
  applications on one cluster, say a chat model and an embedder, each sum their own), each
  replica's prompt-cache hits and misses under
  `rwkv_engine_replica_prompt_cache_{hits,misses}_total{replica=...}`, and the router's
  decisions, `rwkv_engine_route_total{route="affinity"|"spill"|"least_loaded", replica=...}`.
* Faults: Ray Serve replaces a replica that dies (or whose engine stopped: `check_health`). A
  request that had received nothing yet is retried once on another replica; one cut in the middle
  ends with an error (an SSE error event and `data: [DONE]` when streaming). On shutdown each
  replica drains its requests for up to --shutdown-timeout seconds.
* Weights: replicas on one node that load the same converted directory (`rwkv-engine convert`)
  map the same file, so the page cache holds one copy of the weights; a `.pth` is read and
  transformed by each replica into memory of its own.

Batch (`batch_on_ray`): Ray Data spreads the lines of the input over `--workers` actors, each
loading the model once and answering its blocks through the same in-process app as the local
`rwkv-engine batch`; answers come back in input order and are written as they arrive.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import signal
import socket
import sys
import threading
import time
import uuid
from array import array
from collections import defaultdict
from dataclasses import replace

from ..errors import InputError
from ..settings import Config
from ..templates import ChatTemplate, builtin
from . import protocol as p
from .launch import print_banner, url
from .server import build

try:
    import ray
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise InputError(f'--ray needs Ray Serve: pip install "rwkv-engine[ray]" (could not import ray: {e})') from None

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
RERANK = ("/v1/rerank", "/rerank")
RING_POINTS = 64  # points per replica on the hash ring
PUSH_SECONDS = 1.0  # how often a replica publishes its metrics
METRICS_ACTOR = "rwkv_engine_metrics"
PREFIX = "rwkv_engine_"


# --- routing key ---------------------------------------------------------------------------------


def routing_key(path: str, body: bytes, tokenizer, chunk: int, template=None, think: bool = False) -> str | None:
    """A hash of the first `chunk` prompt token ids of a completion or chat request, or None when
    the prompt is shorter (no cache entry can help it) or the body is not a valid request. A chat
    is rendered as the replicas render it: by their chat template (`template`, a
    templates.ChatTemplate; None: the built-in World one) with their thinking default `think`.
    A rerank request is keyed by its documents (`rerank_key`; no tokenizer needed)."""
    if path not in (COMPLETIONS, CHAT, *RERANK):
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if path in RERANK:
        return rerank_key(obj)
    # Enough characters for `chunk` tokens (a World token is at most a few dozen bytes of text).
    head = chunk * 32
    try:
        if path == CHAT:
            req = p.ChatCompletionRequest.model_validate(obj)
            tools = req.tools if req.tool_mode != "none" else None
            prompt = req.render(template or builtin("world"), req.messages, tools, True, think)
            ids = tokenizer.encode(prompt[:head])
        else:
            prompt = obj.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a list of prompts: key by the first
            if isinstance(prompt, str):
                ids = tokenizer.encode(prompt[:head])
            elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = prompt
            else:
                return None
    except Exception:  # an invalid request: the replica answers it with the server's own error
        return None
    if len(ids) < chunk:
        return None
    return hashlib.sha1(array("q", ids[:chunk]).tobytes()).hexdigest()


def rerank_key(obj: dict) -> str | None:
    """A hash of a rerank request's documents as a set (their texts sorted), or None when the
    request is not valid."""
    try:
        texts = p.RerankRequest.model_validate(obj).texts
    except Exception:  # the replica answers it with the server's own error
        return None
    digest = hashlib.sha1()
    for text in sorted(texts):
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


# --- the request router (runs in the ingress process) --------------------------------------------

# The router lives in the ingress's process: it notes its decision for a request under the token
# the ingress passes (args[1]); the ingress counts (decision, replica) once the replica answers.
DECISIONS: dict[str, str] = {}
ROUTES: dict[tuple[str, str], int] = defaultdict(int)


class PrefixAffinityRouter(RequestRouter):
    """Consistent hashing of the routing key (args[0]) with a load bound; see the module docstring.
    args[1] is the ingress's token for the request, under which the decision is noted."""

    def initialize_state(self, spill: int = 8, points: int = RING_POINTS):
        from rwkv_engine.serve import ray as module  # see Ingress.__init__

        self.spill, self.points, self.decisions = spill, points, module.DECISIONS
        self._ring_ids: tuple[str, ...] = ()
        self._hashes: list[int] = []
        self._owners: list[str] = []

    def _owner(self, key: str, replicas: list[RunningReplica]) -> RunningReplica:
        ids = tuple(sorted(r.replica_id.unique_id for r in replicas))
        if ids != self._ring_ids:
            points = sorted((_hash(f"{rid}#{v}"), rid) for rid in ids for v in range(self.points))
            self._ring_ids, self._hashes, self._owners = ids, [h for h, _ in points], [rid for _, rid in points]
        i = bisect.bisect(self._hashes, int(key[:16], 16)) % len(self._hashes)
        return next(r for r in replicas if r.replica_id.unique_id == self._owners[i])

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict:
        lens = {}
        missing = []
        for r in replicas:
            q = self.replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None:
                missing.append(r)
            else:
                lens[r.replica_id] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                if q is not None:
                    lens[r.replica_id] = q
        return lens

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        args = pending_request.args if pending_request is not None else ()
        key, token = (args[0], args[1]) if len(args) >= 2 else (None, None)
        if key is None or len(candidate_replicas) == 1:
            route, ranks = "least_loaded", [candidate_replicas]
        else:
            owner = self._owner(key, candidate_replicas)
            others = [r for r in candidate_replicas if r is not owner]
            lens = await self._queue_lens(candidate_replicas)
            shortest = min(lens.values(), default=0)
            if lens.get(owner.replica_id, 0) <= shortest + self.spill:
                route, ranks = "affinity", [[owner], others]
            else:
                route, ranks = "spill", [others]
        if token is not None:
            self.decisions[token] = route  # a later call for the same request (a retry) overwrites it
        return ranks


def _hash(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest()[:16], 16)


# --- metrics: replicas publish, the ingress sums -------------------------------------------------


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest metrics text of every replica, by Serve application (entries older than a
    minute are dropped)."""

    def __init__(self):
        self.texts: dict[tuple[str, str], tuple[float, str]] = {}

    def put(self, app: str, replica: str, text: str) -> None:
        self.texts[(app, replica)] = (time.monotonic(), text)

    def get(self, app: str) -> dict[str, str]:
        """replica -> its latest text, for the replicas of application `app`."""
        now = time.monotonic()
        self.texts = {k: v for k, v in self.texts.items() if now - v[0] < 60}
        return {replica: text for (a, replica), (_, text) in self.texts.items() if a == app}


def merge_metrics(texts: dict[str, str], routes: dict[tuple[str, str], int]) -> str:
    """Prometheus texts of the replicas summed sample by sample (same name and labels), plus each
    replica's prompt-cache hits and misses, and the router's decisions ((route, replica) -> count)."""
    meta: dict[str, list[str]] = {}
    sums: dict[str, dict[str, float]] = {}
    per_replica = {"prompt_cache_hits_total": {}, "prompt_cache_misses_total": {}}
    for replica, text in sorted(texts.items()):
        name = None
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3:
                    meta.setdefault(parts[2], [])
                    if len(meta[parts[2]]) < 2:
                        meta[parts[2]].append(line)
                continue
            if not line.strip():
                continue
            sample, _, value = line.rpartition(" ")
            name = sample.split("{", 1)[0]
            sums.setdefault(name, {})
            sums[name][sample] = sums[name].get(sample, 0.0) + float(value)
            short = name[len(PREFIX) :]
            if short in per_replica and "{" not in sample:
                per_replica[short][replica] = float(value)
    lines = []
    for name, samples in sums.items():
        lines += meta.get(name, [])
        lines += [f"{s} {_num(v)}" for s, v in samples.items()]
    for short, values in per_replica.items():
        full = f"{PREFIX}replica_{short}"
        lines += [
            f"# HELP {full} {short.replace('_', ' ')} of each replica (its prompt-state cache).",
            f"# TYPE {full} counter",
        ]
        lines += [f'{full}{{replica="{r}"}} {_num(v)}' for r, v in sorted(values.items())]
    full = f"{PREFIX}route_total"
    lines += [
        f"# HELP {full} Requests routed, by decision (affinity: the prefix's replica; spill: it was "
        "too busy; least_loaded: no prefix key) and replica.",
        f"# TYPE {full} counter",
    ]
    lines += [f'{full}{{replica="{r}",route="{route}"}} {n}' for (route, r), n in sorted(routes.items())]
    lines += [
        f"# HELP {PREFIX}replicas Replicas whose metrics are current.",
        f"# TYPE {PREFIX}replicas gauge",
        f"{PREFIX}replicas {len(texts)}",
    ]
    return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


# --- the deployments -----------------------------------------------------------------------------


def share_mapped_weights(config: Config) -> Config:
    """The config a replica or worker loads: a converted directory's weights stay in its file
    mapping, which the replicas on one machine share through the page cache, rather than each
    taking a private copy on huge pages (rwkv_engine/memory.py); the user's setting wins."""
    if config.model.huge_pages is not None:
        return config
    return replace(config, model=replace(config.model, huge_pages="private"))


class EngineReplica:
    """One engine and the server's app; answers forwarded HTTP requests through that app."""

    def __init__(self, config: Config, board):
        self.engine, self.app = build(share_mapped_weights(config), progress=False)
        self.template = config.chat.resolve(self.engine.model, config.model.model)  # (as build's)
        self.engine.start()
        context = serve.get_replica_context()
        self.replica, self.app_name = context.replica_id.unique_id, context.app_name
        self.board = board
        self._stop = threading.Event()
        threading.Thread(target=self._publish, name="metrics-push", daemon=True).start()

    def _publish(self) -> None:
        while not self._stop.wait(PUSH_SECONDS):
            try:
                text = self.engine.metrics.render(self.engine.gauges)
                self.board.put.remote(self.app_name, self.replica, text)
            except Exception:  # the collector is gone: the deployment is shutting down
                return

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine thread stopped")

    def replica_id(self) -> str:
        return self.replica

    def chat_template(self) -> tuple[str, str, str]:
        """(name, Jinja text, source) of the chat template this replica renders chats with."""
        t = self.template
        return t.name, t.text, t.source

    def tokenizer(self):
        """The tokenizer this replica loaded (the ingress keys prompts with it)."""
        return self.engine.tokenizer

    async def handle_http(self, key: str | None, token: str, request: dict):
        """Run one HTTP request through the app: yields {"status", "headers", "replica"}, then body
        chunks. `key` and `token` are for the router (see PrefixAffinityRouter)."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "scheme": "http",
            "method": request["method"],
            "path": request["path"],
            "raw_path": request["path"].encode(),
            "query_string": request["query"],
            "headers": request["headers"],
            "root_path": "",
            "client": tuple(request["client"]) if request.get("client") else None,
            "server": ("ray", 0),
        }
        out: asyncio.Queue = asyncio.Queue()
        delivered = False
        gone = asyncio.Event()

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await out.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while (message := await out.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {
                        "status": message["status"],
                        "replica": self.replica,
                        "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])],
                    }
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:
            gone.set()  # a client that went away cancels its request in the engine
            try:
                await asyncio.wait_for(asyncio.shield(task), 10)
            except Exception:
                task.cancel()

    def __del__(self):
        self._stop.set()
        self.engine.stop()


class Ingress:
    """Receives every HTTP request, keys it for routing and forwards it to a replica."""

    def __init__(self, replicas, config: Config, board):
        self.replicas, self._ask = replicas.options(stream=True), replicas
        # The replicas' tokenizer and chat template, asked for at the first request that needs
        # them: only the loaded model tells which tokenizer fits it (an EmbeddingRWKV
        # checkpoint's path does not), and the ingress need not load anything itself.
        self.tokenizer = None
        self.template = None
        self.think = config.chat.think
        self.chunk = config.engine.prefill_chunk
        self.app_name = serve.get_replica_context().app_name
        self.board = board
        # Ray Serve ships this class and the router's by value, each with copies of the module's
        # globals: both reach the one DECISIONS of this process through the module itself.
        from rwkv_engine.serve import ray as module

        self.decisions, self.routes = module.DECISIONS, module.ROUTES

    async def __call__(self, request):
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

        body = await request.body()
        path = app_path(request.scope)
        if path == "/metrics" and request.method == "GET":
            texts = await self.board.get.remote(self.app_name)
            return PlainTextResponse(
                merge_metrics(texts, self.routes), media_type="text/plain; version=0.0.4; charset=utf-8"
            )
        if path in (COMPLETIONS, CHAT) and self.tokenizer is None:
            self.tokenizer = await self._ask.tokenizer.remote()
        if path == CHAT and self.template is None:
            self.template = ChatTemplate(*await self._ask.chat_template.remote())
        key = (
            routing_key(path, body, self.tokenizer, self.chunk, self.template, self.think)
            if request.method == "POST"
            else None
        )
        forwarded = {
            "method": request.method,
            "path": path,
            "query": request.url.query.encode("latin-1"),
            "headers": [(k, v) for k, v in request.headers.raw],
            "body": body,
            "client": (request.client.host, request.client.port) if request.client else None,
        }
        for attempt in range(2):
            token = uuid.uuid4().hex
            stream = self.replicas.handle_http.remote(key, token, forwarded)
            try:
                head = await stream.__anext__()
                self.routes[(self.decisions.pop(token, "least_loaded"), head["replica"])] += 1
                break
            except (RayError, StopAsyncIteration) as e:
                self.decisions.pop(token, None)
                if attempt == 1:
                    body = p.error_body(503, f"no replica could answer: {type(e).__name__}")
                    return JSONResponse(body.model_dump(), status_code=503)
        headers = {k: v for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_rest(stream, sse), status_code=head["status"], headers=headers)


def app_path(scope: dict) -> str:
    """The request's path inside the application, which the replicas' app serves at "/": the
    path less the `root_path` Ray Serve sets to the application's route prefix."""
    path, root = scope["path"], scope.get("root_path", "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :] or "/"
    return path


async def _rest(stream, sse: bool):
    try:
        async for chunk in stream:
            yield chunk
    except RayError as e:
        if sse:
            error = p.error_body(502, f"the replica answering this request failed ({type(e).__name__})")
            yield f"data: {json.dumps(error.model_dump())}\n\ndata: [DONE]\n\n".encode()
    finally:
        stream.cancel()


# --- building and running ------------------------------------------------------------------------


def replica_options(cpus: float) -> dict:
    """An engine replica's Ray actor options: its CPUs, and libgomp's spin in its environment
    (rwkv_engine/threads.py: a replica does not start through the `rwkv-engine` command, which
    sets it, and libgomp reads it only when torch loads)."""
    from ..threads import openmp_env

    env = openmp_env()
    return {"num_cpus": cpus, "runtime_env": {"env_vars": env}} if env else {"num_cpus": cpus}


def build_app(config: Config, replicas: int = 2, replica_cpus: float = 1.0, board=None):
    """The Ray Serve application: `replicas` engine replicas, each reserving `replica_cpus` CPUs,
    behind one ingress; each replica builds the server of `config` (its API key included)."""
    if board is None:
        board = MetricsBoard.options(name=METRICS_ACTOR, get_if_exists=True).remote()
    max_batch = config.engine.max_batch
    replica = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=replicas,
        ray_actor_options=replica_options(replica_cpus),
        max_ongoing_requests=max_batch + config.engine.max_queue,
        graceful_shutdown_timeout_s=config.server.shutdown_timeout,
        graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2,
        health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs={"spill": max_batch}
        ),
    )
    ingress = serve.deployment(
        Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000
    )
    return ingress.bind(replica.bind(config, board), config, board)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (Ray Serve's proxy needs a number, not 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_ray(address: str | None) -> bool:
    """Join `address`, or start a local Ray instance on loopback (no dashboard). False when this
    process was connected to Ray already (then it is not ours to shut down)."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    return True


def run_cli(config: Config, replicas: int = 2, replica_cpus: float = 1.0, address: str | None = None) -> int:
    """`rwkv-engine serve --ray`: deploy, print the address, serve until SIGTERM / Ctrl-C, drain."""
    server = config.server
    started = start_ray(address)
    port = server.port or free_port(server.host)
    serve.start(http_options={"host": server.host, "port": port})
    serve.run(build_app(config, replicas, replica_cpus), name="rwkv-engine", route_prefix="/")
    print_banner(
        config.model_name,
        url(server.host, port),
        f"Ray Serve, {replicas} replicas, max batch {config.engine.max_batch} each",
        server.host,
        server.api_key,
        chat_page=False,
    )
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        serve.shutdown()
        if started:
            ray.shutdown()
    print("rwkv-engine serve: stopped", file=sys.stderr, flush=True)
    return 0


# --- batch inference on Ray Data -----------------------------------------------------------------


class BatchWorker:
    """A Ray Data actor: loads the model once, answers blocks of lines through the server's app."""

    def __init__(self, config: Config, concurrency: int):
        from ..batch import AppClient

        self.engine, app = build(share_mapped_weights(config), progress=False)
        self.engine.start()
        self.client = AppClient(app, config.model_name)
        self.concurrency = concurrency

    def __call__(self, block: dict) -> dict:
        from ..batch import Line

        lines = [Line(int(n), str(t)) for n, t in zip(block["number"], block["text"])]
        answers = self.client.run(lines, self.concurrency)
        return {"number": [a["line"] for a in answers], "answer": [json.dumps(a, ensure_ascii=False) for a in answers]}


def batch_on_ray(
    config: Config,
    lines,
    write,
    workers: int = 2,
    worker_cpus: float = 1.0,
    concurrency: int | None = None,
    address: str | None = None,
) -> None:
    """Answer `lines` on Ray Data with `workers` actors, each reserving `worker_cpus` CPUs and
    keeping `concurrency` requests in flight (default: twice the batch); `write` gets the answers
    in order. address: a Ray cluster to join (default: start a local one)."""
    started = start_ray(address)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    per_block = max(1, 2 * config.engine.max_batch)
    ds = ray.data.from_items(
        [{"number": line.number, "text": line.text} for line in lines],
        override_num_blocks=max(1, -(-len(lines) // per_block)),
    )
    ds = ds.map_batches(
        BatchWorker,
        fn_constructor_args=(config, concurrency or 2 * config.engine.max_batch),
        batch_size=per_block,
        compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=worker_cpus,
    )
    try:
        for row in ds.iter_rows():
            write(json.loads(row["answer"]))
    finally:
        if started:
            ray.shutdown()
