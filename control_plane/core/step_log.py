"""What one worker's step loop reports: SGLang's log lines (docs/scheduler.md#logs-and-metrics) and the
Prometheus
figures, per step. Formatting lives here so the loop reads as plan, send, receive, apply, publish."""

from __future__ import annotations

import time
from collections import deque

import structlog

from control_plane import metrics
from control_plane.scheduler.scheduler import Scheduler, StepStats
from protos.worker import StepKind, StepPlan


def retraction_line(stats: StepStats) -> str:
    """SGLang's retraction warning (docs/scheduler.md#decode-memory-check)."""
    head = "KV cache pool is full. Retract requests. " if stats.kv_full else "Testing retraction. "
    line = f"{head}#retracted_reqs: {len(stats.retracted)}, #new_tokens_gained: {stats.retract_tokens_gained}"
    if stats.kv_full:
        line += f", #new_token_ratio: {stats.ratio_before_retract:.4f} -> {stats.new_token_ratio:.4f}"
    return line


def oom_abort_line(rid: str) -> str:
    """SGLang's line for the last request aborted because even alone it did not fit
    (docs/scheduler.md#retraction)."""
    return f"retract_decode: aborted last request {rid} due to OOM"


# The pool's gauges (running, queued, KV usage, ratio) are set at most this often: a scrape every
# few seconds sees them as fresh, and setting eight gauges per step costs as much as a step's books.
POOL_GAUGES_S = 0.05


class StepLog:
    """Per-worker counters between log lines; `record` is called once per completed step."""

    def __init__(
        self, worker: str, decode_log_interval: int, log: structlog.typing.FilteringBoundLogger
    ) -> None:
        self.worker = worker
        self.metrics = metrics.WorkerMetrics(worker)
        self.decode_log_interval = decode_log_interval
        self.log = log
        self._decode_batches = 0
        self._decode_tokens_since_log = 0
        self._last_decode_log = time.monotonic()
        self._last_prefill_log = time.monotonic()
        self._last_pool_gauges = float("-inf")
        # The last values set on two per-step gauges (a set costs as much as a small step's books).
        self._hit_rate = -1.0
        self._retracted_now = -1
        # Since the worker attached (GetServerInfo): prompt tokens admitted, cached ones included.
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        # The worker's idle gap before each of its recent steps (GetServerInfo shows percentiles),
        # and its idle and busy seconds in all.
        self.waits: deque[float] = deque(maxlen=1000)
        self.wait_total_s = 0.0
        self.step_total_s = 0.0

    def timed(self, wait_s: float, forward_s: float) -> None:
        """A step's result says how long the worker waited for its plan and how long it ran."""
        self.waits.append(wait_s)
        self.wait_total_s += wait_s
        self.step_total_s += forward_s
        self.metrics.worker_wait.observe(wait_s)

    def record(self, plan: StepPlan, stats: StepStats, sched: Scheduler) -> None:
        """Counters every step, the pool's gauges every POOL_GAUGES_S; SGLang's prefill line per
        prefill, decode line every N decodes."""
        now = time.monotonic()
        if now - self._last_pool_gauges >= POOL_GAUGES_S:
            self._last_pool_gauges = now
            self.metrics.record_pool(
                metrics.PoolFigures(
                    running=len(sched.running),
                    queued=len(sched.waiting),
                    available=sched.kv.available_size(),
                    evictable=sched.kv.evictable_size(),
                    capacity=sched.capacity,
                    new_token_ratio=sched.ratio.current,
                ),
            )
        self._observe_retraction(stats)
        if stats.retracted:
            self.log.warning(retraction_line(stats), step=plan.step_id)
        for rid in stats.oom_aborted:
            self.log.error(oom_abort_line(rid), step=plan.step_id)
        if plan.kind is not StepKind.DECODE:
            self._log_prefill(plan, stats, sched)
        elif len(plan.decodes):
            self._set_hit_rate(0.0)  # as SGLang's decode stats do
            self._log_decode(plan, sched)

    def _set_hit_rate(self, rate: float) -> None:
        if rate != self._hit_rate:
            self._hit_rate = rate
            self.metrics.hit_rate.set(rate)

    def _observe_retraction(self, stats: StepStats) -> None:
        # The gauge is this step's figure: back to 0 on a step without retraction
        # (docs/scheduler.md#logs-and-metrics).
        if stats.tpot_at_risk:
            metrics.SLO_TPOT_AT_RISK.labels(self.worker).inc(stats.tpot_at_risk)
        if len(stats.retracted) != self._retracted_now:
            self._retracted_now = len(stats.retracted)
            self.metrics.retracted_now.set(self._retracted_now)
        if not stats.retracted:
            return
        metrics.RETRACTED_REQUESTS.labels(self.worker).inc(len(stats.retracted))
        metrics.RETRACTED_INPUT_TOKENS.labels(self.worker).inc(stats.retracted_input_tokens)
        metrics.RETRACTED_OUTPUT_TOKENS.labels(self.worker).inc(stats.retracted_output_tokens)

    def _log_prefill(self, plan: StepPlan, stats: StepStats, sched: Scheduler) -> None:
        now = time.monotonic()
        throughput = stats.new_tokens / max(now - self._last_prefill_log, 1e-9)
        self._last_prefill_log = now
        metrics.PROMPT_TOKENS.labels(self.worker).inc(stats.new_tokens)
        metrics.CACHED_TOKENS.labels(self.worker).inc(stats.cached_tokens)
        self.prompt_tokens_total += stats.new_tokens + stats.cached_tokens
        self.cached_tokens_total += stats.cached_tokens
        self._set_hit_rate(stats.cache_hit_rate)
        usage = sched.kv.used_tokens() / sched.capacity
        self.log.info(
            f"Prefill batch, #new-seq: {stats.new_seqs}, #new-token: {stats.new_tokens}, "
            f"#cached-token: {stats.cached_tokens}, token usage: {usage:.2f}, "
            f"#running-req: {stats.running_at_admission}, #queue-req: {len(sched.waiting)}, "
            f"#pending-token: {sched.pending_tokens()}, input throughput (token/s): {throughput:.2f}",
            step=plan.step_id,
        )

    def _log_decode(self, plan: StepPlan, sched: Scheduler) -> None:
        self._decode_batches += 1
        self._decode_tokens_since_log += len(plan.decodes)
        if self._decode_batches % self.decode_log_interval:
            return
        now = time.monotonic()
        throughput = self._decode_tokens_since_log / max(now - self._last_decode_log, 1e-9)
        self._last_decode_log, self._decode_tokens_since_log = now, 0
        metrics.GEN_THROUGHPUT.labels(self.worker).set(throughput)
        usage = sched.kv.used_tokens() / sched.capacity
        self.log.info(
            f"Decode batch, #running-req: {len(plan.decodes)}, #token: {sched.kv.used_tokens()}, "
            f"token usage: {usage:.2f}, gen throughput (token/s): {throughput:.2f}, "
            f"#queue-req: {len(sched.waiting)}",
            step=plan.step_id,
        )
