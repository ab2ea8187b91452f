"""The running requests' columns (control_plane/scheduler/columns.py) agree with what the Request
objects say once synced, and the vectorised readers equal the per-request rules they replace."""

from __future__ import annotations

import pytest

from control_plane.request import FinishReason
from control_plane.scheduler import columns as columns_module
from control_plane.scheduler.adder import PrefillAdder, reserved_offset
from control_plane.scheduler.scheduler import Scheduler
from tests.control_plane.factories import EOS, FakeWorker, make_scheduler, params, prompt, run


def _trace() -> list[tuple[int, str, list[int], object]]:
    return [(i % 5, f"r{i}", prompt(5 + 3 * i, i), params(20 + 7 * i)) for i in range(9)]


def _check_columns(sched: Scheduler, _: int) -> None:
    """Per running position: the columns' remaining tokens, as admission reads them, equal
    max_new_tokens − len(output_ids), finished requests still in the batch included; the reserved
    offset is the same float as the per-request sum SGLang computes; lengths agree."""
    running = sched.running
    remaining = running.remaining_new_tokens()
    reqs = running.reqs
    assert remaining.tolist() == [r.max_new_tokens - len(r.output_ids) for r in reqs]
    ratio = sched.ratio.current
    python_sum = float(sum(min(r.max_new_tokens - len(r.output_ids), 4096) * ratio for r in reqs))
    assert reserved_offset(remaining, 4096, ratio) == python_sum  # exactly, not approximately
    adder = PrefillAdder(sched.kv, sched.adder_limits, reqs, ratio)
    assert adder.rem_total_token_offset == float(0) + python_sum
    live = running.live_mask()
    allocated = [r.kv_allocated_len for r, ok in zip(reqs, live, strict=True) if ok]
    assert running.seq_lens[live].tolist() == allocated
    for req in sched.by_handle.values():
        # Beyond the committed KV: the slots of decodes still in flight, at most one per plan.
        assert req.kv_committed_len <= req.kv_allocated_len <= req.kv_committed_len + sched.in_flight


@pytest.mark.parametrize("overlap", [False, True])
def test_columns_agree_with_the_requests_every_step(overlap: bool) -> None:
    sched = make_scheduler(capacity=512, chunked_prefill_size=32, test_retract=True)
    out = run(sched, FakeWorker(512, eos=EOS, eos_every=9), _trace(), on_step=_check_columns, overlap=overlap)
    assert out.finished.keys() == {f"r{i}" for i in range(9)}
    assert sched.num_retracted_total > 0


def test_tokens_survive_the_rolling_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens wait in a per-row table until a sync; a rolling sync visits every row at least once per
    SYNC_INTERVAL appends, which bounds the table. With a tiny interval rows are synced every few
    steps, mid-generation: the outputs do not change, and the table never outgrows the interval."""
    base = run(make_scheduler(), FakeWorker(4096, eos=EOS, eos_every=13), _trace())
    monkeypatch.setattr(columns_module, "SYNC_INTERVAL", 4)
    monkeypatch.setattr(columns_module, "_MIN_WIDTH", 2)
    for overlap in (False, True):
        sched = make_scheduler(max_running_requests=8)
        out = run(sched, FakeWorker(4096, eos=EOS, eos_every=13), _trace(), overlap=overlap)
        assert out.tokens == base.tokens and out.finished == base.finished
        assert sched.kv.columns.tokens.shape[1] == 4


def test_a_request_reads_its_columns_while_it_holds_a_row() -> None:
    sched = make_scheduler()
    worker = FakeWorker(4096)
    req = sched.add_request("a", prompt(6), params(10, ignore_eos=True))
    for _ in range(4):
        plan = sched.next_plan()
        assert plan is not None
        sched.apply_result(worker.run(plan))
    columns, row = sched.kv.columns, req.req_pool_idx
    assert int(columns.n_pending[row]) > 0  # applied tokens not materialised yet
    assert len(req.output_ids) == 4 and int(columns.n_pending[row]) == 0
    assert req.kv_committed_len == int(columns.committed[row]) == 6 + 3
    assert req.kv_allocated_len == int(columns.allocated[row]) == 6 + 3
    with pytest.raises(RuntimeError, match="columns'"):
        req.output_ids = []
    assert sched.abort("a", FinishReason.abort("cancelled"))
    # Aborted while running (docs/scheduler.md#aborts): it holds its row until its next result.
    assert req.req_pool_idx == row
    plan = sched.next_plan()
    assert plan is not None
    sched.apply_result(worker.run(plan))
    assert req.req_pool_idx == -1 and len(req.output_ids) == 5 and req.kv_committed_len == 10
