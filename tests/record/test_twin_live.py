"""The simulator matches live (issue 40, deliverable 5): a stack recorded under a trace sent by
`stepwise bench --dataset trace`, and `stepwise simulate` given that recording's step seconds
(`--cost recorded:DIR`) and its arrival stamps, plan the same steps, request by request; with two
workers, the fleet twin routes each request where live did and plans each worker's steps as live did
(docs/debugging.md#twin)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clients import traces as client_traces
from control_plane.record.entries import Entry, Header
from control_plane.record.files import read_entries
from control_plane.record.timeline import StepLine, TimelineBuilder, TimelineSink
from stepwise import costs, twin, twin_recorded
from stepwise import simulate as sim
from stepwise.up import stop_processes
from tests.cli.runner import ROOT, run_cli_async
from tests.e2e.test_migration import _books_settle_all
from tests.processes import ready_file_sync

pytestmark = pytest.mark.timeout(120)

# A dozen requests sharing a prefix, arriving while others run: prefills land between decodes,
# batches grow and shrink, the prefix cache hits.
TRACE = [
    {"rid": f"r{i}", "arrival": 0.012 * i, "prompt_len": 20 + 7 * i, "prefix_group": "p", "prefix_len": 12,
     "max_new_tokens": 4 + i % 5}
    for i in range(12)
]  # fmt: skip


@pytest.fixture
def recorded_stack(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, Path, Callable[[], None]]]:
    """`stepwise up` (one worker of the backend the test names) recording into a directory; the
    third item stops it (the recording is whole only then: the recorder writes it in blocks).

    A test stops it once the books settle, not when the client has its last finish: under overlap
    the step planned before that finish was applied is still running, and `up` stops the workers
    first, so its seconds would be missing from the recording while the twin plans it too (it gives
    such a step 0 s: test_a_stack_stopped_at_the_clients_last_finish_...; these tests compare whole
    recordings, every step measured)."""
    record = tmp_path / "rec"
    ready = tmp_path / "ready.json"
    args = ["up", "--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]
    args += ["--record", str(record), "--ready-file", str(ready), *request.param]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWISE_")}
    proc = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args], cwd=ROOT, env=env)

    def stop() -> None:
        stop_processes([proc], timeout=20, sig=signal.SIGTERM)

    try:
        yield ready_file_sync(ready, proc, 90, "stepwise up")["address"], record, stop
    finally:
        stop()


def timeline(entries: list[Entry]) -> list[StepLine]:
    builder = TimelineBuilder()
    lines = [line for entry in entries for line in builder.feed(entry)]
    return lines + builder.finish()


def planned(lines: list[StepLine]) -> list[dict[str, object]]:
    """Each step as the scheduler planned it, without `finished`: the live engine publishes a finish one
    plan later than the simulator (after planning the next step), so the column shifts by a line; the
    finishes are compared per request instead."""
    return [{k: v for k, v in line.to_json().items() if k != "finished"} for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize(
    "recorded_stack",
    [
        pytest.param(["--backend", "sim", "--sim-cost", "0.004,0.00002,0"], id="sim"),
        pytest.param(["--model", "embedded"], id="embedded"),
    ],
    indirect=True,
)
async def test_the_simulator_plans_what_the_live_scheduler_planned(
    recorded_stack: tuple[str, Path, Callable[[], None]], tmp_path: Path
) -> None:
    address, record, stop = recorded_stack
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    vocab = "1024"  # the embedded model's, which the sim backend reads from its config too
    args = ["bench", "--address", address, "--dataset", "trace", str(trace), "--vocab", vocab, "--json"]
    code, _, err = await run_cli_async(args)
    assert code == 0, err
    await _books_settle_all(address)
    stop()
    live = list(read_entries(record))
    header = live[0]
    assert isinstance(header, Header)
    recorded = twin_recorded.read_worker(record)
    arrivals = recorded.arrivals
    assert sorted(arrivals) == sorted(r["rid"] for r in TRACE)

    # The simulator as the live scheduler was configured (the recording's header), on the recorded
    # step seconds, with each request arriving between the plans it arrived between live.
    seconds = costs.recorded_steps(f"recorded:{record}").seconds
    setup = sim.SimSetup(header.scheduler, header.limits, sim.CostModel(), recorded_seconds=seconds)
    requests = [sim.to_request(e) for e in client_traces.load_trace(trace, header.limits.vocab_size)]
    simulated: list[StepLine] = []
    sink = TimelineSink(simulated.append)
    summary = sim.Simulation(setup, requests, sink, arrivals, recorded.after_idle).run()
    sink.close()  # the last step's line

    live_lines = timeline(live)
    assert any(len(line.decodes) > 1 for line in live_lines)  # requests ran together
    assert planned(simulated) == planned(live_lines)
    finished_live = sorted(rid for line in live_lines for rid in line.finished)
    assert sorted(rid for line in simulated for rid in line.finished) == finished_live == sorted(arrivals)
    assert summary["finish_reasons"] == {"length": len(TRACE)}
    # The simulated clock is the recorded steps' sum.
    assert summary["simulated_s"] == pytest.approx(sum(seconds.values()), abs=1e-5)


# Two workers: requests arriving while both run, in two prefix groups; a routing key sends each
# request where crc32(key) says (user-0 and user-1 to the first of two workers, user-4 and user-5 to
# the second: across the prefix groups, so that cache-aware routing would send them otherwise), and
# the twin's Router must pick what live picked.
KEYS = ("user-0", "user-1", "user-4", "user-5")
FLEET_TRACE = [
    {"rid": f"f{i}", "arrival": 0.01 * i, "prompt_len": 24 + 5 * i, "prefix_group": f"p{i % 2}",
     "prefix_len": 12, "max_new_tokens": 3 + i % 4, "routing_key": KEYS[i % 4]}
    for i in range(16)
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recorded_stack", "routed"),
    [
        pytest.param(
            ["--workers", "2", "--backend", "sim", "--sim-cost", "0.004,0.00002,0"], "key", id="sim"
        ),
        pytest.param(["--workers", "2", "--model", "embedded"], "key", id="embedded"),
        pytest.param(
            ["--workers", "2", "--backend", "sim", "--sim-cost", "0.004,0.00002,0"],
            "pinned",
            id="sim-by-load",
        ),
    ],
    indirect=["recorded_stack"],
)
async def test_the_fleet_twin_routes_and_plans_what_the_live_fleet_did(
    recorded_stack: tuple[str, Path, Callable[[], None]], routed: str, tmp_path: Path
) -> None:
    """`key`: the trace's routing keys route it, live and in the twin alike; `pinned`: no keys, so
    live routes by load and cache at each arrival's instant, which the recording does not hold for
    the other worker, and the twin takes each request where the recording found it."""
    address, record, stop = recorded_stack
    lines = (
        FLEET_TRACE
        if routed == "key"
        else [{k: v for k, v in r.items() if k != "routing_key"} for r in FLEET_TRACE]
    )
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in lines))
    args = ["bench", "--address", address, "--dataset", "trace", str(trace), "--vocab", "1024", "--json"]
    code, _, err = await run_cli_async(args)
    assert code == 0, err
    await _books_settle_all(address)
    stop()
    fleet = twin_recorded.read_fleet(record)
    assert [w.header.limits.worker_id for w in fleet] == ["worker-0", "worker-1"]
    assert all(w.arrivals for w in fleet)  # both took requests
    header = fleet[0].header
    base = sim.SimSetup(header.scheduler, header.limits, sim.CostModel())
    setup = twin.TwinSetup(base, ("mixed", "mixed"), (sim.CostModel(), sim.CostModel()))
    requests = [sim.to_request(e) for e in client_traces.load_trace(trace, header.limits.vocab_size)]
    simulated: list[list[StepLine]] = [[], []]
    sinks = [TimelineSink(lines.append) for lines in simulated]
    replay = twin_recorded.RecordedTwin(setup, requests, fleet, sinks, pinned=routed == "pinned")
    summary = replay.run()
    for sink in sinks:
        sink.close()

    # Each request on the worker live ran it, and each worker's scheduler planned what live planned.
    assert {rid: p.workers for rid, p in replay.progress.items()} == {
        rid: [f"{i}"] for i, w in enumerate(fleet) for rid in w.arrivals
    }
    for i, worker in enumerate(fleet):
        live_lines = timeline(list(read_entries(record / f"{worker.header.limits.worker_id}-1")))
        assert planned(simulated[i]) == planned(live_lines), f"worker {i}"
        assert sorted(rid for line in simulated[i] for rid in line.finished) == sorted(worker.arrivals)
    assert any(len(line.decodes) > 1 for lines in simulated for line in lines)  # requests ran together
    assert summary["finish_reasons"] == {"length": len(FLEET_TRACE)}
    assert replay.steps == sum(len(w.seconds) for w in fleet)


def test_recorded_cost_names_what_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE[:2]))
    assert sim.main([str(trace), "--cost", f"recorded:{tmp_path / 'none'}", "--summary-only"]) == 2
    assert "--cost recorded:" in capsys.readouterr().err
    # A recording of one request cannot time the steps of two.
    rec = tmp_path / "rec"
    assert sim.main([str(trace), "--limit", "1", "--summary-only", "--record", str(rec)]) == 0
    capsys.readouterr()
    assert sim.main([str(trace), "--cost", f"recorded:{rec}", "--summary-only"]) == 1
    assert "was not measured in the recording" in capsys.readouterr().err
    # One worker's recorded steps cannot time a fleet's (it ran them on the default model instead).
    assert sim.main([str(trace), "--workers", "2", "--cost", f"recorded:{rec}", "--summary-only"]) == 2
    assert "--cost recorded:DIR times one worker's steps" in capsys.readouterr().err
    # Its own recording times a run exactly: the simulated clock is the recorded steps' sum.
    assert sim.main([str(trace), "--limit", "1", "--cost", f"recorded:{rec}", "--summary-only"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["simulated_s"] == pytest.approx(
        sum(costs.recorded_steps(f"recorded:{rec}").seconds.values()), abs=1e-5
    )


BURSTS = [
    {"rid": f"b{i}", "arrival": 50.0 * (i // 4), "prompt_len": 20 + 3 * i, "max_new_tokens": 6 + i % 3}
    for i in range(12)
]


@pytest.mark.parametrize("replay", ["simulation", "fleet twin"])
def test_a_request_that_came_after_the_scheduler_went_idle_waits_for_it_to_go_idle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replay: str
) -> None:
    """Live, a request stamped with step S can come before or after the scheduler went idle at S,
    and going idle resets the admission ratio; a replay that hands it over before its scheduler goes
    idle there plans with a decayed ratio instead. A recording of bursts (each after the scheduler
    went idle) replays exactly, and only, with the order the recording shows."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in BURSTS))
    record = tmp_path / "rec"
    assert sim.main([str(trace), "--summary-only", "--cost", "0.01,0,0", "--record", str(record)]) == 0
    capsys.readouterr()
    recorded = twin_recorded.read_worker(record)
    assert recorded.after_idle == {f"b{i}" for i in range(4, 12)}  # the second and third bursts
    live = planned(timeline(list(read_entries(record))))
    header = recorded.header

    def replayed(after_idle: frozenset[str]) -> list[dict[str, object]]:
        lines: list[StepLine] = []
        sink = TimelineSink(lines.append)
        requests = [sim.to_request(e) for e in client_traces.load_trace(trace, header.limits.vocab_size)]
        if replay == "simulation":
            setup = sim.SimSetup(
                header.scheduler, header.limits, sim.CostModel(), recorded_seconds=recorded.seconds
            )
            sim.Simulation(setup, requests, sink, recorded.arrivals, after_idle).run()
        else:
            base = sim.SimSetup(header.scheduler, header.limits, sim.CostModel())
            setup = twin.TwinSetup(base, ("mixed",), (sim.CostModel(),))
            fleet = [dataclasses.replace(recorded, after_idle=after_idle)]
            twin_recorded.RecordedTwin(setup, requests, fleet, [sink]).run()
        sink.close()
        return planned(lines)

    assert replayed(recorded.after_idle) == live
    assert replayed(frozenset()) != live


