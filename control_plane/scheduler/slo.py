"""SLO-aware admission (docs/scheduler.md#slo-admission): a request whose TTFT objective cannot be
met is refused at intake instead of being admitted to miss it, and running requests whose next
decode step is predicted slower than their TPOT objective are counted.

The prediction is the worker's step cost model, `a + b·new tokens + c·context tokens + d·decode
rows` seconds (--slo-cost, the model `simulate --cost` runs and `--fit-cost` fits), applied to the
prefill work ahead of the request: the uncached prompt tokens of the requests the policy would admit
before it (all waiting requests; with `edf`, those with an earlier deadline), the rest of the chunk in
progress, and its own uncached tokens, in prefill steps of at most the chunk size, after the steps
in flight (as planned) and before the step that publishes its first token (reckoned at the recent
steps' prompt tokens).
It assumes admission is not held back by memory or the running cap (then the wait is longer): it
refuses what cannot be met even so, Mooncake's early rejection.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from control_plane.cache.radix import as_token_bytes
from control_plane.config import SchedulerConfig
from control_plane.request import RequestParams
from control_plane.scheduler.batch import RunningBatch, ScheduledBatch
from control_plane.scheduler.books import SequenceBooks
from control_plane.scheduler.chunk import ChunkInProgress
from control_plane.scheduler.intake import Intake
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.queue_clock import QueueClock
from control_plane.scheduler.records import QueueFull
from protos.worker import StepKind

SLO_TTFT_UNMEETABLE = (
    "ttft_slo_ms: the predicted time to first token ({predicted:.0f} ms: {tokens} prompt tokens to "
    "prefill ahead of and for this request) exceeds the objective ({slo:.0f} ms); refused at once"
)


# The weight of the latest step in the moving average of prompt tokens per step (about the last 20).
RECENT_WEIGHT = 0.05


class SloUnmeetable(QueueFull):
    """Refused at intake: the TTFT objective cannot be met (RESOURCE_EXHAUSTED, like a full queue)."""


class SloAdmission:
    """The TTFT check at intake and the TPOT count per step."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KvManager,
        intake: Intake,
        running: RunningBatch,
        chunk: ChunkInProgress,
        clock: QueueClock,
        books: SequenceBooks,
        in_flight: Iterable[ScheduledBatch] = (),
    ) -> None:
        self.config = config
        self.a, self.b, self.c, self.d = config.slo_cost
        self.kv = kv
        self.intake = intake
        self.running = running
        self.chunk = chunk
        self.clock = clock
        self.books = books
        # The scheduler's plans whose results are not applied yet (read only).
        self.in_flight = in_flight
        self.edf = config.schedule_policy == "edf"
        budget = min(config.max_prefill_tokens, config.chunked_prefill_size or config.max_prefill_tokens)
        self.step_tokens = max(1, budget)
        # Uncached prompt tokens of each waiting request as its arrival saw them, by rid.
        self.uncached: dict[str, int] = {}
        self.tpot_at_risk: set[str] = set()
        # Prompt tokens per planned step, a moving average (RECENT_WEIGHT for the latest step).
        self.recent_tokens = 0.0
        # Requests refused for their TTFT, and running requests predicted to miss their TPOT.
        self.ttft_refused_total = 0
        self.tpot_at_risk_total = 0

    def objectives(self, params: RequestParams) -> tuple[float, float]:
        """(ttft_slo_ms, tpot_slo_ms): the request's own, else its tenant's defaults (0: none)."""
        ttft, tpot = self.config.tenant_slo(params.tenant)
        return (params.ttft_slo_ms or ttft, params.tpot_slo_ms or tpot)

    def check(self, rid: str, input_ids: Sequence[int], params: RequestParams) -> None:
        """Raises SloUnmeetable when the request's TTFT objective cannot be met. A continuation
        whose first token is out already (moved or handed over: generated_before > 0) is not
        checked: refusing it would abort a stream the client is reading, for an objective its
        first worker met or missed."""
        ttft_ms, _ = self.objectives(params)
        cached = self.kv.tree.cached_len(as_token_bytes(list(input_ids)))
        own = max(1, len(input_ids) - cached)
        if not ttft_ms or params.generated_before > 0:
            self._remember(rid, own)
            return
        ahead, joining = self._ahead(ttft_ms)
        tokens = ahead + own
        predicted_ms = 1000.0 * self.predict_ttft_s(tokens, len(input_ids), joining)
        if predicted_ms > ttft_ms:
            self.ttft_refused_total += 1
            raise SloUnmeetable(
                SLO_TTFT_UNMEETABLE.format(predicted=predicted_ms, tokens=tokens, slo=ttft_ms)
            )
        self._remember(rid, own)

    def _remember(self, rid: str, own: int) -> None:
        self.uncached[rid] = own
        if len(self.uncached) > 2 * len(self.intake.waiting) + 64:
            live = {r.rid for r in self.intake.waiting}
            self.uncached = {k: v for k, v in self.uncached.items() if k in live}

    def _ahead(self, ttft_ms: float) -> tuple[int, int]:
        """Prompt tokens the policy would prefill before a request with this objective arriving now,
        and how many requests they are."""
        chunked = self.chunk.req
        total = chunked.seqlen - chunked.extend_range[1] if chunked is not None else 0
        deadline = self.clock.busy_s + ttft_ms / 1000.0
        count = 0
        for r in self.intake.waiting:
            if self.edf:
                slo = self.objectives(r.params)[0]
                if not slo or r.queue_entry_s + slo / 1000.0 > deadline:
                    continue
            total += self.uncached.get(r.rid, r.seqlen)
            count += 1
        return total, count

    def predict_ttft_s(self, tokens: int, prompt_len: int, joining: int = 0) -> float:
        """The step running now, then ceil(tokens / chunk) prefill steps computing `tokens` (with
        --enable-mixed-chunk each of them also decodes the running batch), then the step during which
        overlap scheduling publishes the first token."""
        # Every sequence the worker holds (a mixed step leaves the running batch empty until the
        # next plan merges it back).
        live = self.books.by_handle.values()
        rows = len(live)
        context = sum(r.kv_committed_len for r in live)
        decode = (self.b + self.d) * rows + self.c * context
        mixed = self.config.enable_mixed_chunk
        # A mixed step's decodes take their rows out of the chunk's budget (the adder's
        # mixed_decode_tokens).
        # The requests ahead join the running batch as they are prefilled: by the end, `joining` more.
        steps = math.ceil(tokens / max(1, self.step_tokens - (rows + joining if mixed else 0)))
        per_step = self.a
        if mixed:
            # The running batch, and its context growing by the prompts prefilled on the way.
            per_step += decode + (self.b + self.d) * joining / 2 + self.c * tokens / 2
        # The engine takes arrivals between steps: this one may have come as the step applied last
        # began (its seconds as the worker reported them). The steps in flight run first, as
        # planned. Under overlap the first token is published a step after its prefill's, and that
        # step prefills what arrived behind it: as many prompt tokens as the recent steps did.
        publish = self.a + decode + self.b * self.recent_tokens
        prefill = steps * per_step + self.b * tokens + self.c * (tokens + prompt_len)
        return self.clock.last_s + self.in_flight_s() + publish + prefill

    def in_flight_s(self) -> float:
        """The predicted seconds of the plans in flight, each as planned (its prefill tokens, its
        decode rows and their context)."""
        total = 0.0
        for batch in self.in_flight:
            extend = sum(r.extend_range[1] - r.extend_range[0] for r in batch.extend_reqs)
            context = sum(r.extend_range[1] for r in batch.extend_reqs)
            rows = len(batch.decode_rows)
            if rows:
                context += int(np.sum(self.kv.columns.committed[batch.decode_rows]))
            total += self.a + self.b * (extend + rows) + self.c * context + self.d * rows
        return total

    def planned(self, batch: ScheduledBatch, new_tokens: int) -> int:
        """Count each decoded request whose TPOT objective is below this step's predicted time, once
        per request; returns how many were counted now. Also averages the prompt tokens per step."""
        prompt_tokens = new_tokens if batch.kind is not StepKind.DECODE else 0
        self.recent_tokens += RECENT_WEIGHT * (prompt_tokens - self.recent_tokens)
        rows = len(batch.decode_rows)
        if not rows:
            return 0
        context = int(np.sum(self.kv.columns.committed[batch.decode_rows]))
        step_ms = 1000.0 * (self.a + self.b * (new_tokens + rows) + self.c * context + self.d * rows)
        counted = 0
        for req in batch.decode_reqs:
            tpot = self.objectives(req.params)[1]
            if tpot and step_ms > tpot and req.rid not in self.tpot_at_risk:
                self.tpot_at_risk.add(req.rid)
                counted += 1
        if len(self.tpot_at_risk) > 2 * rows + 1024:
            live = {r.rid for r in batch.decode_reqs}
            self.tpot_at_risk &= live
        self.tpot_at_risk_total += counted
        return counted
