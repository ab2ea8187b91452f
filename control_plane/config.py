"""The control plane's configuration: one frozen object built from flags at the entry point.

Scheduler flags keep SGLang's names and meanings (docs/scheduler.md#defaults). Every flag can also be set
through an environment variable `STEPWISE_<FLAG>` (the command line applies those as defaults), and
SGLang's tuning knobs that are environment variables there (`SGLANG_INIT_NEW_TOKEN_RATIO`, ...) are
read here under the `STEPWISE_` prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from control_plane.cpus import AUTO_FRONTENDS_CAP, auto_frontends, available_cpus
from flagtypes import (
    INT32_MAX,
    MAX_PROCESSES,
    MAX_TOKENS,
    PORT,
    SEED,
    Float,
    Int,
    IntOr,
    count,
    seconds,
    switch,
)
from flagtypes.cost import linear_cost
from flagtypes.table import SWITCH, Flag, Flags, flag_values
from grammars import backend as grammar_backends

SCHEDULE_POLICIES = (
    "fcfs",
    "lpm",
    "dfs-weight",
    "lof",
    "random",
    "routing-key",
    "hrrn",
    "shortest-prefill-first",
    "lpm-aging",
    "edf",
)
FAIRNESS = ("none", "vtc", "vtc-locality")
# SchedulerConfig.tenant_slos' key for every tenant the tenant file does not list (its [defaults]).
ANY_TENANT = "*"
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
RETRACTION_POLICIES = ("length", "priority")
DEFAULT_RECORD_MAX_BYTES = 256 * 1024 * 1024
# A part smaller than a few steps' records would mean a file per step.
MIN_RECORD_BYTES = 1024
MAX_RECORD_BYTES = 2**40
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost", "[::1]")


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client request or one worker may ask of the control plane; past it, a clear refusal."""

    max_stop_strings: int = 64
    # Summed over a request's stop strings, in characters.
    max_stop_chars: int = 4096
    max_stop_token_ids: int = 1024
    # Top alternatives per position a request may ask for, and ids in its token_ids_logprob.
    max_top_logprobs: int = 20
    # UTF-8 bytes of a request's constraint (a JSON schema, regex or grammar's text).
    max_grammar_bytes: int = 256 * 1024
    # UTF-8 bytes of a text prompt, checked before tokenizing (which costs time in proportion).
    max_prompt_bytes: int = 4 * 1024 * 1024
    # Request ids and routing keys, in characters.
    max_id_chars: int = 256
    # A worker may claim at most this KV capacity (and as much host pool) in its hello.
    max_worker_kv_tokens: int = 1 << 32
    # A step's result must arrive within base + per_token · (tokens in the plan) seconds.
    worker_step_timeout_s: float = 60.0
    worker_step_timeout_per_token_s: float = 0.002

    def step_deadline_s(self, plan_tokens: int) -> float:
        return self.worker_step_timeout_s + self.worker_step_timeout_per_token_s * plan_tokens


