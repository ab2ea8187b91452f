"""The gateway's own Prometheus metrics, in a registry of its own (not the process-global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """Request counters by endpoint and HTTP status; latency histograms by endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "stepwise_gateway_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "stepwise_gateway_request_duration_seconds",
            "Seconds from a request's arrival to its last byte",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "stepwise_gateway_time_to_first_token_seconds",
            "Seconds from a generation request's arrival to its first output token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "stepwise_gateway_completion_tokens",
            "Output tokens returned",
            ["endpoint"],
            registry=self.registry,
        )
        self.disconnects = Counter(
            "stepwise_gateway_client_disconnects",
            "Streams cut short by the client (the gRPC call was cancelled)",
            ["endpoint"],
            registry=self.registry,
        )

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)
