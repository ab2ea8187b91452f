"""Per-tenant quotas: concurrent requests, queued requests and a token bucket over weighted tokens.

Plain and synchronous: the caller passes the clock in and applies the decision. A request is
checked once, when it arrives at the core; what it then costs is booked as it happens (its prompt
at admission, each output token as it is served), so a tenant whose outputs ran long pays for it
with its next requests. The bucket may go into debt (a request needs only a positive balance, so
one larger than the burst still passes once the tenant's earlier use is paid for); the retry-after
is the time the refill takes to bring the balance back above zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.tenants.table import Tenant, TenantTable


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is over its tenant's quota, and when a retry may pass (seconds)."""

    field: str
    message: str
    retry_after_s: float


@dataclass(slots=True)
class Bucket:
    """A token bucket: `level` weighted tokens at time `at`; refills at `rate` up to `burst`."""

    level: float
    at: float

    def refill(self, tenant: Tenant, now: float) -> None:
        if now > self.at:
            self.level = min(tenant.token_burst, self.level + (now - self.at) * tenant.token_rate)
            self.at = now


@dataclass(slots=True)
class Usage:
    """What one tenant holds now."""

    concurrent: int = 0
    queued: int = 0
    bucket: Bucket | None = None


# A retry sooner than this would only be refused again (the refill is continuous).
MIN_RETRY_S = 1.0
# Holdings kept before the first sweep forgets the tenants that hold nothing and whose buckets have
# refilled; later sweeps wait for twice what the last one kept (amortized, whatever names arrive).
SWEEP_FLOOR = 1024


@dataclass(slots=True)
class Quotas:
    """Every tenant's holdings under a table (which a reload replaces: holdings carry over)."""

    table: TenantTable
    usage: dict[str, Usage] = field(default_factory=dict)
    sweep_at: int = SWEEP_FLOOR

    def check(self, tenant: str, samples: int, prompt_tokens: int, now: float) -> Refusal | None:
        """Whether a call of `samples` samples may start; on None it is booked as started."""
        if len(self.usage) >= self.sweep_at:
            self._sweep(now)
        entry = self.table.entry(tenant)
        usage = self.usage.setdefault(tenant, Usage())
        limit = entry.max_concurrent_requests
        if limit and usage.concurrent + samples > limit:
            message = f"tenant {tenant!r} has {usage.concurrent} requests running of its {limit}"
            return Refusal("max_concurrent_requests", message, MIN_RETRY_S)
        limit = entry.max_queued_requests
        if limit and usage.queued + samples > limit:
            message = f"tenant {tenant!r} has {usage.queued} requests queued of its {limit}"
            return Refusal("max_queued_requests", message, MIN_RETRY_S)
        bucket = self._bucket(entry, usage, now)
        if bucket is not None and bucket.level <= 0:
            wait = max(MIN_RETRY_S, -bucket.level / entry.token_rate)
            message = f"tenant {tenant!r} used its token rate ({entry.token_rate:g} weighted tokens/s)"
            return Refusal("token_rate", message, wait)
        usage.concurrent += samples
        usage.queued += samples
        if bucket is not None:
            bucket.level -= samples * prompt_tokens * self.table.prompt_weight
        return None

    def refund(self, tenant: str, samples: int, prompt_tokens: int) -> None:
        """A call `check` booked was refused after all: its prompt goes back into the bucket (up to
        the burst; holdings are released by `ended`)."""
        usage = self.usage.get(tenant)
        bucket = usage.bucket if usage is not None else None
        if bucket is not None:
            charged = samples * prompt_tokens * self.table.prompt_weight
            bucket.level = min(self.table.entry(tenant).token_burst, bucket.level + charged)

    def started(self, tenant: str) -> None:
        """A sample's first prefill: it no longer counts as queued."""
        usage = self.usage.get(tenant)
        if usage is not None and usage.queued > 0:
            usage.queued -= 1

    def served(self, tenant: str, output_tokens: int, now: float) -> None:
        usage = self.usage.get(tenant)
        if usage is None:
            return
        bucket = self._bucket(self.table.entry(tenant), usage, now)
        if bucket is not None:
            bucket.level -= output_tokens * self.table.output_weight

    def ended(self, tenant: str, queued: bool) -> None:
        """A sample finished (or its call was refused); `queued`: it never had a prefill."""
        usage = self.usage.get(tenant)
        if usage is None:
            return
        usage.concurrent = max(0, usage.concurrent - 1)
        if queued:
            usage.queued = max(0, usage.queued - 1)
        # A tenant holding nothing and owing nothing is forgotten (a full bucket is a new one), so
        # the holdings stay as many as the tenants with requests live or in debt.
        bucket = usage.bucket
        idle_bucket = bucket is None or bucket.level >= self.table.entry(tenant).token_burst
        if not usage.concurrent and not usage.queued and idle_bucket:
            del self.usage[tenant]

    def _sweep(self, now: float) -> None:
        """Forget the tenants holding nothing whose buckets are full again by now: `ended` keeps one
        whose bucket is still refilling (its debt stands), so without keys, where callers may name
        any tenant, these would otherwise pile up one per name."""
        for tenant, usage in list(self.usage.items()):
            if usage.concurrent or usage.queued:
                continue
            entry = self.table.entry(tenant)
            bucket = self._bucket(entry, usage, now)
            if bucket is None or bucket.level >= entry.token_burst:
                del self.usage[tenant]
        self.sweep_at = max(SWEEP_FLOOR, 2 * len(self.usage))

    def _bucket(self, entry: Tenant, usage: Usage, now: float) -> Bucket | None:
        if not entry.token_rate:
            usage.bucket = None
            return None
        if usage.bucket is None:
            usage.bucket = Bucket(entry.token_burst, now)
        usage.bucket.refill(entry, now)
        return usage.bucket
