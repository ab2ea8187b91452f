"""Prometheus metrics, named like SGLang's (docs/scheduler.md#logs-and-metrics) with the `stepwise:` prefix.

Labelled by worker. The core sets the scheduler's figures; its frontends observe what clients see
(time to first token, inter-token latency, end-to-end latency). With `--metrics-port`, every process
of a control plane writes to one directory (prometheus_client's multiprocess mode, set up by
`stepwise control`) and the core serves the sum over HTTP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, start_http_server

REGISTRY = CollectorRegistry()
_W = ("worker",)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


def _gauge(name: str, doc: str) -> Gauge:
    # Only the core sets gauges: in multiprocess mode the served value is its latest.
    return Gauge(f"stepwise:{name}", doc, _W, registry=REGISTRY, multiprocess_mode="mostrecent")


def _counter(name: str, doc: str) -> Counter:
    return Counter(f"stepwise:{name}", doc, _W, registry=REGISTRY)


def _histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
    return Histogram(f"stepwise:{name}", doc, _W, buckets=buckets, registry=REGISTRY)


NUM_RUNNING_REQS = _gauge("num_running_reqs", "Requests in the running (decode) batch")
NUM_QUEUE_REQS = _gauge("num_queue_reqs", "Requests waiting to be admitted")
NUM_USED_TOKENS = _gauge("num_used_tokens", "KV slots in use: capacity - (available + evictable)")
TOKEN_USAGE = _gauge("token_usage", "num_used_tokens / capacity")
KV_AVAILABLE = _gauge("kv_available_tokens", "Free KV slots")
KV_EVICTABLE = _gauge("kv_evictable_tokens", "KV slots held by unlocked prefix-cache nodes")
KV_USED = _gauge("kv_used_tokens", "KV slots held by requests or locked cache nodes")
NEW_TOKEN_RATIO = _gauge("new_token_ratio", "Share of remaining max_new_tokens reserved at admission")
CACHE_HIT_RATE = _gauge("cache_hit_rate", "Cached / (cached + computed) prompt tokens of the last prefill")
GEN_THROUGHPUT = _gauge("gen_throughput", "Decode tokens per second at the last decode log")
NUM_RETRACTED_REQS = _gauge("num_retracted_reqs", "Requests retracted by the last retraction")
RETRACTED_REQUESTS = _counter("num_retracted_requests", "Requests retracted")
RETRACTED_INPUT_TOKENS = _counter("num_retracted_input_tokens", "Prompt tokens of retracted requests")
RETRACTED_OUTPUT_TOKENS = _counter("num_retracted_output_tokens", "Generated tokens of retracted requests")
SLO_TPOT_AT_RISK = _counter(
    "slo_tpot_at_risk_requests", "Running requests whose predicted step time exceeds their TPOT objective"
)
PROMPT_TOKENS = _counter("prompt_tokens", "Prompt tokens computed by prefills")
CACHED_TOKENS = _counter("cached_tokens", "Prompt tokens served from the prefix cache")
GENERATION_TOKENS = _counter("generation_tokens", "Tokens generated")
KV_BOOK_MISMATCHES = _counter("kv_book_mismatch", "Steps where a worker's KV report disagreed with the books")
REQUESTS_FINISHED = Counter(
    "stepwise:requests_finished", "Finished requests by reason", ("worker", "reason"), registry=REGISTRY
)
ROUTING_DECISIONS = Counter(
    "stepwise:routing_decisions",
    "Requests routed, by how the worker was chosen: key (routing-key affinity), cache (longest cached "
    "prefix), load (least loaded: no cache helped or cache-aware routing is off), balance (imbalanced)",
    ("how",),
    registry=REGISTRY,
)
# Constrained decoding (control_plane/frontend/grammars.py): the frontends' compiles.
GRAMMAR_COMPILES = Counter(
    "stepwise:grammar_compiles",
    "Grammar compiles of constrained requests, by outcome: ok, invalid (refused), timeout (refused "
    "past --grammar-compile-timeout); a cache hit compiles nothing",
    ("outcome",),
    registry=REGISTRY,
)
GRAMMAR_CACHE_HITS = Counter(
    "stepwise:grammar_cache_hits",
    "Constrained requests whose grammar's outcome was cached",
    registry=REGISTRY,
)
GRAMMAR_COMPILE_TIME = Histogram(
    "stepwise:grammar_compile_seconds",
    "Seconds a grammar took to compile (its thread's time, whether or not its call still waited)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
    registry=REGISTRY,
)
QUEUE_TIME = _histogram("queue_time_seconds", "Arrival to first admission", _LATENCY_BUCKETS)
TTFT = _histogram("time_to_first_token_seconds", "Arrival to first output token", _LATENCY_BUCKETS)
ITL = _histogram(
    "inter_token_latency_seconds", "Time between a request's client messages, per token", _ITL_BUCKETS
)
# Coalescing (docs/protocols.md#streaming): --stream-interval tokens a message, more when a frontend
# is behind and a stream's handler sends everything that arrived since its last message at once.
TOKENS_PER_MESSAGE = Histogram(
    "stepwise:tokens_per_message",
    "Output tokens per client message after a sample's first",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
    registry=REGISTRY,
)
E2E_LATENCY = _histogram("e2e_request_latency_seconds", "Arrival to finish", _LATENCY_BUCKETS)
WORKER_WAIT = _histogram(
    "worker_wait_seconds", "Time a worker waited for its next plan after finishing a step", _ITL_BUCKETS
)

# Live migration (docs/migration.md): by the source worker, the stall by the destination.
MIGRATIONS = Counter(
    "stepwise:migrations",
    "Requests migrated off a worker, by reason (drain; kv: before a retraction; balance: a queue "
    "beside another worker's free KV; pd: prefill to decode worker; test) and outcome: ok (continued on the "
    "destination from the moved KV), called_off (the pre-copy failed, or the request or the "
    "destination went meanwhile: it stayed; counted per call), fallback (the tail failed or the "
    "destination left: continued here or recomputed elsewhere), lost (the source was lost mid-copy: "
    "recomputed elsewhere)",
    ("worker", "reason", "outcome"),
    registry=REGISTRY,
)
MIGRATED_TOKENS = _counter("migrated_tokens", "Tokens whose KV a migration sent to another worker")
MIGRATION_BYTES = _counter("migration_bytes", "Bytes of KV migrations sent to other workers")
MIGRATION_COPY_SECONDS = _histogram(
    "migration_copy_seconds",
    "A migration's switch to the first word (the destination's or the source's) that the tail arrived",
    _ITL_BUCKETS,
)
MIGRATION_ARRIVALS = Counter(
    "stepwise:migration_arrivals",
    "Migration copies (pre-copies and tails) that arrived, by source worker and by whose word came "
    "first: receiver (the destination worker's report, as soon as it held the bytes) or sender (with "
    "the source worker's next step result)",
    ("worker", "reported_by"),
    registry=REGISTRY,
)
MIGRATION_STALL_SECONDS = _histogram(
    "migration_stall_seconds",
    "A migration's switch to the request's first token on its destination (the client's gap)",
    _ITL_BUCKETS,
)


def register_worker(worker: str) -> None:
    """Create every series of a new worker at zero, so dashboards see them before the first event."""
    for metric in (
        RETRACTED_REQUESTS,
        RETRACTED_INPUT_TOKENS,
        RETRACTED_OUTPUT_TOKENS,
        SLO_TPOT_AT_RISK,
        PROMPT_TOKENS,
        CACHED_TOKENS,
        GENERATION_TOKENS,
        KV_BOOK_MISMATCHES,
        NUM_RETRACTED_REQS,
        MIGRATED_TOKENS,
        MIGRATION_BYTES,
    ):
        metric.labels(worker)


def serve(port: int, host: str) -> None:
    """Expose /metrics over HTTP on a background thread (port 0: not served)."""
    if not port:
        return
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        start_http_server(port, addr=host, registry=merged)
        return
    start_http_server(port, addr=host, registry=REGISTRY)


@dataclass(frozen=True, slots=True)
class PoolFigures:
    running: int
    queued: int
    available: int
    evictable: int
    capacity: int
    new_token_ratio: float


class WorkerMetrics:
    """One worker's series, looked up once: a step sets a dozen figures, and a label lookup costs
    about as much as the observation itself (the hot path is per step, not per token)."""

    def __init__(self, worker: str) -> None:
        self.running = NUM_RUNNING_REQS.labels(worker)
        self.queued = NUM_QUEUE_REQS.labels(worker)
        self.used = NUM_USED_TOKENS.labels(worker)
        self.usage = TOKEN_USAGE.labels(worker)
        self.available = KV_AVAILABLE.labels(worker)
        self.evictable = KV_EVICTABLE.labels(worker)
        self.kv_used = KV_USED.labels(worker)
        self.ratio = NEW_TOKEN_RATIO.labels(worker)
        self.hit_rate = CACHE_HIT_RATE.labels(worker)
        self.retracted_now = NUM_RETRACTED_REQS.labels(worker)
        self.generation_tokens = GENERATION_TOKENS.labels(worker)
        self.worker_wait = WORKER_WAIT.labels(worker)
        self.queue_time = QUEUE_TIME.labels(worker)

    def record_pool(self, f: PoolFigures) -> None:
        used = f.capacity - (f.available + f.evictable)
        self.running.set(f.running)
        self.queued.set(f.queued)
        self.used.set(used)
        self.usage.set(used / f.capacity if f.capacity else 0.0)
        self.available.set(f.available)
        self.evictable.set(f.evictable)
        self.kv_used.set(used)
        self.ratio.set(f.new_token_ratio)
