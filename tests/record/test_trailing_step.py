"""A recording that a stop cut off during its trailing steps (issue 40, item 5).

Under overlap the engine publishes a finish after it has sent the next plan: when the client has its
last finish, the step planned before that finish was applied and the one just sent can still be
running (they decode rows already finished, or none). A user who stops `stepwise up` then stops the
workers while they run, so the recording holds their plans and no results. Replayed on the recorded
seconds (`--cost recorded:DIR`, the fleet twin), such a step takes 0 s and is counted; any other
step the recording did not measure still ends the run (RecordingTooShort)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from clients import traces as client_traces
from control_plane.record.entries import ApplyResult, Entry, Header, NextPlan
from control_plane.record.files import read_entries
from control_plane.record.recorder import open_file_sink
from control_plane.record.timeline import StepLine, TimelineSink
from stepwise import cost_fit, costs, twin, twin_recorded
from stepwise import simulate as sim
from tests.record.conftest import write_trace
from tests.record.test_twin_live import planned, timeline

pytestmark = pytest.mark.timeout(120)

# Requests arriving while others run, so that prefills land between decodes and the fit sees
# steps of several shapes.
TRACE = [
    {"rid": f"r{i}", "arrival": 0.01 * i, "prompt_len": 20 + 9 * i, "max_new_tokens": 3 + i % 5}
    for i in range(10)
]
COST = "0.002,0.00003,0.0000001,0.00004"


def _record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    """The trace and a whole recording of it (overlap on, as live by default)."""
    trace = write_trace(tmp_path / "trace.jsonl", TRACE)
    record = tmp_path / "whole"
    assert sim.main([str(trace), "--summary-only", "--cost", COST, "--record", str(record)]) == 0
    capsys.readouterr()
    return trace, record


def _rewrite(record: Path, into: Path, keep: Callable[[list[Entry]], list[Entry]]) -> Path:
    """The recording's entries that `keep` returns, written as a new recording with the writer's API."""
    entries = list(read_entries(record))
    header = entries[0]
    assert isinstance(header, Header)
    sink = open_file_sink(into, header, 1 << 30)
    for entry in keep(entries[1:]):
        sink.write(entry)
    sink.end_step(0)
    sink.close()
    return into


def _results(entries: list[Entry]) -> list[int]:
    """The indexes of the ApplyResult entries."""
    return [i for i, e in enumerate(entries) if isinstance(e, ApplyResult)]


def _cut_in_trailing_step(record: Path, into: Path, steps: int = 1) -> Path:
    """As `up` stopped while the last `steps` steps ran: everything before the first one's result."""
    return _rewrite(record, into, lambda entries: entries[: _results(entries)[-steps]])


def _trailing_step(record: Path) -> int:
    last = [e for e in read_entries(record) if isinstance(e, ApplyResult)][-1]
    return last.result.step_id


def _note(cut: Path, steps: list[int]) -> str:
    """What `simulate` says on stderr of the steps it gave 0 s."""
    if len(steps) == 1:
        said = f"step {steps[0]} was not measured (the recording stopped while it ran): it took 0 s"
    else:
        listed = ", ".join(map(str, steps))
        said = f"steps {listed} were not measured (the recording stopped while they ran): they took 0 s"
    return f"stepwise simulate: --cost recorded:{cut}: {said}\n"