@dataclass(frozen=True, slots=True)
class Security:
    """TLS, mutual TLS with workers, and client API keys (all off by default; see README "Security")."""

    # PEM files of the control plane's certificate and key: TLS on the client port, and on the worker
    # port too when worker_ca is set.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # PEM CA bundle: workers must present a certificate that chains to it (mutual TLS).
    worker_ca: Path | None = None
    # Bearer tokens accepted from clients; empty: no authentication.
    api_keys: tuple[str, ...] = ()
    # Serve the worker port on a non-loopback address without mutual TLS (any process that can reach
    # it could attach as a worker and read prompts).
    allow_insecure_workers: bool = False

    @property
    def client_tls(self) -> bool:
        return self.tls_cert is not None


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
    # SGLang environment knobs (docs/scheduler.md#new-token-ratio, #retraction, #prefill-adder-budgets,
    # #in-batch-prefix-dedup, #intake).
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
    # Past this many waiting requests lpm, hrrn and lpm-aging order FCFS (0: never; SGLang: 128).
    cache_aware_queue_limit: int = 128
    # The in-batch dedup covers uncached parts and prefills in flight (docs/scheduler.md#full-prefix-dedup).
    full_prefix_dedup: bool = False
    # A request waiting longer than this goes first (0: off; docs/scheduler.md#max-queue-wait).
    max_queue_wait_s: float = 0.0
    # lpm-aging: matched tokens a second of waiting is worth.
    lpm_aging_tokens_per_s: float = 100.0
    # Token fairness between tenants (docs/scheduler.md#fairness): none (SGLang), vtc, vtc-locality.
    fairness: str = "none"
    # VTC's weights of a prompt token computed and of an output token generated.
    fairness_prompt_weight: float = 1.0
    fairness_output_weight: float = 2.0
    # vtc-locality: how far (weighted tokens) past the least-served tenant a better prefix match may be.
    fairness_locality_bound: float = 4096.0
    # vtc: running requests of a tenant more than this far (weighted tokens) ahead of a waiting request's
    # tenant give way to it when it cannot be admitted (docs/scheduler.md#fairness-preemption); 0: never.
    fairness_preempt_bound: float = 0.0
    # vtc: while a tenant below its weighted share of the running batch has requests live, the tenants
    # above theirs get at most this many prompt tokens a step, after the others' requests
    # (docs/scheduler.md#fairness-isolation); 0: off.
    fairness_isolation_tokens: int = 0
    # With it: the most requests the tenants above their share may hold running together; 0: no cap.
    fairness_isolation_running: int = 0
    # With it: a tenant counts as live for this many seconds of the worker's time (the queue clock)
    # after a pass last saw it running or waiting, so a flood does not get SGLang's steps back
    # between its requests; 0: only while it has requests live.
    fairness_isolation_grace: float = 0.0
    # With it: while a light tenant has requests running, a prefill step of heavy tenants' prompts
    # alone is followed by a step without them (a decode, unless a light request is admitted).
    fairness_isolation_decode_turn: bool = False
    # Tenant -> weight (a tenant's fair share is proportional to it); absent tenants weigh 1.
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    # SLO admission (docs/scheduler.md#slo-admission): the worker's step cost (a, b, c, d) in seconds,
    # a + b·prefill tokens + c·context tokens + d·decode rows; empty: no SLO admission.
    slo_cost: tuple[float, ...] = ()
    # Tenant -> (ttft_slo_ms, tpot_slo_ms) for requests that name none; ANY_TENANT: the others'.
    tenant_slos: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # Check pool invariants after every step (tests), not only when idle.
    strict_invariants: bool = False

    def __post_init__(self) -> None:
        # A recording's header gives JSON lists back; keep the config's values hashable and equal.
        object.__setattr__(self, "slo_cost", tuple(float(x) for x in self.slo_cost))
        slos = {k: (float(v[0]), float(v[1])) for k, v in self.tenant_slos.items()}
        object.__setattr__(self, "tenant_slos", slos)
        object.__setattr__(self, "tenant_weights", dict(self.tenant_weights))

    def tenant_weight(self, tenant: str) -> float:
        """The tenant's own weight, else the tenant file's [defaults] (under ANY_TENANT), else 1."""
        found = self.tenant_weights.get(tenant)
        return float(found if found is not None else self.tenant_weights.get(ANY_TENANT, 1.0))

    def tenant_slo(self, tenant: str) -> tuple[float, float]:
        """(ttft_slo_ms, tpot_slo_ms) for the tenant's requests that name none: its own entry's, else
        the tenant file's [defaults] (under ANY_TENANT); 0: none. The one place they are applied."""
        found = self.tenant_slos.get(tenant)
        return found if found is not None else self.tenant_slos.get(ANY_TENANT, (0.0, 0.0))

    def retenant(self, weights: Mapping[str, float], slos: Mapping[str, tuple[float, float]]) -> None:
        """A reloaded tenant file's weights and objectives (SIGHUP): the one part of the config that
        changes while it runs. In place, so every scheduler holding this config sees them at once
        (a recording's header keeps those at its start)."""
        assert isinstance(self.tenant_weights, dict) and isinstance(self.tenant_slos, dict)
        self.tenant_weights.clear()
        self.tenant_weights.update(weights)
        self.tenant_slos.clear()
        self.tenant_slos.update({k: (float(v[0]), float(v[1])) for k, v in slos.items()})

    @property
    def chunking_enabled(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Which attached worker a request goes to (control_plane/core/fleet/router.py); SGLang gateway's
    defaults."""

    # Longest cached prefix first (else least loaded); False: always the least loaded.
    cache_aware: bool = True
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The control-plane process: ports, model directory, logging, and the scheduler."""

    model_dir: Path
    # The name GetServerInfo reports (stepwise.models.served_name of --model); "": the directory's.
    model_name: str = ""
    host: str = "127.0.0.1"
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
    limits: Limits = field(default_factory=Limits)
    security: Security = field(default_factory=Security)
    # Client-facing processes (gRPC servers sharing the client port; see control_plane/frontend/server.py).
    frontends: int = 1
    # Output tokens per client message (SGLang's --stream-interval): the first token goes at once,
    # then a message per this many tokens, and the rest at the finish.
    stream_interval: int = 1
    # What a log probability is (vLLM's --logprobs-mode): "raw", the log-softmax of the model's logits,
    # or "processed", of what sampling draws from (docs/protocols.md#log-probabilities).
    logprobs_mode: str = "raw"
    # Constrained decoding's backend (grammars/backend.py), or "none": constraints are refused.
    grammar_backend: str = "llguidance"
    # A constraint that has not compiled within this many seconds is refused (its request only).
    grammar_compile_timeout_s: float = 10.0
    # Two plans in flight per worker (SGLang's overlap scheduling, docs/scheduler.md#overlap).
    overlap: bool = True
    # Concurrent Generate calls one frontend serves; past it, RESOURCE_EXHAUSTED.
    max_concurrent_streams: int = 65536
    # The core pings each frontend this often over a connection of its own (frontend.proto). A
    # frontend that does not answer within the timeout, or whose event loop has not run for that long,
    # is killed and restarted; a frontend that hears no ping for that long leaves its core. A thread
    # answers, so neither a burst of streaming work nor a queue of token batches delays an answer;
    # the timeout leaves room for a long GC pause or a loaded machine (seconds), and bounds how long
    # a stopped frontend's clients wait for their streams to end.
    frontend_heartbeat_interval_s: float = 1.0
    frontend_heartbeat_timeout_s: float = 10.0
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # Seconds a draining worker's running requests (and, on SIGTERM, this control plane's streams)
    # may take to finish before they are handed over (or aborted).
    drain_timeout_s: float = 30.0
    # A draining worker's running requests migrate to another worker with their KV instead of
    # finishing there (docs/migration.md); off: --disable-drain-migration.
    drain_migration: bool = True
    # Running requests migrate between this control plane's workers for KV room (docs/migration.md
    # #balancing): before a worker would retract, and when one with a queue has far less free KV than
    # another; off: --disable-kv-balance. The look-ahead in decode steps, and the free-share gap.
    kv_balance: bool = True
    kv_balance_steps: int = 16
    kv_balance_threshold: float = 0.3
    # STEPWISE_TEST_MIGRATE (tests): every this many steps a worker migrates a running call to another
    # worker (0: never; STEPWISE_TEST_MIGRATE_INTERVAL sets the steps, default 5).
    test_migrate_interval: int = 0
    # The worker ports of every control plane, this one included (`A:P,B:P` or `dns:///NAME:PORT`);
    # empty: no rebalancing among peers.
    peers: str = ""
    # Seconds between two looks at the peers' census (jittered by ±20%).
    rebalance_interval_s: float = 2.0
    # The tenant table (--tenants, docs/deploy.md#tenants), read at start and again on SIGHUP; None:
    # no tenants, no quotas (SGLang's behaviour).
    tenants_file: Path | None = None


def slo_cost(text: str) -> tuple[float, ...]:
    """--slo-cost: the worker's step cost 'a,b,c,d' in seconds (flagtypes.cost); '': none."""
    return linear_cost(text, terms=(4,)) if text.strip() else ()


def frontends_from_arg(value: int | str) -> int:
    """The frontend count --frontends names (auto: from the CPUs this process may use)."""
    return auto_frontends(available_cpus()) if value == "auto" else int(value)


def _chunk_size(size: int | None) -> int | None:
    """--chunked-prefill-size: -1 or 0 (SGLang's off) is no chunking."""
    return size if size is not None and size > 0 else None


def _peers(text: str) -> str:
    from protos.targets import parse_targets

    peers = str(text).strip()
    if peers:
        parse_targets(peers, "--peers")  # a malformed target fails at start
    return peers


ROUTING_POLICIES = ("cache-aware", "least-loaded")


def _cache_aware(policy: str) -> bool:
    return policy == "cache-aware"


# The control plane's flags, in --help's order, each section the fields of one frozen config (names
# and meanings follow SGLang's server arguments; every numeric flag states its range in its type).
_SERVER = Flags(
    ControlConfig,
    (
        Flag(
            "--model",
            default="embedded",
            field=None,
            help="model directory (tokenizer and config), or 'embedded'",
        ),
        Flag(
            "--served-model-name",
            field=None,
            help="the model name GetServerInfo reports (default: a named model's name, a Hub id without its "
            "revision, else the directory's name; `up --gateway-served-model-name` sets it to the gateway's)",
        ),
        Flag(
            "--host",
            help="address both servers bind (default: this machine only; 0.0.0.0 for every interface)",
        ),
        Flag("--port", PORT, help="client (Generation) port; 0 picks a free one"),
        Flag("--worker-port", PORT, help="worker dial-in port; 0 picks a free one"),
        Flag("--metrics-port", PORT, help="serve Prometheus /metrics on this port (0: off)"),
    ),
)
_SCHEDULING = Flags(
    SchedulerConfig,
    (
        Flag(
            "--schedule-policy",
            choices=SCHEDULE_POLICIES,
            help="order of the waiting queue: fcfs (arrival), lpm (longest cached prefix first), dfs-weight "
            "(depth-first over the prefix tree), lof (longest output first), random, routing-key, hrrn "
            "(highest response ratio next), shortest-prefill-first (fewest uncached tokens first), "
            "lpm-aging (cached prefix plus time waited), edf (earliest TTFT deadline first among requests "
            "with a ttft_slo_ms, the rest after them in arrival order)",
        ),
        Flag(
            "--cache-aware-queue-limit",
            count(0),
            help="past this many waiting requests lpm, hrrn and lpm-aging order the queue first come first "
            "served (SGLang's 128); 0: never, cache-aware order at any depth from kept prefix matches",
        ),
        Flag(
            "--full-prefix-dedup",
            SWITCH,
            help="the in-batch prefix dedup of cache-aware policies covers every waiting request's "
            "uncached part, not only requests with almost nothing cached, and counts the prefills still "
            "in flight: a request whose next tokens another one is computing waits for them instead of "
            "computing them again (matches every waiting request on every pass; default: SGLang's dedup)",
        ),
        Flag(
            "--max-queue-wait-s",
            seconds(),
            help="a request waiting longer than this (worker busy time) goes first, in arrival order, "
            "whatever the policy; 0: off",
        ),
        Flag(
            "--lpm-aging-tokens-per-s",
            Float(0.0, 1e9),
            help="lpm-aging: a second of waiting counts as this many matched prefix tokens",
        ),
        Flag(
            "--fairness",
            choices=FAIRNESS,
            help="token fairness between tenants: none (SGLang's), vtc (the waiting queue is served from the "
            "least-served backlogged tenant, by weighted tokens), vtc-locality (vtc, but a better prefix "
            "match may go first while its tenant is within --fairness-locality-bound of the least served)",
        ),
        Flag(
            "--fairness-prompt-weight",
            Float(0.0, 1e6),
            help="vtc: what a prompt token computed adds to its tenant's counter",
        ),
        Flag(
            "--fairness-output-weight",
            Float(0.0, 1e6),
            help="vtc: what an output token generated adds to its tenant's counter",
        ),
        Flag(
            "--fairness-locality-bound",
            Float(0.0, 1e12),
            help="vtc-locality: weighted tokens a tenant may be ahead of the least-served backlogged tenant "
            "and still go first for a longer cached prefix",
        ),
        Flag(
            "--fairness-preempt-bound",
            Float(0.0, 1e12),
            help="vtc: a waiting request that cannot be admitted preempts running requests of tenants more "
            "than this many weighted tokens ahead of its own (0: never, SGLang's)",
        ),
        Flag(
            "--fairness-isolation-tokens",
            Int(0, INT32_MAX),
            help="vtc: while a tenant holding less than its weighted share of the running batch has "
            "requests live, tenants above their share get at most this many prompt tokens a step, behind "
            "the others' requests and never in a step that admits one (0: off, SGLang's)",
        ),
        Flag(
            "--fairness-isolation-running",
            Int(0, INT32_MAX),
            help="with --fairness-isolation-tokens: the tenants above their share of the running batch may "
            "hold at most this many running requests together while the others have requests live, so a "
            "decode step stays short (0: no cap)",
        ),
        Flag(
            "--fairness-isolation-grace",
            Float(0.0, 1e9),
            help="with --fairness-isolation-tokens: seconds of the worker's time a tenant still counts as "
            "live after it last had requests running or waiting, so a flood is held between its requests "
            "too (0: only while it has requests live)",
        ),
        Flag(
            "--fairness-isolation-decode-turn",
            SWITCH,
            help="with --fairness-isolation-tokens: while a tenant below its share has requests running, "
            "a prefill step of the tenants above theirs alone is followed by a step without their prompts, "
            "so the running requests decode although the heavy tenants are backlogged",
        ),
        Flag(
            "--slo-cost",
            slo_cost,
            help="SLO admission: the worker's step time 'a,b,c,d' in seconds (a + b·prefill tokens + "
            "c·context tokens + d·decode rows); requests whose ttft_slo_ms cannot be met are refused at "
            "once; unset: no SLO admission",
        ),
        Flag(
            "--chunked-prefill-size",
            Int(-1, INT32_MAX),
            to=_chunk_size,
            help="prompt tokens one request may prefill per step (a longer prompt goes in chunks); -1 or 0 "
            "disables chunked prefill",
        ),
        Flag(
            "--max-prefill-tokens",
            count(1),
            help="prompt tokens one prefill step admits (the first request of a batch may exceed it)",
        ),
        Flag(
            "--schedule-conservativeness",
            Float(0.0, 100.0),
            help="scales the decode tokens reserved per running request before admitting more (larger: "
            "fewer retractions, smaller batches)",
        ),
        Flag("--page-size", Int(1, 65536), help="tokens per KV page (default: the worker's)"),
        Flag(
            "--max-running-requests",
            count(1),
            help="requests running at once (default: from the worker's KV capacity, as SGLang)",
        ),
        Flag(
            "--max-queued-requests",
            count(1),
            help="requests waiting at once; more are refused with RESOURCE_EXHAUSTED (default: no limit)",
        ),
        Flag("--prefill-max-requests", count(1), help="requests one prefill step admits (default: no limit)"),
        Flag(
            "--enable-mixed-chunk",
            SWITCH,
            help="run a chunked prefill and the running decodes in one step (needs chunked prefill)",
        ),
        Flag("--random-seed", SEED, help="seed of the random schedule policy's shuffles"),
        Flag(
            "--strict-invariants",
            SWITCH,
            help="check the KV pool invariants after every step (not only when idle)",
        ),
    ),
)
_LOGGING = Flags(
    ControlConfig,
    (
        Flag(
            "--decode-log-interval",
            count(1),
            help="log one decode line per this many decode steps of a worker",
        ),
    ),
)
_PRIORITY = Flags(
    SchedulerConfig,
    (
        Flag(
            "--enable-priority-scheduling",
            SWITCH,
            help="order the queue by each request's priority first (with fcfs or lof), and let a higher "
            "priority preempt a running request",
        ),
        Flag(
            "--schedule-low-priority-values-first",
            SWITCH,
            help="with priority scheduling, a lower priority value is more urgent (default: higher)",
        ),
        Flag(
            "--priority-scheduling-preemption-threshold",
            count(0),
            help="a waiting request preempts a running one only when its priority is more than this "
            "much more urgent",
        ),
        Flag(
            "--disable-priority-preemption",
            SWITCH,
            help="with priority scheduling, never preempt a running request for a more urgent one",
        ),
        Flag(
            "--abort-on-priority-when-disabled",
            SWITCH,
            help="without priority scheduling, refuse a request that sets a priority (default: ignore it)",
        ),
    ),
)
_CACHE = Flags(
    SchedulerConfig,
    (
        Flag(
            "--radix-eviction-policy",
            choices=EVICTION_POLICIES,
            help="which cached prefix the radix cache evicts first when the KV pool is full",
        ),
        Flag(
            "--disable-radix-cache",
            SWITCH,
            help="no prefix caching: every prompt is computed in full and freed when its request ends",
        ),
        Flag(
            "--retraction-policy",
            choices=RETRACTION_POLICIES,
            help="which running request goes back to the queue when decode runs out of KV: length (the "
            "one with the most tokens left, as SGLang) or priority (the least urgent; needs priority "
            "scheduling)",
        ),
        Flag(
            "--allow-auto-truncate",
            SWITCH,
            help="cut a prompt longer than the model's context to fit (default: refuse the request)",
        ),
    ),
)
_TIMEOUTS = Flags(
    ControlConfig,
    (
        Flag(
            "--waiting-timeout",
            seconds(-1.0),
            field="waiting_timeout_s",
            help="seconds a request may wait in the queue, then it is aborted; <= 0: off",
        ),
        Flag(
            "--running-timeout",
            seconds(-1.0),
            field="running_timeout_s",
            help="seconds a request may run after its first forward, then it finishes; <= 0: off",
        ),
    ),
)
_RECORDING = Flags(
    ControlConfig,
    (
        Flag(
            "--record", Path, metavar="DIR", field="record_dir", help="record every scheduler call per worker"
        ),
        Flag(
            "--record-max-bytes",
            Int(MIN_RECORD_BYTES, MAX_RECORD_BYTES),
            help="a recording part is closed and the next begun past this size",
        ),
    ),
)
_PROCESSES = Flags(
    ControlConfig,
    (
        Flag(
            "--frontends",
            IntOr(1, MAX_PROCESSES, "auto"),
            default="auto",
            to=frontends_from_arg,
            help="client-facing processes sharing the client port (validation, tokenizing, streaming): "
            f"a count, or auto (the default): one per CPU this process may use beyond the core's own, "
            f"1 to {AUTO_FRONTENDS_CAP}, CPU affinity and cgroup quota counted",
        ),
        Flag(
            "--stream-interval",
            count(1),
            help="output tokens per client message after the first (larger: fewer, bigger messages)",
        ),
        Flag(
            "--logprobs-mode",
            choices=("raw", "processed"),
            help="log probabilities of the model's logits (raw) or of what sampling draws from, after "
            "penalties, bias, temperature and top-k/top-p/min-p (processed)",
        ),
        Flag(
            "--grammar-backend",
            choices=(*grammar_backends.NAMES, grammar_backends.NONE),
            help="what compiles and matches constrained requests' grammars (json_schema, regex, ebnf, lark, "
            "structural_tag, choice); none refuses them",
        ),
        Flag(
            "--grammar-compile-timeout",
            seconds(0.001),
            field="grammar_compile_timeout_s",
            help="seconds a request's grammar may take to compile before the request is refused",
        ),
        Flag(
            "--disable-overlap-schedule",
            SWITCH,
            field="overlap",
            to=operator.not_,
            help="one plan in flight per worker instead of two (planning no longer overlaps the forward)",
        ),
        Flag(
            "--max-concurrent-streams",
            count(1),
            help="Generate calls one frontend serves at once; more get RESOURCE_EXHAUSTED (health checks, "
            "GetServerInfo and Abort are not counted and always answer)",
        ),
        Flag(
            "--frontend-heartbeat-interval",
            seconds(0.05, 60.0),
            field="frontend_heartbeat_interval_s",
            help="seconds between two heartbeats the core sends each frontend (0.05 to 60)",
        ),
        Flag(
            "--frontend-heartbeat-timeout",
            seconds(0.1, 3600.0),
            field="frontend_heartbeat_timeout_s",
            help="seconds a frontend may go without answering a heartbeat, or without its event loop "
            "running, before the core kills and restarts it; a frontend that hears none for as long "
            "leaves its core (at least twice the interval, at most 3600)",
        ),
    ),
)
_PEERS = Flags(
    ControlConfig,
    (
        Flag(
            "--drain-timeout",
            seconds(),
            field="drain_timeout_s",
            help="seconds a draining worker's running requests may take before they continue on another "
            "worker; on SIGTERM, seconds this control plane's streams may take before they are aborted",
        ),
        Flag(
            "--disable-drain-migration",
            SWITCH,
            field="drain_migration",
            to=operator.not_,
            help="a draining worker's running requests finish there (or continue elsewhere by recompute "
            "past --drain-timeout) instead of migrating at once to another worker with their KV",
        ),
        Flag(
            "--disable-kv-balance",
            SWITCH,
            field="kv_balance",
            to=operator.not_,
            help="a worker short of KV retracts its requests (to prefill them again later) even when "
            "another worker has room, and a worker's queue waits while another's KV is free, instead of "
            "migrating running requests there with their KV",
        ),
        Flag(
            "--kv-balance-steps",
            count(1),
            metavar="N",
            help="how many decode steps ahead a worker looks for a KV shortage that would retract "
            "(a request moves before it; default: %(default)s)",
        ),
        Flag(
            "--kv-balance-threshold",
            Float(0.0, 1.0),
            metavar="F",
            help="a worker with queued requests moves a running one to a worker without a queue when "
            "its free share of KV trails that worker's by more than F (0-1; default: %(default)s)",
        ),
        Flag(
            "--peers",
            metavar="TARGET",
            to=_peers,
            help="the worker ports of all control planes, this one included (HOST:PORT, a comma list, or "
            "dns:///NAME:PORT; a name stands for all its addresses): one holding more than one worker "
            "above the emptiest peer asks its newest worker to move. Empty: off. With --worker-ca the "
            "peers are asked over mutual TLS with --tls-cert/--tls-key: one CA signs every control plane's "
            "certificate, which must allow both server and client authentication",
        ),
        Flag(
            "--rebalance-interval",
            seconds(0.01),
            field="rebalance_interval_s",
            help="seconds between two looks at the peers (jittered by 20%%)",
        ),
    ),
)
_ROUTING = Flags(
    RoutingConfig,
    (
        Flag(
            "--routing-policy",
            default="cache-aware",
            choices=ROUTING_POLICIES,
            field="cache_aware",
            to=_cache_aware,
            help="cache-aware: the worker caching the longest prefix of the prompt unless the load is "
            "imbalanced, else the least loaded; least-loaded: always the least loaded",
        ),
        Flag(
            "--balance-abs-threshold",
            count(0),
            help="cache-aware routing turns to the least loaded worker when the busiest has this many "
            "more requests (queued + running) than the idlest ...",
        ),
        Flag("--balance-rel-threshold", Float(1.0, 1e6), help="... and more than this many times its load"),
    ),
)
_LIMITS = Flags(
    Limits,
    (
        Flag("--max-stop-strings", count(0), help="stop strings per request"),
        Flag("--max-stop-chars", count(0), help="characters of all stop strings"),
        Flag("--max-stop-token-ids", count(0), help="stop token ids per request"),
        Flag("--max-prompt-bytes", count(0), help="UTF-8 bytes of a text prompt"),
        Flag(
            "--max-top-logprobs",
            count(0),
            help="top log probabilities per position a request may ask for "
            "(and ids in its token_ids_logprob)",
        ),
        Flag(
            "--max-grammar-bytes",
            count(1),
            help="UTF-8 bytes of a request's constraint (its JSON schema, regex or grammar)",
        ),
        Flag("--max-worker-kv-tokens", Int(1, MAX_TOKENS), help="largest KV pool a worker may claim"),
        Flag(
            "--worker-step-timeout",
            seconds(0.01),
            field="worker_step_timeout_s",
            help="seconds a worker may take for a step (plus the per-token part) before it counts as lost",
        ),
        Flag(
            "--worker-step-timeout-per-token",
            seconds(0.0, 60.0),
            field="worker_step_timeout_per_token_s",
            help="seconds added to the step deadline per token in the plan",
        ),
    ),
)
_SECURITY = Flags(
    Security,
    (
        Flag("--tls-cert", Path, help="PEM certificate: TLS on the client port (and worker port)"),
        Flag("--tls-key", Path, help="PEM private key of --tls-cert"),
        Flag(
            "--worker-ca",
            Path,
            help="PEM CA: only workers with a certificate it signed may attach "
            "(mutual TLS; needs --tls-cert)",
        ),
        Flag("--api-key", field=None, help="bearer token clients must send (authorization: Bearer KEY)"),
        Flag("--api-key-file", Path, field=None, help="file of accepted bearer tokens, one per line"),
        Flag(
            "--tenants",
            Path,
            field=None,
            help="tenant table, TOML (YAML when named *.yaml or *.yml): weights, quotas, key bindings "
            "(docs/deploy.md#tenants); reread on SIGHUP",
        ),
        Flag(
            "--allow-insecure-workers",
            SWITCH,
            help="serve the worker port beyond loopback without --worker-ca (anyone reaching it can attach)",
        ),
    ),
)


FLAGS = (
    _SERVER,
    _SCHEDULING,
    _LOGGING,
    _PRIORITY,
    _CACHE,
    _TIMEOUTS,
    _RECORDING,
    _PROCESSES,
    _PEERS,
    _ROUTING,
    _LIMITS,
    _SECURITY,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the control plane's flags (FLAGS) to `parser`."""
    for section in FLAGS:
        section.add_to(parser)


# SGLang's environment-only knobs, read under our prefix (docs/scheduler.md#defaults), each with its
# range as a flag type: the same checks and words as a flag's STEPWISE_* variable.
_ENV_KNOBS: Mapping[str, tuple[str, Callable[[str], object]]] = {
    "STEPWISE_INIT_NEW_TOKEN_RATIO": ("init_new_token_ratio", Float(0.0, 1.0)),
    "STEPWISE_MIN_NEW_TOKEN_RATIO_FACTOR": ("min_new_token_ratio_factor", Float(0.0, 1.0)),
    # The ratio decays by (init - floor) / steps per decode step: 0 steps would divide by zero.
    "STEPWISE_NEW_TOKEN_RATIO_DECAY_STEPS": ("new_token_ratio_decay_steps", count(1)),
    "STEPWISE_RETRACT_DECODE_STEPS": ("retract_decode_steps", count(0)),
    "STEPWISE_CLIP_MAX_NEW_TOKENS_ESTIMATION": ("clip_max_new_tokens", count(0)),
    # 0: no limit (as SGLang's unset).
    "STEPWISE_MAX_NEW_TOKENS_LIMIT": ("max_new_tokens_limit", count(0)),
    # -1 turns the in-batch prefix dedup off (SGLang's meaning).
    "STEPWISE_IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD": ("in_batch_prefix_check_threshold", count(-1)),
    "STEPWISE_IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD": (
        "in_batch_prefix_deprioritize_threshold",
        count(0),
    ),
    "STEPWISE_TEST_RETRACT": ("test_retract", switch),
    "STEPWISE_TEST_RETRACT_INTERVAL": ("test_retract_interval", count(1)),
}


def test_migrate_interval(env: Mapping[str, str]) -> int:
    """STEPWISE_TEST_MIGRATE (a switch) and STEPWISE_TEST_MIGRATE_INTERVAL (steps, default 5): how
    often a worker migrates a running call under test (0: never)."""
    try:
        if not (env.get("STEPWISE_TEST_MIGRATE") and switch(env["STEPWISE_TEST_MIGRATE"])):
            return 0
        raw = env.get("STEPWISE_TEST_MIGRATE_INTERVAL")
        return int(count(1)(raw)) if raw else 5
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise ValueError(f"STEPWISE_TEST_MIGRATE: {exc}") from None


def scheduler_config_from_args(
    ns: argparse.Namespace, env: Mapping[str, str] | None = None
) -> SchedulerConfig:
    env = os.environ if env is None else env
    values = flag_values(FLAGS, SchedulerConfig, ns)
    for name, (attr, parse) in _ENV_KNOBS.items():
        if env.get(name):
            try:
                values[attr] = parse(env[name])
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise ValueError(f"{name}={env[name]}: {exc}") from None
    config = SchedulerConfig(**values)  # type: ignore[arg-type]
    validate_scheduler_config(config)
    return config


def validate_scheduler_config(config: SchedulerConfig) -> None:
    """Reject flag combinations SGLang rejects, with the flag named in the message."""
    if config.enable_priority_scheduling and config.schedule_policy not in ("fcfs", "lof"):
        raise ValueError("--enable-priority-scheduling requires --schedule-policy fcfs or lof")
    if config.fairness not in FAIRNESS:
        raise ValueError(f"--fairness: want one of {', '.join(FAIRNESS)}, got {config.fairness!r}")
    if config.fairness_preempt_bound > 0 and config.fairness == "none":
        raise ValueError("--fairness-preempt-bound requires --fairness vtc or vtc-locality")
    if config.fairness_isolation_tokens > 0:
        if config.fairness == "none":
            raise ValueError("--fairness-isolation-tokens requires --fairness vtc or vtc-locality")
        if not config.chunking_enabled:
            raise ValueError(
                "--fairness-isolation-tokens requires chunked prefill (--chunked-prefill-size > 0)"
            )
    if config.fairness_isolation_running > 0 and config.fairness_isolation_tokens <= 0:
        raise ValueError("--fairness-isolation-running requires --fairness-isolation-tokens")
    if config.fairness_isolation_grace > 0 and config.fairness_isolation_tokens <= 0:
        raise ValueError("--fairness-isolation-grace requires --fairness-isolation-tokens")
    if config.fairness_isolation_decode_turn and config.fairness_isolation_tokens <= 0:
        raise ValueError("--fairness-isolation-decode-turn requires --fairness-isolation-tokens")
    for tenant, weight in config.tenant_weights.items():
        if not 0 < weight < float("inf"):
            raise ValueError(f"tenant {tenant!r}: weight must be a positive number, got {weight!r}")
    if config.schedule_policy == "shortest-prefill-first" and config.disable_radix_cache:
        raise ValueError("--schedule-policy shortest-prefill-first requires the radix cache")
    if config.retraction_policy == "priority" and not config.enable_priority_scheduling:
        raise ValueError("--retraction-policy priority requires --enable-priority-scheduling")
    if config.enable_mixed_chunk and not config.chunking_enabled:
        raise ValueError("--enable-mixed-chunk requires chunked prefill (--chunked-prefill-size > 0)")
    if config.page_size and config.chunked_prefill_size and config.chunked_prefill_size % config.page_size:
        raise ValueError("--chunked-prefill-size must be a multiple of --page-size")


def limits_from_args(ns: argparse.Namespace) -> Limits:
    return Limits(**flag_values(FLAGS, Limits, ns))  # type: ignore[arg-type]


def routing_from_args(ns: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(**flag_values(FLAGS, RoutingConfig, ns))  # type: ignore[arg-type]


def read_api_keys(path: Path) -> list[str]:
    """The keys of an --api-key-file: one per line; blank lines and `#` comments are skipped.
    ValueError naming the flag when the file cannot be read."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--api-key-file: cannot read {path}: {exc.strerror}") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def security_from_args(ns: argparse.Namespace, host: str) -> Security:
    """Check the TLS/key flags fit together; read key files now so a bad path fails at start."""
    keys = [ns.api_key] if ns.api_key else []
    if ns.api_key_file is not None:
        keys += read_api_keys(ns.api_key_file)
    security = Security(**flag_values(FLAGS, Security, ns), api_keys=tuple(keys))  # type: ignore[arg-type]
    if (security.tls_cert is None) != (security.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if security.worker_ca is not None and security.tls_cert is None:
        raise ValueError("--worker-ca needs --tls-cert and --tls-key (the worker port's certificate)")
    for flag, path in (("--tls-cert", ns.tls_cert), ("--tls-key", ns.tls_key), ("--worker-ca", ns.worker_ca)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag}: no such file: {path}")
    if host not in LOOPBACK_HOSTS and security.worker_ca is None and not security.allow_insecure_workers:
        raise ValueError(
            f"--host {host} exposes the worker port: give --worker-ca (mutual TLS) "
            "or --allow-insecure-workers"
        )
    return security


def control_config_from_args(ns: argparse.Namespace, model_dir: Path, model_name: str = "") -> ControlConfig:
    config = ControlConfig(
        model_dir=model_dir,
        model_name=model_name,
        **flag_values(FLAGS, ControlConfig, ns),  # type: ignore[arg-type]
        scheduler=_with_tenants(scheduler_config_from_args(ns), ns),
        limits=limits_from_args(ns),
        security=security_from_args(ns, ns.host),
        routing=routing_from_args(ns),
        test_migrate_interval=test_migrate_interval(os.environ),
        tenants_file=_tenants_file(ns),
    )
    _check_heartbeat(config)
    return config


def _check_heartbeat(config: ControlConfig) -> None:
    """The frontend heartbeat's timeout is at least two intervals (a check between two flags,
    which their types cannot make)."""
    interval, timeout = config.frontend_heartbeat_interval_s, config.frontend_heartbeat_timeout_s
    if timeout < 2 * interval:
        raise ValueError(
            f"--frontend-heartbeat-timeout {timeout:g} must be at least twice "
            f"--frontend-heartbeat-interval {interval:g}"
        )


def _with_tenants(config: SchedulerConfig, ns: argparse.Namespace) -> SchedulerConfig:
    """The tenant file's weights and latency objectives for fairness and SLO admission (at start;
    a reload on SIGHUP puts the new ones in place, SchedulerConfig.retenant)."""
    from control_plane.tenants.table import check_objectives, load

    path: Path | None = getattr(ns, "tenants", None)
    if path is None:
        return config
    table = load(path)
    check_objectives(table, config.slo_cost)
    return dataclasses.replace(config, tenant_weights=table.weights(), tenant_slos=table.slo_defaults())


def _tenants_file(ns: argparse.Namespace) -> Path | None:
    """--tenants, read once now so that a bad file fails the start with one line naming the field."""
    from control_plane.tenants.table import load  # the table module imports nothing of the config

    path: Path | None = getattr(ns, "tenants", None)
    if path is not None:
        load(path)
    return path
