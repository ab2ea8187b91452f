"""The control plane's configuration: one frozen object built from flags at the entry point.

Scheduler flags keep SGLang's names and meanings (SCHEDULER.md §9). Every flag can also be set
through an environment variable `STEPWISE_<FLAG>` (the command line applies those as defaults), and
SGLang's tuning knobs that are environment variables there (`SGLANG_INIT_NEW_TOKEN_RATIO`, ...) are
read here under the `STEPWISE_` prefix.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "routing-key")
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
RETRACTION_POLICIES = ("length", "priority")
DEFAULT_RECORD_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Everything the scheduler's decisions depend on (besides the worker's limits)."""

    schedule_policy: str = "fcfs"
    # None or <= 0 disables chunking (SGLang: -1).
    chunked_prefill_size: int | None = 2048
    max_prefill_tokens: int = 16384
    schedule_conservativeness: float = 1.0
    # None: take the worker's page size.
    page_size: int | None = None
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    prefill_max_requests: int | None = None
    enable_mixed_chunk: bool = False
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    abort_on_priority_when_disabled: bool = False
    radix_eviction_policy: str = "lru"
    disable_radix_cache: bool = False
    retraction_policy: str = "length"
    allow_auto_truncate: bool = False
    # SGLang environment knobs (§5, §6, §3.1, §2.3, §1.5).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    clip_max_new_tokens: int = 4096
    max_new_tokens_limit: int | None = None
    in_batch_prefix_check_threshold: int = 32
    in_batch_prefix_deprioritize_threshold: int = 32
    test_retract: bool = False
    test_retract_interval: int = 3
    # Seed of the `random` policy's shuffles.
    random_seed: int = 0
    # Check pool invariants after every step (tests), not only when idle.
    strict_invariants: bool = False

    @property
    def chunking_enabled(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The control-plane process: ports, model directory, logging, and the scheduler."""

    model_dir: Path
    host: str = "0.0.0.0"
    port: int = 50051
    worker_port: int = 50052
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    decode_log_interval: int = 40
    # Seconds; <= 0 disables (SGLang's SGLANG_REQ_WAITING_TIMEOUT / _RUNNING_TIMEOUT).
    waiting_timeout_s: float = -1.0
    running_timeout_s: float = -1.0
    record_dir: Path | None = None
    # Prometheus /metrics over HTTP (0: not served).
    metrics_port: int = 0
    # A recording part is closed and a continuation begun once it reaches this size.
    record_max_bytes: int = DEFAULT_RECORD_MAX_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the control plane's flags (names follow SGLang's server arguments)."""
    add = parser.add_argument
    add("--model", default="embedded", help="model directory (tokenizer and config), or 'embedded'")
    add("--host", default="0.0.0.0", help="address both servers bind")
    add("--port", type=int, default=50051, help="client (Generation) port; 0 picks a free one")
    add("--worker-port", type=int, default=50052, help="worker dial-in port; 0 picks a free one")
    add("--schedule-policy", choices=SCHEDULE_POLICIES, default="fcfs")
    add("--chunked-prefill-size", type=int, default=2048, help="-1 disables chunked prefill")
    add("--max-prefill-tokens", type=int, default=16384)
    add("--schedule-conservativeness", type=float, default=1.0)
    add("--page-size", type=int, default=None, help="default: the worker's page size")
    add("--max-running-requests", type=int, default=None)
    add("--max-queued-requests", type=int, default=None)
    add("--prefill-max-requests", type=int, default=None)
    add("--enable-mixed-chunk", action="store_true")
    add("--enable-priority-scheduling", action="store_true")
    add("--schedule-low-priority-values-first", action="store_true")
    add("--priority-scheduling-preemption-threshold", type=int, default=10)
    add("--disable-priority-preemption", action="store_true")
    add("--abort-on-priority-when-disabled", action="store_true")
    add("--radix-eviction-policy", choices=EVICTION_POLICIES, default="lru")
    add("--disable-radix-cache", action="store_true")
    add("--retraction-policy", choices=RETRACTION_POLICIES, default="length")
    add("--allow-auto-truncate", action="store_true")
    add("--decode-log-interval", type=int, default=40)
    add("--waiting-timeout", type=float, default=-1.0, help="seconds a request may wait; <=0: off")
    add("--running-timeout", type=float, default=-1.0, help="seconds a request may run; <=0: off")
    add("--random-seed", type=int, default=0)
    add("--strict-invariants", action="store_true", help="check KV pool invariants after every step")
    add("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: off)")
    add("--record", type=Path, default=None, metavar="DIR", help="record every scheduler call per worker")
    add("--record-max-bytes", type=int, default=DEFAULT_RECORD_MAX_BYTES, help="rotate recording files")


# SGLang's environment-only knobs, read under our prefix (SCHEDULER.md §9).
_ENV_KNOBS: Mapping[str, tuple[str, type]] = {
    "STEPWISE_INIT_NEW_TOKEN_RATIO": ("init_new_token_ratio", float),
    "STEPWISE_MIN_NEW_TOKEN_RATIO_FACTOR": ("min_new_token_ratio_factor", float),
    "STEPWISE_NEW_TOKEN_RATIO_DECAY_STEPS": ("new_token_ratio_decay_steps", int),
    "STEPWISE_RETRACT_DECODE_STEPS": ("retract_decode_steps", int),
    "STEPWISE_CLIP_MAX_NEW_TOKENS_ESTIMATION": ("clip_max_new_tokens", int),
    "STEPWISE_MAX_NEW_TOKENS_LIMIT": ("max_new_tokens_limit", int),
    "STEPWISE_IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD": ("in_batch_prefix_check_threshold", int),
    "STEPWISE_IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD": (
        "in_batch_prefix_deprioritize_threshold",
        int,
    ),
    "STEPWISE_TEST_RETRACT": ("test_retract", bool),
    "STEPWISE_TEST_RETRACT_INTERVAL": ("test_retract_interval", int),
}


def _parse_env_value(raw: str, kind: type) -> object:
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def scheduler_config_from_args(
    ns: argparse.Namespace, env: Mapping[str, str] | None = None
) -> SchedulerConfig:
    env = os.environ if env is None else env
    chunk = ns.chunked_prefill_size
    values: dict[str, object] = {
        "schedule_policy": ns.schedule_policy,
        "chunked_prefill_size": chunk if chunk is not None and chunk > 0 else None,
        "max_prefill_tokens": ns.max_prefill_tokens,
        "schedule_conservativeness": ns.schedule_conservativeness,
        "page_size": ns.page_size,
        "max_running_requests": ns.max_running_requests,
        "max_queued_requests": ns.max_queued_requests,
        "prefill_max_requests": ns.prefill_max_requests,
        "enable_mixed_chunk": ns.enable_mixed_chunk,
        "enable_priority_scheduling": ns.enable_priority_scheduling,
        "schedule_low_priority_values_first": ns.schedule_low_priority_values_first,
        "priority_scheduling_preemption_threshold": ns.priority_scheduling_preemption_threshold,
        "disable_priority_preemption": ns.disable_priority_preemption,
        "abort_on_priority_when_disabled": ns.abort_on_priority_when_disabled,
        "radix_eviction_policy": ns.radix_eviction_policy,
        "disable_radix_cache": ns.disable_radix_cache,
        "retraction_policy": ns.retraction_policy,
        "allow_auto_truncate": ns.allow_auto_truncate,
        "random_seed": ns.random_seed,
        "strict_invariants": ns.strict_invariants,
    }
    for name, (attr, kind) in _ENV_KNOBS.items():
        if env.get(name):
            values[attr] = _parse_env_value(env[name], kind)
    config = SchedulerConfig(**values)  # type: ignore[arg-type]
    validate_scheduler_config(config)
    return config


def validate_scheduler_config(config: SchedulerConfig) -> None:
    """Reject flag combinations SGLang rejects, with the flag named in the message."""
    if config.enable_priority_scheduling and config.schedule_policy not in ("fcfs", "lof"):
        raise ValueError("--enable-priority-scheduling requires --schedule-policy fcfs or lof")
    if config.retraction_policy == "priority" and not config.enable_priority_scheduling:
        raise ValueError("--retraction-policy priority requires --enable-priority-scheduling")
    if config.enable_mixed_chunk and not config.chunking_enabled:
        raise ValueError("--enable-mixed-chunk requires chunked prefill (--chunked-prefill-size > 0)")
    if config.page_size is not None and config.page_size < 1:
        raise ValueError("--page-size must be >= 1")
    if config.page_size and config.chunked_prefill_size and config.chunked_prefill_size % config.page_size:
        raise ValueError("--chunked-prefill-size must be a multiple of --page-size")


def control_config_from_args(ns: argparse.Namespace, model_dir: Path) -> ControlConfig:
    return ControlConfig(
        model_dir=model_dir,
        host=ns.host,
        port=ns.port,
        worker_port=ns.worker_port,
        scheduler=scheduler_config_from_args(ns),
        decode_log_interval=ns.decode_log_interval,
        waiting_timeout_s=ns.waiting_timeout,
        running_timeout_s=ns.running_timeout,
        record_dir=getattr(ns, "record", None),
        metrics_port=ns.metrics_port,
        record_max_bytes=getattr(ns, "record_max_bytes", DEFAULT_RECORD_MAX_BYTES),
    )