def test_a_trailing_step_that_never_completed_is_the_one_a_stop_cut_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recording is read as live left it: the trailing step planned, after every finish, without a
    result (its rows decode nothing: the requests finished on the result before)."""
    _, whole = _record(tmp_path, capsys)
    cut = _cut_in_trailing_step(whole, tmp_path / "cut")
    entries = list(read_entries(cut))
    last = max(e.plan.step_id for e in entries if isinstance(e, NextPlan) and e.plan is not None)
    assert last == _trailing_step(whole)
    assert last not in costs.recorded_steps(f"recorded:{cut}").seconds
    assert sorted(e.rid for e in read_entries(cut) if type(e).__name__ == "Finished") == sorted(
        r["rid"] for r in TRACE
    )
    trailing = timeline(list(read_entries(whole)))[-1]
    assert (trailing.extends, trailing.decodes, trailing.running) == ([], [], 0)  # nothing left in it


@pytest.mark.parametrize("steps", [1, 2], ids=["last step", "last two steps"])
def test_simulate_times_a_recording_cut_in_its_trailing_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: int
) -> None:
    """It plans what the whole recording timed (the same timeline), and its summary is the whole
    recording's but for the cut steps' seconds, with a note on stderr saying so."""
    trace, whole = _record(tmp_path, capsys)
    cut = _cut_in_trailing_step(whole, tmp_path / "cut", steps)
    last = _trailing_step(whole)
    cut_steps = list(range(last - steps + 1, last + 1))
    assert sim.main([str(trace), "--json", "--cost", f"recorded:{whole}"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    *whole_lines, whole_summary = out.splitlines()
    assert sim.main([str(trace), "--json", "--cost", f"recorded:{cut}"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert err == _note(cut, cut_steps)
    *cut_lines, cut_summary = out.splitlines()
    assert cut_lines == whole_lines
    expected = json.loads(whole_summary)["summary"]
    summary = json.loads(cut_summary)["summary"]
    seconds = costs.recorded_steps(f"recorded:{whole}").seconds
    cut_s = sum(seconds[s] for s in cut_steps)
    assert summary.pop("simulated_s") == pytest.approx(expected.pop("simulated_s") - cut_s, abs=2e-6)
    assert summary == expected  # every request's figures: they finished before the cut steps
    assert summary["steps"] == last  # the cut steps are counted among the steps
    assert costs.recorded_steps(f"recorded:{cut}").cut_off == set(cut_steps)


@pytest.mark.parametrize("steps", [1, 2], ids=["last step", "last two steps"])
def test_the_fleet_twin_times_a_recording_cut_in_its_trailing_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: int
) -> None:
    trace, whole = _record(tmp_path, capsys)
    cut = _cut_in_trailing_step(whole, tmp_path / "cut", steps)

    def replay(record: Path) -> tuple[twin_recorded.RecordedTwin, list[StepLine]]:
        recording = twin_recorded.read_worker(record)
        header = recording.header
        base = sim.SimSetup(header.scheduler, header.limits, sim.CostModel())
        setup = twin.TwinSetup(base, ("mixed",), (sim.CostModel(),))
        requests = [sim.to_request(e) for e in client_traces.load_trace(trace, header.limits.vocab_size)]
        lines: list[StepLine] = []
        sink = TimelineSink(lines.append)
        replayed = twin_recorded.RecordedTwin(setup, requests, [recording], [sink])
        replayed.run()
        sink.close()
        return replayed, lines

    whole_twin, whole_lines = replay(whole)
    cut_twin, cut_lines = replay(cut)
    assert planned(cut_lines) == planned(whole_lines) == planned(timeline(list(read_entries(whole))))
    last = _trailing_step(whole)
    cut_steps = list(range(last - steps + 1, last + 1))
    assert whole_twin.unmeasured == []
    assert cut_twin.unmeasured == [(0, step) for step in cut_steps]
    assert cut_twin.steps == whole_twin.steps
    seconds = costs.recorded_steps(f"recorded:{whole}").seconds
    assert cut_twin.end == pytest.approx(whole_twin.end - sum(seconds[s] for s in cut_steps), abs=1e-9)


def test_a_step_missing_in_the_middle_still_ends_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, whole = _record(tmp_path, capsys)

    def without_the_fifth_result(entries: list[Entry]) -> list[Entry]:
        fifth = _results(entries)[4]
        return entries[:fifth] + entries[fifth + 1 :]

    holed = _rewrite(whole, tmp_path / "holed", without_the_fifth_result)
    assert sim.main([str(trace), "--summary-only", "--cost", f"recorded:{holed}"]) == 1
    err = capsys.readouterr().err
    assert "step 5 was not measured in the recording" in err and "trailing step" not in err


def _cut_while_requests_run(record: Path, into: Path) -> Path:
    """As if `up` stopped while step 7 ran, requests still running: everything before the plan of
    step 8 (the recording's last plan is step 7's, and it has no result)."""

    def keep(entries: list[Entry]) -> list[Entry]:
        eighth = next(
            i for i, e in enumerate(entries) if isinstance(e, NextPlan) and e.plan and e.plan.step_id == 8
        )
        return entries[:eighth]

    return _rewrite(record, into, keep)


def test_a_trailing_step_while_a_request_runs_still_ends_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its last planned step unmeasured, every step before it measured: still too short, since the
    simulation has requests left when it gets there (no stop a client waited for came then)."""
    trace, whole = _record(tmp_path, capsys)
    cut = _cut_while_requests_run(whole, tmp_path / "cut")
    seconds = costs.recorded_steps(f"recorded:{cut}").seconds
    assert sorted(seconds) == list(range(1, 7))
    assert sim.main([str(trace), "--summary-only", "--cost", f"recorded:{cut}"]) == 1
    err = capsys.readouterr().err
    assert "step 7 was not measured in the recording" in err and "trailing step" not in err
    # Nor does a trace the recording did not see finish before the trailing step: the recording of
    # the first request alone, cut in its trailing step, times only that request's run.
    one = tmp_path / "one"
    assert sim.main([str(trace), "--limit", "1", "--summary-only", "--cost", COST, "--record", str(one)]) == 0
    capsys.readouterr()
    one_cut = _cut_in_trailing_step(one, tmp_path / "one-cut")
    assert sim.main([str(trace), "--limit", "1", "--summary-only", "--cost", f"recorded:{one_cut}"]) == 0
    capsys.readouterr()
    assert sim.main([str(trace), "--limit", "2", "--summary-only", "--cost", f"recorded:{one_cut}"]) == 1
    assert "not measured in the recording" in capsys.readouterr().err


