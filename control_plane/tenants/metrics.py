"""Per-tenant Prometheus series (docs/deploy.md#tenant-metrics), labelled by tenant.

The label is bounded: a tenant of the table (the first `max_metric_tenants` by name) is its own
label, every other tenant (an unbound key, a name a client made up) counts under "other". So the
series are at most the cap plus one whatever the clients send, and a tenant's series is a proper
counter (it never moves between labels while the table stands).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from control_plane.metrics import REGISTRY

_T = ("tenant",)

REQUESTS = Counter(
    "stepwise:tenant_requests", "Requests (samples) admitted past the quotas", _T, registry=REGISTRY
)
REJECTED = Counter(
    "stepwise:tenant_rejected",
    "Calls refused over a quota (RESOURCE_EXHAUSTED, 429 through the gateway) or by the scheduler after "
    "the quotas passed them (quota: ttft_slo_ms, or the verdict), each once, by tenant and quota",
    ("tenant", "quota"),
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "stepwise:tenant_prompt_tokens", "Prompt tokens of admitted requests", _T, registry=REGISTRY
)
OUTPUT_TOKENS = Counter("stepwise:tenant_output_tokens", "Output tokens served", _T, registry=REGISTRY)
CONCURRENT = Gauge(
    "stepwise:tenant_concurrent_requests",
    "Requests running or queued",
    _T,
    registry=REGISTRY,
    multiprocess_mode="mostrecent",
)
QUEUED = Gauge(
    "stepwise:tenant_queued_requests",
    "Requests not yet in their first prefill",
    _T,
    registry=REGISTRY,
    multiprocess_mode="mostrecent",
)


class TenantMetrics:
    """What the tenant book observes, as Prometheus series (the book itself stays plain)."""

    def admitted(self, label: str, samples: int, prompt_tokens: int) -> None:
        REQUESTS.labels(label).inc(samples)
        PROMPT_TOKENS.labels(label).inc(samples * prompt_tokens)

    def rejected(self, label: str, quota: str) -> None:
        REJECTED.labels(label, quota).inc()

    def served(self, label: str, tokens: int) -> None:
        OUTPUT_TOKENS.labels(label).inc(tokens)

    def holding(self, label: str, concurrent: int, queued: int) -> None:
        CONCURRENT.labels(label).set(concurrent)
        QUEUED.labels(label).set(queued)