# Two requests, the second one's last finish decided while steps that overlap planned after it still
# run (see below).
SLOW_TRACE = [
    {"rid": f"s{i}", "arrival": 0.0, "prompt_len": 16 + 4 * i, "max_new_tokens": 2 + i} for i in range(2)
]


@pytest.mark.slow
@pytest.mark.parametrize(
    # Steps long enough (0.8 s) that the last one is still running when `up` is stopped right after
    # the client has its last finish, the bench's exit included, on a loaded machine.
    "recorded_stack",
    [pytest.param(["--backend", "sim", "--sim-cost", "0.8,0,0"], id="sim")],
    indirect=True,
)
async def test_a_stack_stopped_at_the_clients_last_finish_leaves_a_recording_the_simulator_times(
    recorded_stack: tuple[str, Path, Callable[[], None]], tmp_path: Path
) -> None:
    """A user stops `up` as soon as the client has its last finish: the steps that overlap had
    planned by then were still running and have no result in the recording. The simulator plans them
    too, after every request finished, and gives them 0 s instead of refusing the recording."""
    address, record, stop = recorded_stack
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in SLOW_TRACE))
    args = ["bench", "--address", address, "--dataset", "trace", str(trace), "--vocab", "1024", "--json"]
    code, _, err = await run_cli_async(args)
    assert code == 0, err
    stop()
    recorded = twin_recorded.read_worker(record)
    assert recorded.cut_off  # the stop came while the trailing steps ran
    header = recorded.header
    setup = sim.SimSetup(
        header.scheduler,
        header.limits,
        sim.CostModel(),
        recorded_seconds=recorded.seconds,
        recorded_cut_off=recorded.cut_off,
    )
    requests = [sim.to_request(e) for e in client_traces.load_trace(trace, header.limits.vocab_size)]
    simulated: list[StepLine] = []
    sink = TimelineSink(simulated.append)
    simulation = sim.Simulation(setup, requests, sink, recorded.arrivals, recorded.after_idle)
    summary = simulation.run()
    sink.close()
    assert planned(simulated) == planned(timeline(list(read_entries(record))))
    assert simulation.unmeasured == sorted(recorded.cut_off)
    assert summary["finish_reasons"] == {"length": len(SLOW_TRACE)}
    assert summary["simulated_s"] == pytest.approx(sum(recorded.seconds.values()), abs=1e-5)