def test_the_fleet_twin_refuses_a_trailing_step_while_a_request_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, whole = _record(tmp_path, capsys)
    recording = twin_recorded.read_worker(_cut_while_requests_run(whole, tmp_path / "cut"))
    header = recording.header
    base = sim.SimSetup(header.scheduler, header.limits, sim.CostModel())
    setup = twin.TwinSetup(base, ("mixed",), (sim.CostModel(),))
    requests = [sim.to_request(e) for e in client_traces.load_trace(trace, header.limits.vocab_size)]
    replay = twin_recorded.RecordedTwin(setup, requests, [recording])
    with pytest.raises(sim.RecordingTooShort, match="worker 0: step 7 was not measured live"):
        replay.run()


@pytest.mark.parametrize("interval", [False, True], ids=["forward", "interval"])
def test_fit_cost_fits_the_measured_steps_of_a_cut_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], interval: bool
) -> None:
    """The trailing step's plan without a result is no step to fit: the measured ones are fitted."""
    _, whole = _record(tmp_path, capsys)
    cut = _cut_in_trailing_step(whole, tmp_path / "cut")
    steps = cost_fit.read_steps(cut, interval)
    # The trailing step decoded nothing, so the whole recording's fit leaves it out too; by interval,
    # the step before it has no next result to wait for, so it is left out as a last step is.
    whole_shapes = cost_fit.read_steps(whole, interval).shapes
    assert steps.shapes == (whole_shapes[:-1] if interval else whole_shapes)
    flags = ["--fit-interval"] if interval else []
    assert sim.main(["--fit-cost", str(cut), "--json", *flags]) == 0
    fitted = json.loads(capsys.readouterr().out)
    if not interval:
        model = costs.parse_cost(COST)
        assert [fitted[k] for k in "abcd"] == pytest.approx([model.a, model.b, model.c, model.d], rel=1e-6)
