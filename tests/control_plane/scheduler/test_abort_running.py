"""Aborting a request that holds its KV past its prefill's planning (docs/scheduler.md#aborts).

SGLang (`managers/scheduler.py:Scheduler.abort_request`, "abort method 3") only sets `req.to_finish`
for a request of the running batch or the last batch: it stays in its batch with its KV and its
reservation, is decoded once more, and ends at that result (`Req.update_finish_state` checks `to_finish`
first) with its KV cached like any finished request's (`release_kv_cache`, inserting). Its client's
call has ended already: the finish is published at the abort, its last token never.
"""

from __future__ import annotations

from control_plane.request import AbortCode, FinishKind, FinishReason
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import StepKind, StepPlan, StepResult
from tests.control_plane.factories import (
    EOS,
    FakeWorker,
    add,
    by_rid,
    check_pool,
    finishes,
    make_scheduler,
    params,
    prompt,
    run_plan,
)

CANCELLED = FinishReason.abort("cancelled", AbortCode.CANCELLED)


class Driver:
    """One scheduler against a fake worker (no EOS), results applied before the next plan unless a
    plan is held back (`plan_only`), as under overlap."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.worker = FakeWorker(sched.capacity, eos=EOS)
        self.rid_of: dict[int, str] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.held: list[StepResult] = []

    def plan_only(self) -> StepPlan:
        """Plan, and let the worker run it (checking its books), keeping the result back."""
        plan = self.sched.next_plan()
        assert plan is not None
        self.rid_of.update((seq.handle, seq.request_id) for seq in plan.new_seqs)
        self.held.append(run_plan(self.sched, self.worker, plan))
        self._collect()
        return plan

    def apply_oldest(self) -> None:
        self.sched.apply_result(self.held.pop(0))
        self._collect()
        check_pool(self.sched)

    def step(self) -> StepPlan:
        plan = self.plan_only()
        self.apply_oldest()
        return plan

    def decoded(self, plan: StepPlan) -> list[str]:
        return [self.rid_of[h] for h in plan.decodes.handles.tolist()]

    def extended(self, plan: StepPlan) -> list[str]:
        return [self.rid_of[h] for h in plan.extends.handles.tolist()]

    def abort(self, rid: str) -> None:
        assert self.sched.abort(rid, CANCELLED)
        self._collect()

    def _collect(self) -> None:
        updates = self.sched.take_updates()
        for rid, tokens in by_rid(updates).items():
            assert rid not in self.finished, f"{rid} streamed after its finish"
            self.tokens.setdefault(rid, []).extend(tokens)
        for rid, reason in finishes(updates).items():
            assert rid not in self.finished, f"{rid} finished twice"
            self.finished[rid] = reason


def cached_len(sched: Scheduler, ids: list[int]) -> int:
    return len(sched.kv.tree.match_prefix(ids).indices)


def two_decoding() -> Driver:
    d = Driver(make_scheduler(capacity=1000))
    for rid, seed in (("a", 1), ("b", 2)):
        add(d.sched, rid, prompt(20, seed), params(50, ignore_eos=True))
    assert d.extended(d.step()) == ["a", "b"]
    assert d.decoded(d.step()) == ["a", "b"]
    return d


def test_an_aborted_running_request_is_decoded_once_more_then_cached() -> None:
    """The minimal case: two decoding, one aborted. SGLang's next decode holds both (freeing the aborted one
    at once left "b" alone in it); the aborted one ends at that result, its token unstreamed, and its
    prompt and outputs go into the tree."""
    d = two_decoding()
    a = d.sched.requests["a"]
    streamed = list(d.tokens["a"])
    assert len(streamed) == 2
    d.abort("a")
    # The client's call ends now: its finish is published at once and "a" is no longer live.
    assert d.finished["a"] == CANCELLED and "a" not in d.sched.requests
    assert d.sched.running_request("a") is None and not d.sched.abort("a", CANCELLED)
    assert d.sched.books()[0] == 2  # the worker still holds its sequence
    plan = d.step()
    assert plan.kind is StepKind.DECODE and d.decoded(plan) == ["a", "b"]
    assert d.tokens["a"] == streamed  # its last token is not streamed
    assert a.finished_reason == CANCELLED and a.req_pool_idx == -1 and a.num_outputs == 3
    # Cached like a finish: prompt and every output whose KV was computed (the third has none yet).
    fill = a.origin_input_ids + a.output_ids
    assert cached_len(d.sched, fill) == 22
    plan = d.step()
    assert d.decoded(plan) == ["b"] and a.handle == -1 and d.rid_of[int(plan.releases[0])] == "a"
    assert d.sched.books()[0] == 1


def test_an_abort_after_the_last_prefill_is_planned_takes_effect_at_its_first_decode() -> None:
    """Aborted between its prefill's result and the next plan (in SGLang's last batch): it is merged and
    decoded like the others, then ends with its prompt and first output cached."""
    d = Driver(make_scheduler(capacity=1000))
    add(d.sched, "a", prompt(20, 1), params(50, ignore_eos=True))
    assert d.extended(d.step()) == ["a"]
    assert len(d.tokens["a"]) == 1
    d.abort("a")
    assert d.decoded(d.step()) == ["a"]
    a = d.sched.requests.get("a")
    assert a is None and d.tokens["a"] == d.tokens["a"][:1] and d.sched.is_idle is False
    assert cached_len(d.sched, prompt(20, 1) + d.tokens["a"]) == 21
    plan = d.step()  # its release
    assert d.rid_of[int(plan.releases[0])] == "a" and d.sched.is_idle


def test_under_overlap_the_result_in_flight_ends_it() -> None:
    """SGLang's overlap loop: the plan after the abort still decodes it, and the result of the plan
    before (processed after that one is launched) ends it; the later token is discarded (its row is
    gone)."""
    d = two_decoding()
    d.plan_only()  # plan N: decodes both, its result not applied
    d.abort("a")
    a = d.sched.by_handle[next(h for h, r in d.rid_of.items() if r == "a")]
    later = d.plan_only()  # plan N + 1: "a" is still in the batch
    assert d.decoded(later) == ["a", "b"]
    d.apply_oldest()  # N's result ends it
    assert a.finished and a.req_pool_idx == -1 and len(d.tokens["a"]) == 2
    d.apply_oldest()  # N + 1's token for "a" is discarded
    assert len(d.tokens["a"]) == 2
    assert d.decoded(d.step()) == ["b"]


def test_an_abort_during_another_requests_chunked_prefill_keeps_its_kv_until_its_decode() -> None:
    """ "a" (20-token prompt, 400 new) decodes; "long" (150 tokens, chunk 64) is being chunked; "c" (30
    tokens, 100 new) waits; "a" is aborted. Prefill steps do not decode it, so it keeps its KV, its prompt
    locked, through the chunks: at the last chunk rem_total = 430 + 0 − 279.3 − 21 = 129.7 and "c" needs
    30 + 100 + 1 = 131, so it waits. "a" is decoded once more after the chunks and ends; the pass after
    still counts its reservation (a finished request stays in the running batch until the decode step's
    filter), and "c" is admitted the pass after that. Freed at once, its 20 prompt tokens were evictable
    at the last chunk (rem_total 149.7) and "c" joined that step, three steps early."""
    d = Driver(make_scheduler(capacity=600, chunked_prefill_size=64))
    add(d.sched, "a", prompt(20, 1), params(400, ignore_eos=True))
    assert d.extended(d.step()) == ["a"]
    add(d.sched, "long", prompt(150, 2), params(20, ignore_eos=True))
    assert d.extended(d.step()) == ["long"]  # its first chunk
    add(d.sched, "c", prompt(30, 3), params(100, ignore_eos=True))
    d.abort("a")
    assert d.extended(d.step()) == ["long"]
    plan = d.step()
    assert d.extended(plan) == ["long"] and plan.extends.sample.tolist() == [True]  # the last chunk
    assert [r.rid for r in d.sched.waiting] == ["c"]
    assert d.decoded(d.step()) == ["a", "long"]
    assert d.decoded(d.step()) == ["long"]
    assert d.extended(d.step()) == ["c"]


def test_a_queued_or_mid_chunk_abort_frees_at_once_as_before() -> None:
    d = Driver(make_scheduler(capacity=600, chunked_prefill_size=64))
    add(d.sched, "long", prompt(150, 2), params(20, ignore_eos=True))
    add(d.sched, "q", prompt(10, 3), params(20, ignore_eos=True))
    assert d.extended(d.step()) == ["long"]
    d.abort("q")
    d.abort("long")
    assert d.finished["q"] == CANCELLED and "long" not in d.finished  # at the top of the next plan
    plan = d.plan_only()
    assert d.finished["long"] == CANCELLED
    assert d.rid_of[int(plan.releases[0])] == "long" and d.sched.chunked_req is None
    assert cached_len(d.sched, prompt(150, 2)) == 0  # nothing of it inserted


def test_a_request_aborted_and_retracted_goes_back_to_the_queue_and_ends_at_its_re_prefill() -> None:
    """SGLang's retraction does not look at to_finish: a marked request it retracts is re-queued with the
    mark, re-prefilled when admitted, and ends at that prefill's result (cached, never streamed again)."""
    d = two_decoding()
    a = d.sched.requests["a"]
    d.abort("a")
    d.sched.retraction.release_for_requeue(a, remaining=1)
    d.sched.running.remove([a])
    d.sched.intake.requeue(a)
    plan = d.step()
    assert d.extended(plan) == ["a"] and a.finished and a.finished_reason is CANCELLED
    assert len(d.tokens["a"]) == 2 and a.num_outputs == 3
    assert d.finished["a"] == CANCELLED and FinishKind.ABORT is CANCELLED.kind
