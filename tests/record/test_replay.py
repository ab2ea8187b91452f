"""Recordings made by `simulate --record`: format round trip, rotation, truncation, both replays."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from control_plane.config import SchedulerConfig
from control_plane.record import codec
from control_plane.record.entries import Abort, AddRequest, ApplyResult, Entry, Header, NextPlan
from control_plane.record.files import TruncatedRecording, read_entries, recording_parts, varint
from control_plane.record.recorder import RecordingScheduler, recording_header
from control_plane.record.replay import first_difference, replay_scheduler
from control_plane.request import RequestParams
from protos.worker import SamplerParams, WorkerLimits
from stepwise import replay, simulate
from tests.control_plane.factories import make_config, params, prompt, run_plan
from tests.control_plane.fake_worker import FakeWorker
from tests.record.conftest import ListSink, write_trace

pytestmark = pytest.mark.timeout(120)

TRACE = [
    {
        "rid": f"r{i}",
        "arrival": 0.004 * i,
        "prompt_len": 30 + 11 * i,
        "prefix_group": f"g{i % 2}",
        "prefix_len": 16,
        "max_new_tokens": 40,
        "output_len": 20 + i % 9,
    }
    for i in range(16)
]
# A small pool and an optimistic ratio: decode retracts; chunk 16 cuts prompts.
FLAGS = ["--kv-tokens", "300", "--chunked-prefill-size", "16", "--summary-only"]


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    def make(*extra: str) -> Path:
        monkeypatch.setenv("STEPWISE_INIT_NEW_TOKEN_RATIO", "0.05")
        trace = write_trace(tmp_path / "trace.jsonl", TRACE)
        out = tmp_path / f"rec{len(list(tmp_path.glob('rec*')))}"
        assert simulate.main([str(trace), *FLAGS, "--record", str(out), *extra]) == 0
        return out

    return make


def _rewrite(path: Path, entries: list[Entry]) -> None:
    path.write_bytes(b"".join(varint(len(b)) + b for b in map(codec.encode, entries)))


def _part0(directory: Path) -> Path:
    return recording_parts(directory)[0]


def test_entries_round_trip_and_replay_identical(recording: Callable[..., Path]) -> None:
    rec = recording()
    entries = list(read_entries(rec))
    assert isinstance(entries[0], Header) and entries[0].writer == "stepwise simulate"
    assert entries[0].seeds == {"scheduler.random_seed": 0, "sim.seed": 0}
    for entry in entries:
        assert first_difference(entry, codec.decode(codec.encode(entry))) is None, entry
    report = replay_scheduler(entries)
    assert report.identical, report.describe()
    assert report.counts["plans"] == report.counts["results"] > 0


def test_rotation_splits_into_parts_that_read_as_one(recording: Callable[..., Path]) -> None:
    whole = list(read_entries(recording()))
    rotated_dir = recording("--record-max-bytes", "2000")
    parts = recording_parts(rotated_dir)
    assert len(parts) > 3
    assert [p.name for p in parts][:2] == ["sim-1.0000.rec", "sim-1.0001.rec"]
    assert len(list(read_entries(rotated_dir))) == len(whole)
    # A later part is readable alone: it starts with a continuation header.
    first = next(iter(read_entries(parts[2])))
    assert isinstance(first, Header) and first.part == 2 and first.first_step > 0


def test_both_replays_report_identical(
    recording: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rec = recording()
    capsys.readouterr()
    assert replay.main(["scheduler", str(rec)]) == 0
    assert replay.main(["worker", str(_part0(rec))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("identical: ") and "plans" in out[0]
    assert out[1].startswith("identical: ")


def test_scheduler_replay_names_the_changed_plan_field(
    recording: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = _part0(recording())
    entries = list(read_entries(path))
    i = next(k for k, e in enumerate(entries) if isinstance(e, NextPlan) and e.plan and len(e.plan.decodes))
    plan = entries[i].plan  # type: ignore[union-attr]
    assert plan is not None
    slots = plan.decodes.slots.copy()
    slots[0] += 1
    changed = dataclasses.replace(plan, decodes=dataclasses.replace(plan.decodes, slots=slots))
    entries[i] = NextPlan(plan.step_id - 1, changed)
    _rewrite(path, entries)
    capsys.readouterr()
    assert replay.main(["scheduler", str(path)]) == 1
    assert f"step {plan.step_id}: plan.decodes.slots[0] differs" in capsys.readouterr().out


def test_worker_replay_names_the_step_of_a_changed_token(
    recording: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = _part0(recording())
    entries = list(read_entries(path))
    results = [k for k, e in enumerate(entries) if isinstance(e, ApplyResult) and len(e.result.token_ids) > 1]
    i = results[len(results) // 2]
    result = entries[i].result  # type: ignore[union-attr]
    tokens = result.token_ids.copy()
    tokens[-1] += 1
    entries[i] = ApplyResult(dataclasses.replace(result, token_ids=tokens))
    _rewrite(path, entries)
    capsys.readouterr()
    assert replay.main(["worker", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"step {result.step_id}: result.token_ids[{len(tokens) - 1}] differs: recorded {tokens[-1]}" in out


@pytest.mark.parametrize("cut", [1, 3])
def test_truncated_recording_reads_to_the_last_whole_record(recording: Callable[..., Path], cut: int) -> None:
    path = _part0(recording())
    whole = list(read_entries(path))
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    with pytest.warns(TruncatedRecording, match="truncated"):
        entries = list(read_entries(path))
    assert len(entries) == len(whole) - 1
    assert replay_scheduler(entries).identical


def test_cut_inside_a_length_prefix(tmp_path: Path) -> None:
    path = tmp_path / "x.rec"
    header = Header(SchedulerConfig(), WorkerLimits("w", 64, 1, 128, 100, frozenset({2})))
    body = codec.encode(header)
    path.write_bytes(varint(len(body)) + body + b"\x96")  # a varint's first byte, no more
    with pytest.warns(TruncatedRecording, match="length prefix"):
        assert [type(e) for e in read_entries(path)] == [Header]


def test_show_json_has_the_documented_fields(
    recording: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rec = recording()
    capsys.readouterr()
    assert replay.main(["show", str(rec), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    keys = {"step", "kind", "extends", "decodes", "retracted", "aborted", "finished", "new_token_ratio"}
    keys |= {"rem_total_tokens", "rem_input_tokens", "rem_chunk_tokens", "cached_tokens", "running", "queued"}
    keys |= {"kv_used", "kv_capacity"}
    assert all(keys <= line.keys() for line in lines)
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    assert any(line["retracted"] for line in lines), "the small pool was meant to force retractions"
    assert any(e["chunked"] for line in lines for e in line["extends"])
    assert sorted(r for line in lines for r in line["finished"]) == sorted(r["rid"] for r in TRACE)
    assert replay.main(["show", str(rec)]) == 0
    assert "prefill" in capsys.readouterr().out


def test_unreadable_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay.main(["scheduler", str(tmp_path / "missing")]) == 2
    assert "no recording" in capsys.readouterr().err


def test_array_difference_reports_the_index() -> None:
    assert first_difference(np.array([1, 2, 3]), np.array([1, 5, 3]), "x") == ("x[1]", "2", "5")
    assert first_difference(np.array([1, 2]), np.array([1, 2, 3]), "x") == ("len(x)", "2", "3")


def test_every_request_parameter_survives_the_record() -> None:
    """A recorded arrival keeps what the scheduler decides by: min_new_tokens included (replaying a
    request that ignores EOS for its first tokens without it would diverge)."""
    params = RequestParams(
        max_new_tokens=9,
        min_new_tokens=5,
        stop=("x",),
        stop_token_ids=frozenset({3}),
        ignore_eos=True,
        sampler=SamplerParams(temperature=0.5, seed=7),
        priority=2,
        routing_key="k",
        group="g",
        sim_output_len=4,
    )
    entry = AddRequest(3, "r", (1, 2, 3), params)
    assert codec.decode(codec.encode(entry)) == entry


def test_a_group_aborted_by_retraction_replays_identically() -> None:
    """A retraction that aborts a sample group takes the member still waiting with it, inside
    next_plan. That abort is the scheduler's own decision, not a call to record: recorded as one (it
    went through the public abort, which RecordingScheduler wraps), the replay applied it before the
    plan and finished the members in another order. The scenario is test_pins.py's group under real
    KV pressure: the group is aborted at step 57."""
    config = make_config(chunked_prefill_size=None, disable_radix_cache=True, init_new_token_ratio=0.02)
    limits = WorkerLimits("w0", kv_capacity_tokens=128, page_size=1, max_context=2048, vocab_size=1000)
    sink = ListSink()
    sched = RecordingScheduler(config, limits, sink)
    worker = FakeWorker(128)
    sched.add_request("x", prompt(5, 9), params(1))
    for j in range(3):
        sched.add_request(f"g/{j}", prompt(10, 5), params(100, group="g"))
    for _ in range(100):
        if sched.is_idle:
            break
        plan = sched.next_plan()
        assert plan is not None
        sched.apply_result(run_plan(sched, worker, plan))
        sched.take_updates()
    assert sched.is_idle and sched.step_id == 57
    assert not [e for e in sink.entries if isinstance(e, Abort)]
    report = replay_scheduler([recording_header(config, limits, "test"), *sink.entries])
    assert report.identical, report.describe()


def test_requests_with_log_probabilities_record_and_replay_identically() -> None:
    """Scoring requests under chunking and forced retraction: their parameters survive the record,
    and the replayed plans, prompt-scoring columns included, are the recorded ones."""
    scoring = dataclasses.replace(params(12), logprobs=True, logprob_start_len=3)
    scoring = dataclasses.replace(
        scoring, sampler=dataclasses.replace(scoring.sampler, logprobs=3, token_ids_logprob=(4, 9))
    )
    entry = AddRequest(3, "r", (1, 2, 3, 4), scoring)
    assert codec.decode(codec.encode(entry)) == entry
    config = make_config(chunked_prefill_size=16, test_retract=True)
    limits = WorkerLimits("w0", kv_capacity_tokens=4096, page_size=1, max_context=2048, vocab_size=1000)
    sink = ListSink()
    sched = RecordingScheduler(config, limits, sink)
    worker = FakeWorker(4096)
    for i in range(4):
        sched.add_request(f"s{i}", prompt(40, i), dataclasses.replace(scoring, logprob_start_len=i * 9))
    scored = 0
    for _ in range(500):
        if sched.is_idle:
            break
        plan = sched.next_plan()
        assert plan is not None
        scored += int(plan.extends.score_lens.sum()) if len(plan.extends.score_lens) else 0
        sched.apply_result(run_plan(sched, worker, plan))
        sched.take_updates()
    assert sched.is_idle and sched.num_retracted_total > 0 and scored >= sum(39 - i * 9 for i in range(4))
    report = replay_scheduler([recording_header(config, limits, "test"), *sink.entries])
    assert report.identical, report.describe()
