"""The per-tenant part of `simulate`'s summary (docs/scheduler.md#simulating-tenants): each tenant's
requests, weighted service, TTFT and refusals; Jain's index of weighted service while every tenant
is backlogged; and, when requests have latency objectives, SLO attainment and goodput."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from control_plane.config import SchedulerConfig
from protos.worker import StepPlan


class Progress(Protocol):
    """What the simulation knows of a request (simulate.py's _Progress)."""

    arrival: float
    first_token: float | None
    finished: float | None
    reason: str
    output_tokens: int


@dataclass(frozen=True, slots=True)
class TenantRequest:
    tenant: str
    # Objectives in seconds (0: none): the request's own, else its tenant's default.
    ttft_slo_s: float
    tpot_slo_s: float


class TenantLedger:
    """Service by tenant on the simulated clock: prompt tokens when the plan that computes them is
    made, output tokens when their result is applied, weighted as VTC weighs them."""

    def __init__(self, config: SchedulerConfig, tenants: Collection[str]) -> None:
        self.config = config
        self.requests: dict[str, TenantRequest] = {}
        # (worker, handle) -> tenant: each worker of a fleet numbers its handles on its own.
        self._tenant_of_handle: dict[tuple[str, int], str] = {}
        # (clock, tenant, weighted tokens), in clock order.
        self.service: list[tuple[float, str, float]] = []
        # Every tenant of the trace; requests of each that arrived and have no first token yet.
        self.tenants = frozenset(tenants)
        self.unanswered: dict[str, int] = {}
        # Weighted service given while every tenant of the trace was backlogged (had a request
        # arrived and unanswered), by tenant.
        self.backlogged_service: dict[str, float] = dict.fromkeys(sorted(self.tenants), 0.0)

    def arrived(self, rid: str, tenant: str, ttft_ms: float, tpot_ms: float) -> None:
        default = self.config.tenant_slo(tenant)
        self.requests[rid] = TenantRequest(
            tenant, (ttft_ms or default[0]) / 1000.0, (tpot_ms or default[1]) / 1000.0
        )
        self.unanswered[tenant] = self.unanswered.get(tenant, 0) + 1

    def answered(self, rid: str) -> None:
        """The request's first token came, or it ended without one (refused, aborted)."""
        tenant = self.requests[rid].tenant
        n = self.unanswered[tenant] - 1
        if n:
            self.unanswered[tenant] = n
        else:
            del self.unanswered[tenant]

    def _serve(self, clock: float, tenant: str, amount: float) -> None:
        self.service.append((clock, tenant, amount))
        if len(self.unanswered) == len(self.tenants):
            self.backlogged_service[tenant] += amount

    def planned(self, plan: StepPlan, clock: float, worker: str = "") -> None:
        """A plan `worker` made (a fleet's worker id; one worker: "")."""
        for seq in plan.new_seqs:
            if seq.request_id in self.requests:
                self._tenant_of_handle[worker, seq.handle] = self.requests[seq.request_id].tenant
        extends = plan.extends
        weight = self.config.fairness_prompt_weight
        for handle, n in zip(extends.handles.tolist(), extends.lens.tolist(), strict=True):
            tenant = self._tenant_of_handle.get((worker, handle))
            if tenant is not None:
                self._serve(clock, tenant, weight * n)

    def output(self, rid: str, tokens: int, clock: float) -> None:
        req = self.requests[rid]
        self._serve(clock, req.tenant, self.config.fairness_output_weight * tokens)

    def summary(self, progress: Mapping[str, Progress], simulated_s: float) -> dict[str, object]:
        by_tenant: dict[str, list[Progress]] = defaultdict(list)
        for rid, req in self.requests.items():
            by_tenant[req.tenant].append(progress[rid])
        served: dict[str, float] = defaultdict(float)
        for _, tenant, amount in self.service:
            served[tenant] += amount
        tenants = {}
        for name in sorted(by_tenant):
            reqs = by_tenant[name]
            ttft = [r.first_token - r.arrival for r in reqs if r.first_token is not None]
            tenants[name] = {
                "requests": len(reqs),
                "served_tokens": round(served[name], 3),
                "ttft_p50_s": _pct(ttft, 50),
                "ttft_p99_s": _pct(ttft, 99),
                "rejected": sum(_refused(r) for r in reqs),
            }
        out: dict[str, object] = {"tenants": tenants, "jain_index": self.jain_index()}
        with_slo = [(r, progress[rid]) for rid, r in self.requests.items() if r.ttft_slo_s or r.tpot_slo_s]
        if with_slo:
            admitted = [(r, p) for r, p in with_slo if not _refused(p)]
            met = sum(_meets(r, p) for r, p in admitted)
            out["slo_attainment"] = round(met / len(admitted), 6) if admitted else None
            out["slo_requests"] = len(with_slo)
            out["slo_rejected"] = len(with_slo) - len(admitted)
            out["goodput_rps"] = round(met / simulated_s, 6) if simulated_s > 0 else None
        return out

    def jain_index(self) -> float | None:
        """Jain's index of service / weight over the service given while every tenant had a request
        waiting for its first token (VTC's backlogged). None with fewer than two tenants or no such
        service."""
        if len(self.tenants) < 2:
            return None
        x = np.array([v / self.config.tenant_weight(t) for t, v in self.backlogged_service.items()])
        if not x.any():
            return None
        return round(float(x.sum() ** 2 / (len(x) * (x**2).sum())), 6)


def _refused(p: Progress) -> bool:
    return p.reason.startswith("refused")


def _meets(r: TenantRequest, p: Progress) -> bool:
    """Served to its end, first token within its TTFT objective, tokens after it at its TPOT."""
    if p.first_token is None or p.finished is None or p.reason == "abort":
        return False
    if r.ttft_slo_s and p.first_token - p.arrival > r.ttft_slo_s:
        return False
    if r.tpot_slo_s and p.output_tokens > 1:
        return (p.finished - p.first_token) / (p.output_tokens - 1) <= r.tpot_slo_s
    return True


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 6) if values else None
