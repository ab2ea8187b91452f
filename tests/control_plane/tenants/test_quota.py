"""Quotas from plain values: concurrency, queue and token-bucket limits, their retry-after, and
properties over random sequences of arrivals, admissions, tokens and finishes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.tenants.book import OTHER, TenantBook
from control_plane.tenants.quota import MIN_RETRY_S, Quotas
from control_plane.tenants.table import parse


def quotas(**entry: object) -> Quotas:
    return Quotas(parse({"tenants": {"t": entry}}))


def test_no_limits_no_refusals() -> None:
    q = Quotas(parse({}))
    for i in range(1000):
        assert q.check("anyone", 1, 10_000, float(i)) is None


def test_concurrency_limit_counts_until_the_end() -> None:
    q = quotas(max_concurrent_requests=2)
    assert q.check("t", 1, 5, 0.0) is None
    assert q.check("t", 1, 5, 0.0) is None
    refusal = q.check("t", 1, 5, 0.0)
    assert refusal is not None and refusal.field == "max_concurrent_requests"
    assert refusal.retry_after_s == MIN_RETRY_S
    # Admission into a prefill does not free a concurrency slot; the end does.
    q.started("t")
    assert q.check("t", 1, 5, 0.0) is not None
    q.ended("t", queued=False)
    assert q.check("t", 1, 5, 0.0) is None
    # Other tenants are not disturbed.
    assert q.check("u", 5, 5, 0.0) is None


def test_a_call_of_n_samples_counts_n() -> None:
    q = quotas(max_concurrent_requests=3)
    refusal = q.check("t", 4, 5, 0.0)
    assert refusal is not None and refusal.field == "max_concurrent_requests"
    assert q.check("t", 3, 5, 0.0) is None


def test_queue_limit_frees_at_the_first_prefill() -> None:
    q = quotas(max_queued_requests=1)
    assert q.check("t", 1, 5, 0.0) is None
    refusal = q.check("t", 1, 5, 0.0)
    assert refusal is not None and refusal.field == "max_queued_requests"
    q.started("t")
    assert q.check("t", 1, 5, 0.0) is None


def test_token_bucket_charges_weighted_tokens_and_says_when_to_retry() -> None:
    # 100 weighted tokens a second, burst 200: a prompt costs 1 a token, an output token 2.
    q = quotas(token_rate=100.0, token_burst=200.0)
    assert q.check("t", 1, 150, 0.0) is None  # 200 -> 50
    q.served("t", 50, 0.0)  # 50 - 100 -> -50
    refusal = q.check("t", 1, 1, 0.0)
    assert refusal is not None and refusal.field == "token_rate"
    assert refusal.retry_after_s == MIN_RETRY_S  # 0.5 s of refill, rounded up to the floor
    q.served("t", 200, 0.0)  # -450: 4.5 s to pay back
    refusal = q.check("t", 1, 1, 0.0)
    assert refusal is not None and abs(refusal.retry_after_s - 4.5) < 1e-9
    assert q.check("t", 1, 1, 4.0) is not None
    assert q.check("t", 1, 1, 4.6) is None
    # The bucket never holds more than its burst however long it rests.
    q.check("t", 0, 0, 1e6)
    bucket = q.usage["t"].bucket
    assert bucket is not None and bucket.level <= 200.0


def test_what_is_kept_is_bounded_by_the_tenants_refilling_not_every_name_ever_seen() -> None:
    """Without API keys a caller names any tenant: 20,000 made-up names, one call each, a tenth of a
    second apart, each leaving its bucket half spent (0.5 s to refill). The holdings kept are the
    few still refilling (a debt still stands), not all 20,000."""
    q = Quotas(parse({"defaults": {"token_rate": 100.0}}))
    for i in range(20_000):
        now = i * 0.1
        assert q.check(f"made-up-{i}", 1, 50, now) is None
        q.ended(f"made-up-{i}", queued=True)
        assert len(q.usage) <= 2 * 1024
    # A tenant still in debt is not forgotten: its next call waits for the refill.
    assert q.check("spender", 1, 100, 2000.0) is None
    q.served("spender", 100, 2000.0)
    q.ended("spender", queued=True)
    for i in range(5000):
        q.check(f"other-{i}", 1, 1, 2000.0)
        q.ended(f"other-{i}", queued=True)
    refusal = q.check("spender", 1, 1, 2000.0)
    assert refusal is not None and refusal.field == "token_rate"


def test_a_reload_keeps_holdings_and_applies_new_limits() -> None:
    q = quotas(max_concurrent_requests=10)
    for _ in range(3):
        assert q.check("t", 1, 1, 0.0) is None
    q.table = parse({"tenants": {"t": {"max_concurrent_requests": 3}}})
    assert q.check("t", 1, 1, 0.0) is not None
    q.ended("t", queued=True)
    assert q.check("t", 1, 1, 0.0) is None


EVENTS = st.lists(
    st.tuples(st.sampled_from(["arrive", "admit", "tokens", "end"]), st.integers(0, 3), st.integers(1, 300)),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(EVENTS)
def test_holdings_never_exceed_limits_and_return_to_zero(events: list[tuple[str, int, int]]) -> None:
    """Whatever the order of events, a tenant never holds more than its limits, the counts never go
    negative, and once every sample ends nothing is held."""
    table = parse(
        {
            "defaults": {"max_concurrent_requests": 3, "max_queued_requests": 2, "token_rate": 50.0},
        }
    )
    book = TenantBook.of(table)
    live: list[int] = []
    next_uid = 1
    now = 0.0
    for kind, who, size in events:
        now += 0.1
        tenant = f"t{who}"
        if kind == "arrive":
            uids = (next_uid,)
            next_uid += 1
            if book.arrive(tenant, uids, size, now) is None:
                book.accepted(uids[0])
                live.extend(uids)
        elif kind == "admit" and live:
            book.admitted(live[size % len(live)])
        elif kind == "tokens" and live:
            book.tokens([live[size % len(live)]] * (size % 5), now)
        elif kind == "end" and live:
            book.ended(live.pop(size % len(live)))
        for usage in book.quotas.usage.values():
            assert 0 <= usage.queued <= usage.concurrent <= 3
            assert usage.queued <= 2
    for uid in live:
        book.ended(uid)
    assert all(u.concurrent == 0 and u.queued == 0 for u in book.quotas.usage.values())
    served = sum(s.requests for s in book.served.values())
    assert served == next_uid - 1 - sum(s.rejected for s in book.served.values())


def test_a_refused_call_frees_every_sample() -> None:
    book = TenantBook.of(parse({"defaults": {"max_concurrent_requests": 4}}))
    assert book.arrive("t", (1, 2, 3), 10, 0.0) is None
    assert book.quotas.usage["t"].concurrent == 3
    book.refused(1, "queue_full")  # the scheduler refused the call after the quota passed it
    assert "t" not in book.quotas.usage
    served = book.served["t"]
    assert (served.requests, served.prompt_tokens, served.rejected) == (0, 0, 1)  # counted as refused
    assert book.arrive("t", (4, 5, 6, 7), 10, 0.0) is None


def test_report_is_bounded() -> None:
    book = TenantBook.of(parse({"max_metric_tenants": 3, "tenants": {"named": {}}}))
    for i in range(10):
        book.arrive(f"t{i}", (100 + i,), i + 1, 0.0)
        book.accepted(100 + i)
    book.arrive("named", (1,), 1, 0.0)
    book.accepted(1)
    report = dict(book.report())
    # The table's tenant, then the busiest others, up to 3; the rest as "other".
    assert set(report) == {"named", "t9", "t8", OTHER}
    assert report[OTHER].requests == 8
    assert sum(s.prompt_tokens for s in report.values()) == sum(range(1, 11)) + 1


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def admitted(self, label: str, samples: int, prompt_tokens: int) -> None:
        self.events.append(("admitted", label, samples, prompt_tokens))

    def rejected(self, label: str, quota: str) -> None:
        self.events.append(("rejected", label, quota))

    def served(self, label: str, tokens: int) -> None:
        self.events.append(("served", label, tokens))

    def holding(self, label: str, concurrent: int, queued: int) -> None:
        self.events.append(("holding", label, concurrent, queued))


def test_metric_labels_are_the_tables_first_tenants_and_other() -> None:
    table = parse({"max_metric_tenants": 1, "tenants": {"a": {"max_concurrent_requests": 1}, "b": {}}})
    seen = Recorder()
    book = TenantBook.of(table, seen)
    assert book.arrive("a", (1,), 3, 0.0) is None
    book.accepted(1)
    assert book.arrive("a", (2,), 3, 0.0) is not None
    assert book.arrive("b", (3,), 4, 0.0) is None  # past the cap: "other"
    book.accepted(3)
    assert book.arrive("key:0123456789ab", (4,), 5, 0.0) is None
    book.accepted(4)
    book.admitted(3)
    book.tokens([1, 3, 3, 4], 0.0)
    book.ended(3)
    assert seen.events == [
        ("holding", "a", 1, 1),
        ("admitted", "a", 1, 3),
        ("rejected", "a", "max_concurrent_requests"),
        ("holding", OTHER, 1, 1),
        ("admitted", OTHER, 1, 4),
        ("holding", OTHER, 2, 2),
        ("admitted", OTHER, 1, 5),
        ("holding", OTHER, 2, 1),
        ("served", "a", 1),
        ("served", OTHER, 2),
        ("served", OTHER, 1),
        ("holding", OTHER, 1, 1),
    ]
    # A reload that names b recounts what each label holds from the live samples.
    seen.events.clear()
    book.reload(parse({"max_metric_tenants": 2, "tenants": {"a": {}, "key:0123456789ab": {}}}))
    expected = [("holding", "a", 1, 1), ("holding", OTHER, 0, 0), ("holding", "key:0123456789ab", 1, 1)]
    assert sorted(seen.events, key=str) == sorted(expected, key=str)
