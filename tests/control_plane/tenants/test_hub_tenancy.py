"""The hub's side of tenancy, in process: an arrival's tenant and latency defaults, its quota check,
and the release of what it held through the publisher hooks (verdict, admission, tokens, finish)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from control_plane.config import ControlConfig
from control_plane.core.fleet import Router
from control_plane.core.hub import FrontendHub
from control_plane.core.inbox import Verdict
from control_plane.core.server_info import tenant_infos
from control_plane.request import FinishReason, RequestParams
from control_plane.tenants.book import OTHER, TenantBook
from control_plane.tenants.table import parse
from protos.stepwise.v1 import frontend_pb2 as fe_pb
from protos.stepwise.v1 import generation_pb2 as gen_pb
from tests.control_plane.tenants.test_quota import Recorder

KEY = "key:0123456789ab"


def hub(table: dict[str, object] | None) -> FrontendHub:
    made = FrontendHub(ControlConfig(model_dir=Path(".")), Router("m"), gen_pb.ServerInfo)
    if table is not None:
        made.tenants = TenantBook.of(parse(table))
    return made


def test_without_a_table_the_tenant_is_the_named_one_or_the_key_and_nothing_is_checked() -> None:
    plain = hub(None)
    msg = fe_pb.Arrival(uids=[1], owner=KEY, authenticated=True)
    params = plain._tenancy(msg, RequestParams())
    assert params is not None and params.tenant == KEY
    msg = fe_pb.Arrival(uids=[1], owner="ipv4:127.0.0.1:1", tenant="bob")
    params = plain._tenancy(msg, RequestParams())
    assert params is not None and params.tenant == "bob"
    assert all(plain._within_quota("bob", (i,), 10**6) for i in range(100))


def test_the_hub_leaves_a_tenants_latency_defaults_to_the_scheduler() -> None:
    """The scheduler applies them (SchedulerConfig.tenant_slo, kept current on a reload): the hub
    passes the request's own objectives on unchanged."""
    h = hub({"tenants": {"a": {"keys": [KEY], "ttft_slo_ms": 2000, "tpot_slo_ms": 100}}})
    msg = fe_pb.Arrival(uids=[1], owner=KEY, authenticated=True)
    params = h._tenancy(msg, RequestParams(tpot_slo_ms=50.0))
    assert params is not None
    assert (params.tenant, params.ttft_slo_ms, params.tpot_slo_ms) == ("a", 0.0, 50.0)


def test_a_key_naming_a_tenant_it_may_not_is_refused() -> None:
    h = hub({"tenants": {"a": {"keys": [KEY]}}})
    msg = fe_pb.Arrival(uids=[1], owner=KEY, authenticated=True, tenant="b")
    assert h._tenancy(msg, RequestParams()) is None


def test_holdings_are_released_by_the_publisher_hooks() -> None:
    h = hub({"defaults": {"max_concurrent_requests": 2, "max_queued_requests": 1}})
    book = h.tenants
    assert book is not None
    assert h._within_quota("t", (1,), 5)
    assert not h._within_quota("t", (2,), 5)  # one queued already
    h.admitted(1, 0, 0.0, "w0")
    assert h._within_quota("t", (3,), 5)
    assert not h._within_quota("t", (4,), 5)  # two running or queued
    h.tokens(np.asarray([1, 1, 3], dtype=np.uint64), np.asarray([7, 8, 9], dtype=np.int32))
    assert book.served["t"].output_tokens == 3
    h.finished(1, FinishReason.stop("eos"), 0)
    # The scheduler refused call 3 after the quota passed it (QUEUE_FULL, say): it holds nothing,
    # and is rejected like calls 2 and 4.
    h.verdict(3, Verdict.QUEUE_FULL, "queue full")
    assert "t" not in book.quotas.usage
    assert book.served["t"].rejected == 3


def test_a_call_the_scheduler_refuses_is_not_charged() -> None:
    """Refused after the quota passed it (its SLO cannot be met, say): it counts in no tenant's
    requests or prompt tokens, and its prompt goes back into the token bucket."""
    h = hub({"defaults": {"token_rate": 100.0}})
    book = h.tenants
    assert book is not None
    assert h._within_quota("t", (1,), 80)
    level = book.quotas.usage["t"].bucket
    assert level is not None and level.level == 20.0
    h.verdict(1, Verdict.QUEUE_FULL, "ttft_slo_ms: unmeetable")
    assert "t" not in book.served or (book.served["t"].requests, book.served["t"].prompt_tokens) == (0, 0)
    # The bucket is full again: a call of the whole burst passes, and the next is refused.
    assert h._within_quota("t", (2,), 200)
    h.verdict(2, Verdict.ACCEPTED)
    assert not h._within_quota("t", (3,), 1)  # in debt by the second's 100 tokens
    assert (book.served["t"].requests, book.served["t"].prompt_tokens) == (1, 200)


def test_every_refusal_counts_once_in_its_tenants_rejected() -> None:
    """A call the scheduler refuses after the quotas passed it (its SLO cannot be met, say) counts in
    `rejected` like a quota refusal, in GetServerInfo and in /metrics (labelled by why); a quota
    refusal, whose verdict also goes through the hub, still counts once."""
    seen = Recorder()
    h = hub(None)
    h.tenants = TenantBook.of(parse({"tenants": {"a": {"max_concurrent_requests": 1}}}), seen)
    assert h._within_quota("a", (1,), 5)
    h.verdict(1, Verdict.SLO_UNMEETABLE, "ttft_slo_ms: the predicted time to first token exceeds it")
    assert h._within_quota("a", (2,), 5)
    h.verdict(2, Verdict.ACCEPTED)
    assert not h._within_quota("a", (3,), 5)  # over max_concurrent_requests: the hub answers it
    assert h._within_quota("b", (4, 5), 5)
    h.verdict(4, Verdict.QUEUE_FULL, "The request queue is full.")
    h.verdict(6, Verdict.INVALID, "prompt: too long")  # refused before any quota: no tenant to count
    rows = {info.name: info for info in tenant_infos(h.tenants)}
    assert (rows["a"].requests, rows["a"].rejected) == (1, 2)
    assert (rows["b"].requests, rows["b"].rejected) == (0, 1)
    rejected = [e for e in seen.events if e[0] == "rejected"]
    assert rejected == [
        ("rejected", "a", "ttft_slo_ms"),
        ("rejected", "a", "max_concurrent_requests"),
        ("rejected", OTHER, "queue_full"),
    ]


def test_server_info_s_other_row_holds_what_the_tenants_summed_in_it_hold() -> None:
    """GetServerInfo shows the table's tenants and the busiest others up to max_metric_tenants, the
    rest as "other": that row's `concurrent` and `queued` are theirs, as its totals are."""
    h = hub(None)
    h.tenants = TenantBook.of(parse({"max_metric_tenants": 1, "tenants": {"a": {}}}))
    for uid, tenant in enumerate(["a", "a", "b", "c", "c"], start=1):
        assert h._within_quota(tenant, (uid,), 5)
        h.verdict(uid, Verdict.ACCEPTED)
    h.admitted(4, 0, 0.0, "w0")
    rows = {info.name: (info.requests, info.concurrent, info.queued) for info in tenant_infos(h.tenants)}
    assert rows == {"a": (2, 2, 2), OTHER: (3, 3, 2)}
