"""Step isolation between tenants (docs/scheduler.md#fairness-isolation), `--fairness-isolation-tokens T`.

VTC picks who is admitted next, but a request's time to first token is mostly the steps ahead of
it: under overlap scheduling a request that arrives while a step runs waits for the rest of that
step, for the step already planned, then for its own. A tenant that floods keeps every one of
them full (2,048-token prefill steps back to back), and its prompts fill the newcomer's own step
behind it. So, while a tenant that holds less than its weighted share of the running batch (a
*light* tenant) has requests live, the tenants above their share (*heavy*) are held to short
steps:

- their prompt tokens in one step (new requests and the chunk in progress) are at most T;
- the light tenants' waiting requests go ahead of theirs (VTC's order kept within each side);
- a step that admits a light tenant's request admits no heavy prompt, and the heavy chunk in
  progress sits that step out while anything runs (a running request always frees its room in
  the end, so the chunk never waits for ever) if the light request fits the step whole;
- a light tenant's request that finds the running batch full takes the slot of one heavy running
  request (fair_preemption.py), as long as its tenant stays within its share with it (so two
  tenants never take a slot back and forth);
- with R (`--fairness-isolation-running`), heavy tenants hold at most R running requests
  together, so a decode step stays short too.
- with the decode turn (`--fairness-isolation-decode-turn`), a step of heavy prompts alone is
  followed by one without them while a light tenant has requests running (prefill first would
  keep them from decoding for as long as the heavy tenants are backlogged).

Shares are counted in the context tokens (prompt and output so far) of the running requests, the
one mid-chunk included, each tenant's share in proportion to its weight among the tenants with
requests running or waiting. Tokens, not requests: a decode row costs its context and a request
holds its KV, so a flood of long prompts is the heavy one even where the light tenant's short
requests outnumber its own (with prefill first, decodes wait while the flood is backlogged, and
both tenants' running requests pile up). With a grace G
(`--fairness-isolation-grace`), a tenant also counts (as light, with nothing running) for G
seconds of the worker's time (the queue clock) after a pass last saw it live: a tenant whose
requests come one at a time would otherwise find the flood back on SGLang's steps at each of
them. With a single tenant, or none heavy, nothing changes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from control_plane.config import SchedulerConfig
from control_plane.request import Request
from control_plane.scheduler.adder import PrefillAdder, T
from control_plane.scheduler.fairness import VirtualCounters
from control_plane.scheduler.queue_clock import QueueClock

NO_TENANTS: frozenset[str] = frozenset()


@dataclass(slots=True)
class Shares:
    """Running requests and the tokens they hold, by tenant, at a pass, and who is above their
    weighted share of the tokens."""

    counts: Counter[str]
    # Σ weights of the tenants with requests live (running or waiting).
    weights: float
    weight: Callable[[str], float]
    # Context tokens (prompt and output so far) of the running requests, by tenant.
    held: Counter[str] = field(default_factory=Counter)
    # Tenants above their share while a tenant not above it has requests live (else empty).
    heavy: frozenset[str] = NO_TENANTS

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def above(self, tenant: str, extra: int = 0) -> bool:
        """Whether `tenant`, with `extra` more tokens running, is above its share."""
        return (self.held[tenant] + extra) * self.weights > (self.total + extra) * self.weight(tenant)

    def joined(self, req: Request) -> None:
        """`req` joins the running requests at this pass."""
        self.counts[req.params.tenant] += 1
        self.held[req.params.tenant] += req.seqlen

    @property
    def heavy_running(self) -> int:
        return sum(self.counts[t] for t in self.heavy)

    @property
    def light_running(self) -> bool:
        return any(n for t, n in self.counts.items() if t not in self.heavy)


class StepBudget:
    """One prefill pass under the rule (StepIsolation.begin): the heavy tenants' prompt tokens
    left, their running requests left, and whether a light request was admitted."""

    def __init__(self, shares: Shares, tokens: int, running_cap: int) -> None:
        self.shares = shares
        self.heavy = shares.heavy
        self.left = tokens
        # Heavy requests that may still join the running batch (None: no cap).
        self.running_left = running_cap - shares.heavy_running if running_cap > 0 else None
        self.light_admitted = False
        # A request is still mid-chunk after the continuation (it sat this pass out, or its chunk
        # was held to T): no other request may start a chunk.
        self.chunk_open = False
        # A decode turn: the heavy tenants get nothing this pass (the step before was theirs alone).
        self.closed = False

    def is_heavy(self, req: Request) -> bool:
        return req.params.tenant in self.heavy

    def sits_out(self, chunked: Request, head: Request | None, chunk_budget: int) -> bool:
        """Whether the heavy chunk in progress waits this pass: a light request heads the queue
        and its whole prompt fits the chunk budget (so it is not chunked in turn)."""
        if self.closed and self.is_heavy(chunked):
            return True
        if not self.is_heavy(chunked) or head is None or self.is_heavy(head):
            return False
        return head.seqlen <= chunk_budget

    def allows(self, req: Request) -> bool:
        """Whether the admission loop may try `req` (lights first, so a heavy one ends the pass)."""
        if not self.is_heavy(req):
            return True
        if self.closed:
            return False
        if self.running_left is not None and self.running_left <= 0:
            return False
        return not self.light_admitted and self.left > 0

    def givers(self, req: Request) -> frozenset[str]:
        """The tenants whose running requests give way to `req` for room: the heavy ones, if
        `req`'s tenant stays within its share with one more request running."""
        if self.is_heavy(req) or self.shares.above(req.params.tenant, req.seqlen):
            return NO_TENANTS
        return self.heavy

    def admit(self, adder: PrefillAdder, req: Request, add: Callable[[], T], joins: bool = True) -> T:
        """`add()`: an admission of `req` through `adder` (a waiting request that `joins` the
        running requests, or the chunk in progress), a heavy request's chunk budget held to what is
        left of T; the adder's own chunk budget goes down by what was admitted only."""
        if not self.is_heavy(req):
            verdict = add()
            if adder.can_run_list and adder.can_run_list[-1] is req:
                self.light_admitted = True
                if joins:
                    self.shares.joined(req)
            return verdict
        verdict, used = adder.within_chunk_budget(self.left, add)
        self.left -= used
        if joins and used and self.running_left is not None:
            self.running_left -= 1
        return verdict


