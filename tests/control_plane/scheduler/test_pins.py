"""Hand-built scheduler scenarios that pin rules nothing else pins, each expected value worked out by
hand from docs/scheduler.md (the arithmetic is in the comments, with the section it comes from).

Conventions of every scenario below: page size 1, no chunking (chunked_prefill_size=None), the fake
worker never samples EOS (lengths decide finishes), prompts with different seeds share no prefix.
"""

from __future__ import annotations

import pytest

from control_plane.cache.invariants import check_pool_invariants
from control_plane.core.step_log import retraction_line
from control_plane.request import FinishKind, FinishReason, RequestParams
from control_plane.scheduler.retraction import GROUP_ABORTED
from control_plane.scheduler.scheduler import Scheduler, resolve_max_running_requests
from protos.worker import StepPlan
from tests.control_plane.factories import add, by_rid, finishes, make_scheduler, params, prompt, run_plan
from tests.control_plane.fake_worker import FakeWorker


class Stepper:
    """Drives one scheduler step by step against a fake worker (no EOS), naming requests by rid."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.worker = FakeWorker(sched.capacity)
        self.rid_of: dict[int, str] = {}
        self.finished: dict[str, FinishReason] = {}
        self.tokens: dict[str, int] = {}

    def add(self, rid: str, ids: list[int], p: RequestParams) -> None:
        add(self.sched, rid, ids, p)

    def step(self) -> StepPlan:
        sched = self.sched
        plan = sched.next_plan()
        assert plan is not None
        self._collect()
        self.rid_of.update((seq.handle, seq.request_id) for seq in plan.new_seqs)
        result = run_plan(sched, self.worker, plan)
        sched.apply_result(result)
        self._collect()
        check_pool_invariants(sched.kv.allocator, sched.kv.tree, sched.private_slots())
        return plan

    def _collect(self) -> None:
        updates = self.sched.take_updates()
        for rid, tokens in by_rid(updates).items():
            self.tokens[rid] = self.tokens.get(rid, 0) + len(tokens)
        self.finished.update(finishes(updates))

    def extended(self, plan: StepPlan) -> list[str]:
        return [self.rid_of[h] for h in plan.extends.handles.tolist()]

    def decoded(self, plan: StepPlan) -> list[str]:
        return [self.rid_of[h] for h in plan.decodes.handles.tolist()]

    def released(self, plan: StepPlan) -> list[str]:
        return [self.rid_of[h] for h in plan.releases.tolist()]

    def waiting(self) -> list[str]:
        return [r.rid for r in self.sched.waiting]

    def extend_ranges(self, plan: StepPlan) -> dict[str, tuple[int, int]]:
        ext = plan.extends
        return {
            self.rid_of[h]: (start, start + n)
            for h, start, n in zip(ext.handles.tolist(), ext.starts.tolist(), ext.lens.tolist(), strict=True)
        }

    def preempted(self, plan: StepPlan) -> list[str]:
        """Released in this plan and back in the queue (with no retraction: preempted)."""
        return [rid for rid in self.released(plan) if rid not in self.finished and rid in self.waiting()]

    def run_to_end(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if self.sched.is_idle:
                return
            self.step()
        raise AssertionError("did not finish")


# --- docs/scheduler.md#batch-is-full the batch_is_full life cycle
# ------------------------------------------------------------------


def test_after_no_token_the_queue_is_left_alone_until_a_running_request_finishes() -> None:
    """docs/scheduler.md#batch-is-full: a NO_TOKEN verdict sets batch_is_full; while it is set no
    admission is attempted at all (the LOF policy does not even re-sort the queue,
    docs/scheduler.md#ordering-policies is applied once per attempt). The running set shrinking in
    update_running_batch resets it, and the attempt comes on the
    next step (docs/scheduler.md#step-loop: the
    prefill attempt, step 6, precedes the filter of finished requests, step 7)."""
    s = Stepper(make_scheduler(capacity=200, chunked_prefill_size=None, schedule_policy="lof"))
    s.add("a", prompt(20, 1), params(10))
    assert s.extended(s.step()) == ["a"] and not s.sched.batch_is_full

    # Step 2. a's prompt is cached and locked: available = 200 - 20 = 180, evictable 0. a has 1 of 10 tokens:
    # offset(a) = min(10 - 1, 4096) · 0.7 = 6.3 (docs/scheduler.md#prefill-adder-budgets), rem_total = 180 -
    # 6.3 = 173.7. b: total = 150 + min(40, 4096) + 1 = 191 >= 173.7 -> NO_TOKEN
    # (docs/scheduler.md#add-one-req step 6); a decodes instead.
    s.add("b", prompt(150, 2), params(40))
    plan = s.step()
    assert s.extended(plan) == [] and s.decoded(plan) == ["a"] and s.sched.batch_is_full

    # c would fit (5 + 50 + 1 = 56 < 173.7) and LOF would put it (max_new 50) before b (40), but no
    # attempt is made while the flag is set: steps 3..10 only decode a and the queue stays [b, c].
    s.add("c", prompt(5, 3), params(50))
    for _ in range(3, 11):
        plan = s.step()
        assert s.extended(plan) == [] and s.decoded(plan) == ["a"]
        assert s.sched.batch_is_full and s.waiting() == ["b", "c"]
    # a's 10 tokens: 1 from its prefill (step 1) + 9 decodes (steps 2..10).
    assert s.finished["a"].kind is FinishKind.LENGTH and s.tokens["a"] == 10

    # Step 11: the prefill attempt still sees the flag (a is not filtered yet); the filter then shrinks
    # the running set and resets it. Nothing runs: the plan only releases a.
    plan = s.step()
    assert s.released(plan) == ["a"] and not len(plan.extends) and not len(plan.decodes)
    assert not s.sched.batch_is_full and s.waiting() == ["b", "c"]

    # Step 12: the attempt runs. a's 29 committed tokens are cached and unlocked, so A + E = 200 and
    # nothing runs: rem_total = 200. LOF order: c, b. c: 56 < 200, admitted; rem_total = 200 - 56 = 144.
    # b: 191 >= 144 -> NO_TOKEN again.
    plan = s.step()
    assert s.extended(plan) == ["c"] and s.sched.batch_is_full and s.waiting() == ["b"]


def test_after_no_token_a_retraction_lets_admission_resume() -> None:
    """docs/scheduler.md#batch-is-full / docs/scheduler.md#decode-memory-check step 4: a retraction
    shrinks the running set, which resets batch_is_full; the next
    step attempts admission again (here TEST_RETRACT retracts, docs/scheduler.md#decode-memory-check step
    3, every 3rd forward)."""
    s = Stepper(
        make_scheduler(capacity=200, chunked_prefill_size=None, schedule_policy="lof", test_retract=True)
    )
    s.add("a", prompt(20, 1), params(30))
    s.add("a2", prompt(10, 2), params(30))
    # Step 1 (forward 1): a (20 + 30 + 1 = 51 < 200) and a2 (41 < 200 - 51 = 149) are admitted.
    assert s.extended(s.step()) == ["a", "a2"]

    # Step 2: A = 200 - 30 = 170, offsets 2 · (30 - 1) · 0.7 = 40.6, rem_total = 129.4;
    # b: 150 + 40 + 1 = 191 >= 129.4 -> NO_TOKEN. forward_ct = 1: no test retraction; decode (forward 2).
    s.add("b", prompt(150, 3), params(40))
    plan = s.step()
    assert s.decoded(plan) == ["a", "a2"] and s.sched.batch_is_full
    s.add("c", prompt(5, 4), params(50))
    # Step 3: flag set, no attempt; forward_ct = 2: decode (forward 3).
    plan = s.step()
    assert s.decoded(plan) == ["a", "a2"] and s.waiting() == ["b", "c"] and s.sched.batch_is_full

    # Step 4: flag set, no attempt; forward_ct = 3 -> test retraction (docs/scheduler.md#retraction order:
    # both have 3 outputs, the longer prompt goes first: a). It is re-queued at the back and the flag is
    # reset.
    plan = s.step()
    assert s.sched.last_stats is not None and s.sched.last_stats.retracted == ["a"]
    assert s.decoded(plan) == ["a2"] and not s.sched.batch_is_full
    assert s.waiting() == ["b", "c", "a"]

    # Step 5: the attempt runs. LOF order: c (50), b (40), a (30). c (56) fits; b (191) does not.
    plan = s.step()
    assert s.extended(plan) == ["c"] and s.sched.batch_is_full and s.waiting() == ["b", "a"]


def test_a_prefill_batch_merged_into_an_empty_running_batch_brings_a_fresh_flag() -> None:
    """docs/scheduler.md#batch-is-full / docs/scheduler.md#step-loop step 4: batch_is_full belongs to the
    batch. When the running batch is empty, the last prefill batch becomes the running batch and brings
    its own flag, which is False: the NO_TOKEN verdict of the pass that built it is forgotten and the
    next step attempts admission again."""
    s = Stepper(make_scheduler(capacity=200, chunked_prefill_size=None))
    s.add("a", prompt(20, 1), params(100))
    s.add("b", prompt(50, 2), params(40))

    # Step 1. Nothing runs, nothing is cached: A + E = 200, offsets 0
    # (docs/scheduler.md#prefill-adder-budgets). a: total = 20 + min(100, 4096) + 1 = 121 < 200, admitted;
    # rem_total_token_offset = 20 + 100 + 1 = 121, so rem_total = 200 - 121 = 79 and cur_rem = 200 - 21 =
    # 179: CONTINUE. b: 50 + 40 + 1 = 91 >= 79 -> NO_TOKEN (docs/scheduler.md#add-one-req step 6), which
    # sets the flag (docs/scheduler.md#admission-loop step 9g).
    plan = s.step()
    assert s.extended(plan) == ["a"] and s.sched.batch_is_full and s.waiting() == ["b"]

    # Step 2. The running batch is empty, so step 1's batch becomes it, with a fresh flag. a's prompt is
    # cached and locked: A = 200 - 20 = 180, E = 0; a has 1 of 100 tokens, offset(a) = min(100 - 1, 4096)
    # · 0.7 = 69.3 (the ratio has not decayed: no decode step yet), rem_total = 180 - 69.3 = 110.7.
    # b: 91 < 110.7, admitted. (With the flag kept, b would wait for a's 100 tokens: a finishes with the
    # result of step 100, is filtered at step 101 and b would be admitted at step 102.)
    plan = s.step()
    assert s.extended(plan) == ["b"] and s.decoded(plan) == [] and s.waiting() == []
    assert not s.sched.batch_is_full
    s.run_to_end()
    assert s.tokens == {"a": 100, "b": 40}


def test_after_a_mixed_step_the_running_batch_is_the_mixed_batch_with_a_fresh_flag() -> None:
    """docs/scheduler.md#mixed-chunk / #batch-is-full: a mixed step leaves an empty running batch that
    carries the flag, and the next step's merge replaces it by the mixed batch, whose flag is False. So
    a NO_TOKEN verdict in a mixed step never outlives the step: the next one attempts admission again."""
    s = Stepper(make_scheduler(capacity=200, chunked_prefill_size=64, enable_mixed_chunk=True))
    s.add("a", prompt(10, 1), params(50))
    assert s.extended(s.step()) == ["a"]  # step 1: alone (10 + 50 + 1 = 61 < 200)

    # Step 2: a runs, so the prefill mixes its decode in (docs/scheduler.md#mixed-chunk); the adder charges it
    # (docs/scheduler.md#prefill-adder-budgets): rem_chunk = 64 - 1 = 63, rem_total_token_offset = 1 +
    # offset(a) = 1 + min(50 - 1, 4096) · 0.7 = 35.3. A = 200 - 10 = 190 (a's prompt locked), E = 0:
    # rem_total = 190 - 35.3 = 154.7. b: 30 + 60 + 1 = 91 < 154.7, admitted whole (30 <= 63); the offset
    # grows by 30 + 60 + 1 to 126.3, rem_total = 63.7. c: 20 + 50 + 1 = 71 >= 63.7 -> NO_TOKEN, the flag is
    # set. The step extends b and decodes a; the running batch is left empty, carrying the flag.
    s.add("b", prompt(30, 2), params(60))
    s.add("c", prompt(20, 3), params(50))
    plan = s.step()
    assert plan.kind.value == "mixed" and s.extended(plan) == ["b"] and s.decoded(plan) == ["a"]
    assert s.sched.batch_is_full and s.waiting() == ["c"]

    # Step 3: nothing left the mixed batch, but it becomes the running batch [b, a] with a fresh flag,
    # so admission is attempted. A = 200 - 11 (a: prompt + its decode's slot) - 30 (b's prompt, locked)
    # = 159, E = 0. Mixed again with 2 decodes: offset = 2 + min(50 - 2, 4096) · 0.7 + min(60 - 1, 4096)
    # · 0.7 = 2 + 33.6 + 41.3 = 76.9, rem_total = 159 - 76.9 = 82.1. c: 71 < 82.1, admitted. (With the
    # flag kept, c would wait until a finishes: its 50th token comes with the result of step 50, it is
    # filtered at step 51 and c would be admitted at step 52.)
    plan = s.step()
    assert plan.kind.value == "mixed" and s.extended(plan) == ["c"] and s.decoded(plan) == ["b", "a"]
    assert not s.sched.batch_is_full and s.waiting() == []
    s.run_to_end()
    assert s.tokens == {"a": 50, "b": 60, "c": 50}


# --- docs/scheduler.md#priority-preemption the order: preempt, then match
# -----------------------------------------------------------------------------


def priority_stepper() -> Stepper:
    return Stepper(
        make_scheduler(
            capacity=200, chunked_prefill_size=None, enable_priority_scheduling=True, max_running_requests=2
        )
    )


def test_a_request_blocked_on_the_running_cap_is_not_matched_so_its_cached_prompt_ages() -> None:
    """docs/scheduler.md#priority-preemption / #admission-loop step 9c-e: a request that finds the
    running batch full tries to preempt before it is matched, and a failed attempt ends the pass. So
    while the cap binds, the queue's head is never matched: its cached prompt is not touched and ages
    in the LRU order (docs/scheduler.md#locks-and-eviction), and the tree evicts it before younger
    content. Preemption threshold 10; the ratio stays 0.7 until the first decode step."""
    s = priority_stepper()
    s.add("v", prompt(40, 1), params(50, priority=0))
    s.add("x", prompt(30, 2), params(1, priority=0))
    # Step 1: v (40 + 50 + 1 = 91 < 200) and x (30 + 1 + 1 = 32 < 200 - 91 = 109) are admitted. Their
    # results cache v's prompt (inserted first: older) and x's (x is done after its one token, unlocked).
    assert s.extended(s.step()) == ["v", "x"]

    # Step 2: h1 and h2 (priority 50) arrive; running [v], one free place under the cap of 2. A = 200 -
    # 40 - 30 = 130, E = 30 (x), offset(v) = min(50 - 1, 4096) · 0.7 = 34.3: rem_total = 125.7. h1: 50 + 20
    # + 1 = 71 < 125.7, admitted (rem_total 54.7). h2 finds the batch full: need = 50 + 20 - 54.7 = 15.3;
    # v (priority 0: 50 - 0 > 10) frees offset 34.3 -> need -19 <= 0, v is preempted. Its prompt becomes
    # evictable (E = 70), its offset is returned: rem_total = 130 + 70 - 71 = 129 > 71, h2 is admitted.
    s.add("h1", prompt(50, 3), params(20, priority=50))
    s.add("h2", prompt(50, 4), params(20, priority=50))
    plan = s.step()
    assert s.extended(plan) == ["h1", "h2"] and s.preempted(plan) == ["v"] and s.waiting() == ["v"]
    assert s.sched.kv.available_size() == 30 and s.sched.kv.evictable_size() == 70

    # Steps 3..22: the cap binds (2 running). v, first in the queue, cannot preempt h1 or h2 (0 - 50 is
    # not > 10), so every pass ends there, before v is matched. h1 and h2 decode 2 slots a step: after
    # steps 3..17 the 30 free slots are gone; at step 18 the decode check evicts (at least 2 tokens: one
    # leaf, docs/scheduler.md#decode-memory-check) the least recently used leaf, v's prompt (40), not x's
    # (30), and nothing more is evicted: 40 - 2 · 4 = 32 slots are free after step 21. (Matching v on each
    # attempt would have kept its prompt the freshest leaf: x's would have gone.) h1 and h2 finish with
    # step 21's result (1 + 19 tokens); step 22 releases them.
    for step in range(3, 23):
        plan = s.step()
        assert s.preempted(plan) == [] and s.extended(plan) == [] and s.waiting() == ["v"], step
        assert s.decoded(plan) == (["h1", "h2"] if step <= 21 else []), step
    assert s.released(plan) == ["h1", "h2"] and s.sched.kv.available_size() == 32

    # Step 23: v is re-admitted and matched now: its prompt is gone, the whole of prompt + its 1 output
    # is prefilled.
    plan = s.step()
    assert s.extend_ranges(plan) == {"v": (0, 41)}
    s.run_to_end()
    assert s.tokens == {"v": 50, "x": 1, "h1": 20, "h2": 20} and s.sched.num_retracted_total == 0


def test_a_newcomer_never_matched_reckons_the_room_to_free_from_an_empty_fill() -> None:
    """docs/scheduler.md#priority-preemption step 2: need = (matched fill - len(prefix_indices)) +
    min(max_new_tokens, 4096) - rem_total_tokens, the fill being what the request's last match saw
    (SGLang's full_untruncated_fill_ids): nothing for a newcomer, whose prompt then counts for nothing."""
    s = priority_stepper()
    cached = prompt(60, 1)
    s.add("p", cached, params(1, priority=0))
    assert s.extended(s.step()) == ["p"]  # step 1: done after one token; its 60 tokens stay cached
    s.add("l1", prompt(10, 2), params(50, priority=0))
    s.add("l2", prompt(10, 3), params(50, priority=0))
    assert s.extended(s.step()) == ["l1", "l2"]  # step 2: 61 < 200, then 61 < 139

    # Step 3: n (priority 100) shares p's 60 tokens and finds the batch full. A = 200 - 60 - 20 = 120,
    # E = 60 (p), offsets 2 · min(50 - 1, 4096) · 0.7 = 68.6: rem_total = 111.4. need = (0 - 0) + 100 -
    # 111.4 = -11.4: the first candidate, least important and later queued, l2, is enough (the walk takes
    # one before it checks). Its prompt becomes evictable (E = 70) and its offset is returned: rem_total =
    # 120 + 70 - 34.3 = 155.7. Now n is matched (60 cached) and locks them (E = 10): rem_total = 95.7, and
    # 10 + 100 + 1 = 111 >= 95.7: NO_TOKEN. Nothing is admitted; l1 decodes alone and l2 goes back to the
    # queue behind n (docs/scheduler.md#priority-preemption, the departure: SGLang would lose it).
    s.add("n", cached + prompt(10, 4), params(100, priority=100))
    plan = s.step()
    assert s.preempted(plan) == ["l2"] and s.extend_ranges(plan) == {} and s.decoded(plan) == ["l1"]
    assert s.waiting() == ["n", "l2"]
    # The running batch has a free slot from now on, so n is offered to add_one_req as any request, and is
    # refused until l1's reservation is gone.
    plan = s.step()
    assert s.preempted(plan) == [] and s.decoded(plan) == ["l1"] and s.waiting() == ["n", "l2"]
    s.run_to_end()
    assert s.tokens == {"p": 1, "l1": 50, "l2": 50, "n": 100} and s.sched.num_retracted_total == 0


def test_requests_preempted_for_a_newcomer_that_then_does_not_fit_go_back_to_the_queue() -> None:
    """docs/scheduler.md#priority-preemption: preemption only checks need <= 0, but admission wants
    input + max_new + page < rem_total, so the newcomer can still be refused after its victims were
    released. SGLang re-queues the victims only when the pass admitted something (they would be lost:
    released, in no queue, never finished); they go back to the queue in any case."""
    s = priority_stepper()
    shared = prompt(20, 1)
    s.add("l1", shared, params(50, priority=0))
    s.add("l2", shared, params(50, priority=0))
    # Step 1: both admitted (20 + 50 + 1 = 71 < 200, then 71 < 129). l2's copy of the prompt is freed for the
    # tree's: the 20 slots are the tree's, locked by both; A = 180, E = 0.
    assert s.extended(s.step()) == ["l1", "l2"]

    # Step 2: n (priority 100, 45 tokens, 100 new) finds the batch full. offsets 2 · min(50 - 1, 4096) ·
    # 0.7 = 68.6, rem_total = 180 - 68.6 = 111.4; need = 45 + 100 - 111.4 = 33.6. l2 (queued last) frees
    # its offset: 33.6 - 34.3 = -0.7 <= 0, it is preempted. Its prompt stays locked by l1 and it held no
    # slot of its own: rem_total = 180 - 34.3 = 145.7, and n's total 45 + 100 + 1 = 146 >= 145.7 -> NO_TOKEN.
    # Nothing is admitted; l1 decodes and l2 waits behind n.
    s.add("n", prompt(45, 2), params(100, priority=100))
    plan = s.step()
    assert s.extended(plan) == [] and s.decoded(plan) == ["l1"] and s.released(plan) == ["l2"]
    assert s.waiting() == ["n", "l2"]
    s.run_to_end()
    assert s.tokens == {"l1": 50, "l2": 50, "n": 100}


# --- docs/scheduler.md#add-one-req-ignore-eos add_one_req_ignore_eos
# --------------------------------------------------------------------------


def ignore_eos_pass(
    radix: bool, running: list[tuple[str, int, int]], newcomer: tuple[str, int, int]
) -> Stepper:
    """Each running (rid, prompt length, max_new) is admitted in its own step; then the newcomer arrives.
    Every request ignores EOS; the radix cache is on or off (docs/scheduler.md#add-one-req step 4 takes
    the docs/scheduler.md#add-one-req-ignore-eos path only when
    it is off)."""
    s = Stepper(make_scheduler(capacity=200, chunked_prefill_size=None, disable_radix_cache=not radix))
    for i, (rid, n, max_new) in enumerate(running):
        s.add(rid, prompt(n, i + 1), params(max_new, ignore_eos=True))
        assert s.extended(s.step()) == [rid]
    rid, n, max_new = newcomer
    s.add(rid, prompt(n, 9), params(max_new, ignore_eos=True))
    return s


def test_ignore_eos_simulation_admits_what_the_normal_gate_refuses() -> None:
    """docs/scheduler.md#add-one-req-ignore-eos: R (100-token prompt, 1 of 10 tokens) runs; N (10 tokens,
    max_new 95) arrives.

    Normal gate (radix on, docs/scheduler.md#add-one-req step 6): R's prompt is locked, A = 200 - 100 =
    100, E = 0; offset(R) = (10 - 1) · 0.7 = 6.3, rem_total = 93.7; total(N) = 10 + 95 + 1 = 106 >= 93.7
    -> NO_TOKEN.

    Simulated finish (radix off): paged(N) = 10 <= min(cur_rem 100, rem_total 93.7). States (tokens left
    at ratio 1.0 for ignore-EOS requests, tokens occupied): R (10 - 1 = 9, 101), N (95, 10), sorted by
    tokens left. free = cur_rem - 10 = 90. i=0, bs=2: 90 + 0 - 9·2 = 72 > 1·2, freed = 101;
    i=1, bs=1: 90 + 101 - 95 = 96 > 1 -> N is admitted.
    """
    normal = ignore_eos_pass(True, [("R", 100, 10)], ("N", 10, 95))
    plan = normal.step()
    assert normal.extended(plan) == [] and normal.decoded(plan) == ["R"] and normal.waiting() == ["N"]

    simulated = ignore_eos_pass(False, [("R", 100, 10)], ("N", 10, 95))
    plan = simulated.step()
    assert simulated.extended(plan) == ["N"] and not simulated.waiting()
    # The admission was sound: both finish, and the books balance on every step.
    simulated.run_to_end()
    assert simulated.tokens == {"R": 10, "N": 95}


def test_ignore_eos_simulation_refuses_what_the_normal_gate_admits() -> None:
    """docs/scheduler.md#add-one-req-ignore-eos: R1 and R2 (10-token prompts, 1 of 80 tokens each,
    admitted in steps 1 and 2) run; N (10 tokens, max_new 57) arrives. No decode has run yet, so the ratio
    is still 0.7.

    Normal gate (radix on): A = 200 - 20 = 180, E = 0; offsets 2 · (80 - 1) · 0.7 = 110.6,
    rem_total = 69.4; total(N) = 10 + 57 + 1 = 68 < 69.4 -> admitted.

    Simulated finish (radix off): states N (57, 10), R1 (79, 11), R2 (79, 11); free = 180 - 10 = 170.
    i=0, bs=3: 170 + 0 - 57·3 = -1 <= 1·3 -> NO_TOKEN: N waits.
    (R2's own admission in step 2: states R1 (79, 11), R2 (80, 10), free = 190 - 10 = 180:
    180 - 79·2 = 22 > 2, then 180 + 11 - 80 = 111 > 1: admitted on both paths.)
    """
    running = [("R1", 10, 80), ("R2", 10, 80)]
    normal = ignore_eos_pass(True, running, ("N", 10, 57))
    assert normal.extended(normal.step()) == ["N"]

    simulated = ignore_eos_pass(False, running, ("N", 10, 57))
    plan = simulated.step()
    assert simulated.extended(plan) == [] and simulated.decoded(plan) == ["R1", "R2"]
    assert simulated.waiting() == ["N"]


# --- docs/scheduler.md#defaults max_running_requests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "context", "expected"),
    [
        # int(1_000_000 / 8192 · 512) = 62500 -> clamped to 4096; T // 2 = 500000 -> 4096.
        (1_000_000, 8192, 4096),
        # int(100_000 / 32768 · 512) = int(1562.5) = 1562 -> raised to 2048; T // 2 = 50000 -> 2048.
        (100_000, 32768, 2048),
        # int(300_000 / 65536 · 512) = int(2343.75) = 2343, inside [2048, 4096]; T // 2 = 150000.
        (300_000, 65536, 2343),
        # int(250_001 / 50_000 · 512) = int(2560.01) = 2560 (int() floors).
        (250_001, 50_000, 2560),
        # int(3000 / 2048 · 512) = 750 -> 2048; but T // 2 = 1500 -> 1500.
        (3000, 2048, 1500),
        # int(4096 / 2048 · 512) = 1024 -> 2048; T // 2 = 2048 -> 2048.
        (4096, 2048, 2048),
        # int(10 / 4 · 512) = 1280 -> 2048; T // 2 = 5 -> 5.
        (10, 4, 5),
    ],
)
def test_max_running_requests_default(capacity: int, context: int, expected: int) -> None:
    """docs/scheduler.md#defaults: max_running_requests defaults to min(clamp(int(T / context · 512),
    2048, 4096), T // 2)."""
    assert resolve_max_running_requests(None, capacity, context) == expected


@pytest.mark.parametrize(("configured", "expected"), [(900, 500), (3, 3), (500, 500)])
def test_max_running_requests_configured_is_capped_at_half_the_pool(configured: int, expected: int) -> None:
    """docs/scheduler.md#defaults: a configured value becomes min(value, T // 2) (T = 1000: T // 2 = 500);
    the row pool has that
    many rows."""
    sched = make_scheduler(capacity=1000, max_context=512, max_running_requests=configured)
    assert sched.max_running_requests == expected and sched.kv.free_rows() == expected


def test_scheduler_uses_the_default() -> None:
    """docs/scheduler.md#defaults through the scheduler: T = 3000, context 2048 -> 1500 (see the table
    above)."""
    sched = make_scheduler(capacity=3000, max_context=2048)
    assert sched.max_running_requests == 1500 and sched.kv.free_rows() == 1500


# --- docs/scheduler.md#decode-memory-check / docs/scheduler.md#logs-and-metrics the retraction log line
# ------------------------------------------------------------


def test_retraction_line_of_a_real_kv_full_retraction() -> None:
    """docs/scheduler.md#decode-memory-check's warning, from the stats of a retraction that a full pool
    forced.

    T = 256, radix off (all KV private), init ratio 0.5: min = 0.5 · 0.14 = 0.07, decay = 0.43 / 600
    (docs/scheduler.md#new-token-ratio). a (10-token prompt), b (20), c (10), max_new 100 each, admitted
    in steps 1, 2, 3: b: A = 246, rem_total = 246 - 99 · 0.5 = 196.5 > 20 + 100 + 1 = 121; c: A = 226,
    rem_total = 226 - 2 · 49.5 = 127 > 10 + 100 + 1 = 111. After step 3, A = 256 - 40 = 216 and each
    decode step takes 3 slots: decodes 1..72 fit (before the 72nd, A = 216 - 3 · 71 = 3), the 73rd (step
    76) finds A = 0 < 3 -> KV full. Then each has 1 + 72 = 73 outputs; the ratio has decayed 72 times: 0.5
    - 72 · 0.43 / 600 = 0.4484. Retraction (docs/scheduler.md#retraction): equal outputs, longest prompt
    first: b, holding 20 + 72 = 92 slots; then a and c need 2 <= 92. Gained: 92 - 0 = 92. New ratio over
    the kept a, c (docs/scheduler.md#new-token-ratio): (73 + 73 + 20 · 2) / (100 + 100 + 1) = 186 / 201 =
    0.92537.
    """
    s = Stepper(
        make_scheduler(
            capacity=256, chunked_prefill_size=None, disable_radix_cache=True, init_new_token_ratio=0.5
        )
    )
    for rid, n, seed in (("a", 10, 1), ("b", 20, 2), ("c", 10, 3)):
        s.add(rid, prompt(n, seed), params(100))
        assert s.extended(s.step()) == [rid]
    for _ in range(72):
        plan = s.step()
        assert s.decoded(plan) == ["a", "b", "c"]
        assert s.sched.last_stats is not None and not s.sched.last_stats.retracted
    plan = s.step()
    stats = s.sched.last_stats
    assert stats is not None and plan.step_id == 76 and stats.kv_full and stats.retracted == ["b"]
    assert s.decoded(plan) == ["a", "c"] and s.waiting() == ["b"]
    assert retraction_line(stats) == (
        "KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 92, "
        "#new_token_ratio: 0.4484 -> 0.9254"
    )


# --- parallel-sample groups aborted whole ---------------------------------------------------------------


def test_a_sample_group_is_aborted_whole_under_real_kv_pressure() -> None:
    """docs/scheduler.md#parallel-samples: a group (n > 1) is never split by
    retraction; when one member is aborted for memory, all are, waiting or running.

    T = 128, radix off, init ratio 0.02. x (5 tokens, max_new 1) and g/0, g/1, g/2 (one 10-token prompt,
    max_new 100, group "g") arrive together. Step 1: x (5 + 1 + 1 = 7 < 128) and g/0 (111 < 121) are
    admitted; g/1: 111 >= 121 - 111 = 10 -> NO_TOKEN, batch_is_full. x finishes at its prefill, so the
    merge in step 2 resets the flag (docs/scheduler.md#step-loop step 4): A = 128 - 10 = 118, offset(g/0)
    = 99 · 0.02 = 1.98, g/1: 111 < 116.02 admitted; g/2: 111 >= 116.02 - 111 -> NO_TOKEN, it waits. From
    step 3 g/0 and g/1 decode 2 slots a step from A = 108: 54 decodes fit, the 55th (step 57) does not.
    Both are group members, so the retraction aborts the group: g/0, g/1 and the waiting g/2.
    """
    s = Stepper(
        make_scheduler(
            capacity=128, chunked_prefill_size=None, disable_radix_cache=True, init_new_token_ratio=0.02
        )
    )
    s.add("x", prompt(5, 9), params(1))
    for j in range(3):
        s.add(f"g/{j}", prompt(10, 5), params(100, group="g"))
    assert s.extended(s.step()) == ["x", "g/0"] and s.finished["x"].kind is FinishKind.LENGTH
    assert s.extended(s.step()) == ["g/1"] and s.waiting() == ["g/2"]
    for _ in range(54):
        assert s.decoded(s.step()) == ["g/0", "g/1"]
    assert not any(rid.startswith("g/") for rid in s.finished)
    plan = s.step()
    stats = s.sched.last_stats
    assert stats is not None and plan.step_id == 57 and stats.kv_full and stats.retracted == []
    assert sorted(s.released(plan)) == ["g/0", "g/1"] and not len(plan.decodes)
    for rid in ("g/0", "g/1", "g/2"):
        assert s.finished[rid].kind is FinishKind.ABORT and s.finished[rid].message == GROUP_ABORTED, rid
    assert not s.waiting() and not len(s.sched.running) and s.sched.is_idle
