"""The core's tenant book: which tenant each live sample belongs to, the quotas over them, and the
per-tenant usage reported in GetServerInfo and /metrics.

Plain and synchronous (the hub calls it from its publisher methods, the clock passed in). It exists
only with `--tenants`: without a table nothing is resolved, checked or counted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from control_plane.tenants.quota import Quotas, Refusal
from control_plane.tenants.table import TenantTable

OTHER = "other"
# Tenants counted one by one at most (beyond the table's own): names a client makes up (without
# keys, any name goes) are summed under OTHER past it, so the book stays bounded.
MAX_COUNTED = 1024


@dataclass(slots=True)
class Served:
    """A tenant's totals since the control plane started."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    rejected: int = 0


@dataclass(slots=True)
class _Sample:
    tenant: str
    queued: bool = True


class Observer(Protocol):
    """Where the book's events go as metrics, by bounded label (control_plane/tenants/metrics.py)."""

    def admitted(self, label: str, samples: int, prompt_tokens: int) -> None: ...

    def rejected(self, label: str, quota: str) -> None: ...

    def served(self, label: str, tokens: int) -> None: ...

    def holding(self, label: str, concurrent: int, queued: int) -> None: ...


@dataclass(slots=True)
class TenantBook:
    quotas: Quotas
    samples: dict[int, _Sample] = field(default_factory=dict)
    # First uid of a call -> every uid of it (a refusal names the first only).
    calls: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # First uid of a call past the quotas and not yet accepted by a scheduler -> its prompt tokens:
    # it is counted when accepted, and its tokens go back into the bucket when refused.
    pending: dict[int, int] = field(default_factory=dict)
    served: dict[str, Served] = field(default_factory=dict)
    observer: Observer | None = None
    # The metric labels of their own (the table's first tenants by name), and what each label holds.
    labels: frozenset[str] = frozenset()
    held: dict[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def of(table: TenantTable, observer: Observer | None = None) -> TenantBook:
        book = TenantBook(Quotas(table), observer=observer)
        book.reload(table)
        return book

    def label(self, tenant: str) -> str:
        """The tenant's metric label: its name for the table's first tenants, else OTHER."""
        return tenant if tenant in self.labels else OTHER

    @property
    def table(self) -> TenantTable:
        return self.quotas.table

    def reload(self, table: TenantTable) -> None:
        """A new table: live requests and their holdings carry over, the new limits apply next."""
        self.quotas.table = table
        self.labels = frozenset(sorted(table.tenants)[: table.max_metric_tenants])
        # Labels may have changed: what each holds is counted again from the live samples.
        held: dict[str, list[int]] = {label: [0, 0] for label in self.held}
        for sample in self.samples.values():
            counts = held.setdefault(self.label(sample.tenant), [0, 0])
            counts[0] += 1
            counts[1] += sample.queued
        self.held = held
        if self.observer is not None:
            for label, (concurrent, queued) in held.items():
                self.observer.holding(label, concurrent, queued)

    def arrive(self, tenant: str, uids: tuple[int, ...], prompt_tokens: int, now: float) -> Refusal | None:
        """A call arrives: refused over quota, or booked (its samples then end through here)."""
        refusal = self.quotas.check(tenant, len(uids), prompt_tokens, now)
        if refusal is not None:
            self._rejected(tenant, refusal.field)
            return refusal
        self._hold(tenant, len(uids), len(uids))
        for uid in uids:
            self.samples[uid] = _Sample(tenant)
        self.calls[uids[0]] = uids
        self.pending[uids[0]] = prompt_tokens
        return None

    def accepted(self, first_uid: int) -> None:
        """A scheduler took the call: now it counts in its tenant's requests and prompt tokens."""
        prompt_tokens = self.pending.pop(first_uid, None)
        sample = self.samples.get(first_uid)
        if prompt_tokens is None or sample is None:
            return
        samples = len(self.calls.get(first_uid, (first_uid,)))
        served = self._served(sample.tenant)
        served.requests += samples
        served.prompt_tokens += samples * prompt_tokens
        if self.observer is not None:
            self.observer.admitted(self.label(sample.tenant), samples, prompt_tokens)

    def refused(self, first_uid: int, reason: str) -> None:
        """The call was refused after its arrival was booked (by the scheduler, say): it counts as
        rejected (`reason`, as a quota refusal counts under its quota) and is not charged (its
        prompt goes back into the token bucket). A call refused before it was booked (over a quota,
        counted by `arrive`; or before its tenant was known) is not this book's to count."""
        prompt_tokens = self.pending.pop(first_uid, None)
        sample = self.samples.get(first_uid)
        uids = self.calls.pop(first_uid, (first_uid,))
        if prompt_tokens is not None and sample is not None:
            self.quotas.refund(sample.tenant, len(uids), prompt_tokens)
            self._rejected(sample.tenant, reason)
        for uid in uids:
            self.ended(uid)

    def admitted(self, uid: int) -> None:
        sample = self.samples.get(uid)
        if sample is not None and sample.queued:
            sample.queued = False
            self.quotas.started(sample.tenant)
            self._hold(sample.tenant, 0, -1)

    def tokens(self, uids: Iterable[int], now: float) -> None:
        counts: dict[str, int] = {}
        for uid in uids:
            sample = self.samples.get(uid)
            if sample is not None:
                counts[sample.tenant] = counts.get(sample.tenant, 0) + 1
        for tenant, count in counts.items():
            self._served(tenant).output_tokens += count
            self.quotas.served(tenant, count, now)
            if self.observer is not None:
                self.observer.served(self.label(tenant), count)

    def ended(self, uid: int) -> None:
        sample = self.samples.pop(uid, None)
        if sample is not None:
            self.calls.pop(uid, None)
            self.pending.pop(uid, None)
            self.quotas.ended(sample.tenant, sample.queued)
            self._hold(sample.tenant, -1, -1 if sample.queued else 0)

    def _rejected(self, tenant: str, reason: str) -> None:
        self._served(tenant).rejected += 1
        if self.observer is not None:
            self.observer.rejected(self.label(tenant), reason)

    def _hold(self, tenant: str, concurrent: int, queued: int) -> None:
        label = self.label(tenant)
        held = self.held.setdefault(label, [0, 0])
        held[0] += concurrent
        held[1] += queued
        if self.observer is not None:
            self.observer.holding(label, held[0], held[1])

    def report(self) -> list[tuple[str, Served]]:
        """Per-tenant totals, bounded: the table's tenants and then the busiest others up to
        `max_metric_tenants` by name, the rest summed under "other"."""
        cap = self.table.max_metric_tenants
        named = [t for t in self.served if t in self.table.tenants]
        rest = sorted((t for t in self.served if t not in self.table.tenants), key=self._weight, reverse=True)
        keep = sorted(named, key=self._weight, reverse=True)[:cap]
        keep += rest[: max(0, cap - len(keep))]
        shown = set(keep)
        other = Served()
        for tenant, served in self.served.items():
            if tenant not in shown:
                other.requests += served.requests
                other.prompt_tokens += served.prompt_tokens
                other.output_tokens += served.output_tokens
                other.rejected += served.rejected
        report = [(t, self.served[t]) for t in sorted(keep)]
        if len(shown) < len(self.served):
            report.append((OTHER, other))
        return report

    def held_now(self, shown: Collection[str]) -> dict[str, tuple[int, int]]:
        """(concurrent, queued) of each tenant in `shown` (a report's rows), and of every other one
        summed under OTHER, as the report sums their totals."""
        held: dict[str, tuple[int, int]] = {}
        for tenant, usage in self.quotas.usage.items():
            row = tenant if tenant in shown and tenant != OTHER else OTHER
            concurrent, queued = held.get(row, (0, 0))
            held[row] = (concurrent + usage.concurrent, queued + usage.queued)
        return held

    def _weight(self, tenant: str) -> tuple[int, str]:
        served = self.served[tenant]
        return served.prompt_tokens + served.output_tokens + served.rejected, tenant

    def _served(self, tenant: str) -> Served:
        served = self.served.get(tenant)
        if served is None and tenant not in self.table.tenants and len(self.served) >= MAX_COUNTED:
            tenant, served = OTHER, self.served.get(OTHER)
        if served is None:
            served = self.served[tenant] = Served()
        return served