class StepIsolation:
    """Which tenants are heavy at a prefill pass, and the light-first order (module doc)."""

    def __init__(self, config: SchedulerConfig, counters: VirtualCounters, clock: QueueClock) -> None:
        self.config = config
        self.counters = counters
        self.tokens = config.fairness_isolation_tokens
        self.running_cap = config.fairness_isolation_running
        self.grace = config.fairness_isolation_grace
        self.decode_turn = config.fairness_isolation_decode_turn
        self.clock = clock
        # Tenant -> the queue clock's busy seconds at the latest pass that saw it live (with a grace;
        # entries older than the grace are dropped, so it holds the recent tenants only).
        self.seen: dict[str, float] = {}
        # Passes that held a heavy tenant back (a budget was in force), and the latest pass's budget
        # (None: the rule was not in force), for tests and figures.
        self.passes_held = 0
        self.last: StepBudget | None = None

    def shares(self, running: Sequence[Request], chunked: Request | None) -> Shares:
        """The running requests' shares (the one mid-chunk included); `heavy` is empty unless a
        light tenant has requests live."""
        counts: Counter[str] = Counter()
        held: Counter[str] = Counter()
        for req in (*running, chunked) if chunked is not None else running:
            counts[req.params.tenant] += 1
            held[req.params.tenant] += req.seqlen
        live = set(counts)
        live.update(t for t, n in self.counters.waiting.items() if n > 0)
        if self.grace > 0:
            live.update(self._recent(live))
        weight = self.config.tenant_weight
        shares = Shares(counts, sum(weight(t) for t in live), weight, held)
        if len(live) < 2:
            return shares
        heavy = frozenset(t for t in counts if shares.above(t))
        if heavy and len(heavy) < len(live):
            shares.heavy = heavy
        return shares

    def _recent(self, live: set[str]) -> list[str]:
        """The tenants seen live within the grace (those live now included)."""
        now = self.clock.busy_s
        for tenant in live:
            self.seen[tenant] = now
        for tenant in [t for t, at in self.seen.items() if now - at > self.grace]:
            del self.seen[tenant]
        return list(self.seen)

    def begin(
        self, waiting: list[Request], shares: Shares, heavy_only_last: bool = False
    ) -> StepBudget | None:
        """This pass's budget (None: no heavy tenant, the pass is SGLang's); the waiting queue,
        already in the policy's order, gets the light tenants' requests first. With the decode
        turn, a pass after a prefill step of heavy prompts alone (`heavy_only_last`) admits none
        while a light tenant has requests running: prefill first would otherwise starve their
        decodes for as long as the heavy tenants are backlogged."""
        self.last = None
        heavy = shares.heavy
        if not heavy:
            return None
        self.passes_held += 1
        light = [r for r in waiting if r.params.tenant not in heavy]
        if light and len(light) < len(waiting):
            waiting[:] = light + [r for r in waiting if r.params.tenant in heavy]
        self.last = StepBudget(shares, self.tokens, self.running_cap)
        self.last.closed = self.decode_turn and heavy_only_last and shares.light_running
        return self.last
