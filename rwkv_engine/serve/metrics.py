"""Server metrics: counters updated by the engine and the router, rendered in the Prometheus text format.

Every metric is declared once in `METRICS` (name, type, help). Counters only grow; gauges are
read at scrape time from a callback. `generation_tokens_per_second` is the number of tokens
generated over the last `window` seconds divided by the window (shorter while the server is younger).
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping

PREFIX = "rwkv_engine_"

# name -> (type, help)
METRICS: dict[str, tuple[str, str]] = {
    "requests_running": ("gauge", "Batch rows decoding (one per choice of a request), and prompts being read."),
    "requests_waiting": ("gauge", "Requests queued, and requests whose prompt is read waiting for a batch row."),
    "requests_total": (
        "counter",
        "Requests the engine finished, by outcome (stop, length, cancelled, error); each choice counts.",
    ),
    "http_errors_total": ("counter", "Requests answered with an error status, by status code."),
    "prompt_tokens_total": ("counter", "Prompt tokens of admitted requests."),
    "prefill_tokens_total": ("counter", "Prompt tokens run through the model (prompt tokens minus cache hits)."),
    "prefill_pieces_total": (
        "counter",
        "Prefill pieces run (a model forward each); prefill_tokens_total / this is the mean piece length.",
    ),
    "generation_tokens_total": ("counter", "Tokens generated."),
    "generation_tokens_per_second": ("gauge", "Tokens generated per second over the last window."),
    "decode_steps_total": ("counter", "Batched decode steps (one model forward each)."),
    "decode_rows_total": ("counter", "Sequences decoded, summed over decode steps (rows / steps = mean batch size)."),
    "engine_seconds_total": (
        "counter",
        "Seconds of the engine thread's work, by phase: prefill (prompt chunks and "
        "first tokens), forward (decode steps' model forward), sample (decode steps' "
        "sampling), stream (detokenizing, stop strings, handing text to the server).",
    ),
    "prefill_beside_seconds_total": (
        "counter",
        "Seconds the prefill thread spent reading prompt pieces beside the decode steps "
        "(--prefill-threads; not a part of engine_seconds_total, whose thread decodes meanwhile).",
    ),
    "prompt_cache_hits_total": ("counter", "Prompts that resumed from a cached prefix state."),
    "prompt_cache_misses_total": ("counter", "Prompts with no cached prefix state."),
    "prompt_cache_hit_tokens_total": ("counter", "Prompt tokens skipped thanks to the prompt-state cache."),
    "prompt_cache_entries": ("gauge", "States in the prompt-state cache."),
    "prompt_cache_bytes": ("gauge", "Bytes held by the prompt-state cache."),
    "prompt_cache_capacity_bytes": ("gauge", "Capacity of the prompt-state cache (--state-cache-mb)."),
    "state_store_hits_total": ("counter", "Prompt-cache states read from the --state-store directory."),
    "state_store_writes_total": ("counter", "Prompt-cache states written to the --state-store directory."),
    "state_store_skipped_total": (
        "counter",
        "State files skipped when read (corrupt, truncated, of another model or prompt): never served.",
    ),
    "state_store_dropped_total": ("counter", "States not written because the writer was too far behind."),
    "state_store_evicted_total": ("counter", "State files deleted, least recently used first, to stay in capacity."),
    "state_store_bytes": ("gauge", "Bytes of state files in the --state-store directory (as this server counts)."),
    "state_store_capacity_bytes": ("gauge", "Capacity of the --state-store directory (--state-store-mb)."),
    "embedding_requests_total": (
        "counter",
        "/v1/embeddings requests, by outcome: ok, rejected (answered 4xx: a bad request or a full queue), "
        "cancelled (the client left), error (5xx).",
    ),
    "embedding_inputs_total": ("counter", "Inputs embedded (by requests answered ok)."),
    "embedding_tokens_total": ("counter", "Tokens of the inputs embedded (their usage.prompt_tokens)."),
    "rerank_requests_total": (
        "counter",
        "/v1/rerank and /rerank requests, by outcome: ok, rejected (answered 4xx: a bad request or a "
        "full queue), cancelled (the client left), error (5xx).",
    ),
    "rerank_documents_total": ("counter", "Documents scored (by rerank requests answered ok)."),
    "rerank_tokens_total": (
        "counter",
        "Tokens of the documents and queries scored (their usage.prompt_tokens, cached ones included).",
    ),
    "rerank_cache_hits_total": ("counter", "Reranked documents whose prefix state came from the prompt cache."),
    "rerank_cache_misses_total": ("counter", "Reranked documents whose prefix was read (then cached)."),
    "embedding_seconds_total": (
        "counter",
        "Seconds of the engine thread's work reading embedding and rerank inputs (a part of "
        'engine_seconds_total{phase="prefill"}).',
    ),
    "max_batch": ("gauge", "Most sequences decoded together (--max-batch)."),
    "prefill_budget_tokens": (
        "gauge",
        "Prompt tokens the last turn with prefill work could read: --prefill-chunk, or while streams "
        "decode about --prefill-share decode steps' time worth.",
    ),
    "speculative_passes_total": ("counter", "Verify passes of speculating sequences (one per row and step)."),
    "speculative_drafted_tokens_total": ("counter", "Draft tokens proposed to verify passes."),
    "speculative_accepted_tokens_total": ("counter", "Draft tokens the verify passes accepted."),
    "speculative_emitted_tokens_total": ("counter", "Tokens decided by verify passes (accepted + one per pass)."),
    "speculative_acceptance_rate": ("gauge", "Accepted / drafted tokens since the start."),
    "speculative_tokens_per_pass": ("gauge", "Tokens decided per verify pass since the start."),
}


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, int) or (math.isfinite(v) and float(v).is_integer()):
        return str(int(v))
    return repr(float(v))


class Metrics:
    """Thread-safe counters plus a sliding window of generated tokens."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple], float] = defaultdict(float)
        self._generated: deque[tuple[float, int]] = deque()
        self._start = time.monotonic()

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        if name not in METRICS or METRICS[name][0] != "counter":
            raise KeyError(f"not a declared counter: {name}")
        with self._lock:
            self._counters[(name, tuple(sorted(labels.items())))] += value

    def get(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def generated(self, n: int) -> None:
        """Record n generated tokens (counter and rate window)."""
        now = time.monotonic()
        with self._lock:
            self._counters[("generation_tokens_total", ())] += n
            self._generated.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._generated and self._generated[0][0] < now - self.window:
            self._generated.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            total = sum(n for _, n in self._generated)
        span = min(self.window, now - self._start)
        return total / span if span > 0 else 0.0

    def render(self, gauges: Callable[[], Mapping[str, float]] | None = None) -> str:
        """The Prometheus text exposition (format 0.0.4) of every declared metric."""
        values = dict(gauges() if gauges else {})
        values["generation_tokens_per_second"] = self.tokens_per_second()
        with self._lock:
            counters = dict(self._counters)
        lines = []
        for name, (kind, help_text) in METRICS.items():
            full = PREFIX + name
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
            if kind == "gauge":
                lines.append(f"{full} {_number(values.get(name, 0))}")
                continue
            samples = sorted((labels, v) for (n, labels), v in counters.items() if n == name)
            if not samples:
                samples = [((), 0)]
            for labels, v in samples:
                lines.append(f"{full}{_labels(dict(labels))} {_number(v)}")
        return "\n".join(lines) + "\n"
