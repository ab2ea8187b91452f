"""A recording's timing stamps (entries.py `at_s`, `received_s`; stepwise/stamps.py): written by a
live control plane's recorder only, kept by the codec, absent (0) in older recordings, which still
fit as before; and `simulate --fit-cost --fit-interval` recovers known spans and client path terms
from a stamped recording, which `--cost FILE` then puts on the simulated clock."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest

from control_plane.config import SchedulerConfig
from control_plane.record import codec
from control_plane.record.entries import AddRequest, ApplyResult, Entry, Finished, Header, NextPlan, OnIdle
from control_plane.record.files import read_entries, varint
from control_plane.record.recorder import RecordingScheduler, note_received
from control_plane.request import FinishReason, RequestParams
from data_plane.sim import CostModel
from protos.stepwise.v1 import record_pb2 as rec_pb
from protos.worker import StepResult, WorkerLimits
from stepwise import cost_fit
from stepwise import simulate as sim
from stepwise.costs import ClientPath
from tests.record.conftest import write_trace

pytestmark = pytest.mark.timeout(120)

MODEL = CostModel(0.002, 3e-5, 1e-7, 4e-5)
# What the synthetic live run adds: to every step's span, to every arrival, to every publication.
HAND_OFF, ARRIVE, PUBLISH = 0.0007, 0.0031, 0.0012

LIMITS = WorkerLimits(
    worker_id="w", kv_capacity_tokens=4096, page_size=1, max_context=4096, vocab_size=1000,
    eos_token_ids=frozenset({0}), model_fingerprint="m", dtype="sim", device="sim",
)  # fmt: skip


def _trace(tmp_path: Path) -> Path:
    """Two bursts 100 s apart, varied prompts and outputs: idle arrivals, prefill, decode and mixed steps."""
    requests = [
        {"rid": f"r{i}", "arrival": 100.0 * (i // 20) + 0.004 * (i % 20), "prompt_len": 20 + (37 * i) % 300}
        | {"max_new_tokens": 24, "output_len": 4 + (7 * i) % 19}
        for i in range(40)
    ]
    return write_trace(tmp_path / "trace.jsonl", requests)


def _stamped(entries: Iterable[Entry]) -> Iterator[Entry]:
    """A simulation's recording as a live control plane would have stamped it, had every step's span
    been its modelled seconds plus HAND_OFF, every call reached the scheduler ARRIVE after the
    frontend, and every finish been published PUBLISH after its step's result."""
    clock, applied, planned, idle = 1000.0, 0.0, {}, -1
    for e in entries:
        if isinstance(e, OnIdle):
            idle = e.step
        elif isinstance(e, AddRequest) and e.step == idle:
            clock += 0.5  # the idle wait for the call (no term)
            e = dataclasses.replace(e, received_s=clock, at_s=clock + ARRIVE)
            clock += ARRIVE
        elif isinstance(e, AddRequest):  # a call in a busy stretch waits for the step in flight too
            e = dataclasses.replace(e, received_s=clock - ARRIVE - 0.002, at_s=clock)
        elif isinstance(e, NextPlan) and e.plan is not None:
            planned[e.plan.step_id] = clock
            e = dataclasses.replace(e, at_s=clock)
        elif isinstance(e, ApplyResult):
            start = max(applied, planned.pop(e.result.step_id))
            applied = clock = max(clock, start + e.result.forward_s + HAND_OFF)
            e = dataclasses.replace(e, at_s=applied)
        elif isinstance(e, Finished):
            e = dataclasses.replace(e, at_s=applied + PUBLISH)
        yield e


def _record(tmp_path: Path, name: str, stamp: bool) -> Path:
    plain = tmp_path / f"plain-{name}"
    assert (
        sim.main([str(_trace(tmp_path)), "--summary-only", "--cost", MODEL.spec(), "--record", str(plain)])
        == 0
    )
    (part,) = plain.glob("*.rec")
    entries = list(read_entries(part))
    if stamp:
        entries = list(_stamped(entries))
    out = tmp_path / name
    out.mkdir()
    (out / part.name).write_bytes(b"".join(varint(len(b)) + b for b in map(codec.encode, entries)))
    return out


def test_the_codec_keeps_the_stamps_and_reads_unstamped_records_as_zero() -> None:
    params = RequestParams(max_new_tokens=4)
    result = StepResult(step_id=3, token_ids=np.array([5], np.int64))
    stamped: list[Entry] = [
        AddRequest(2, "r", (1, 2), params, "", at_s=12.5, received_s=12.25),
        NextPlan(2, None, False, at_s=13.0),
        ApplyResult(result, at_s=14.0),
        Finished(3, "r", FinishReason.length("4 tokens"), 0, at_s=14.5),
    ]
    for entry in stamped:
        decoded = codec.decode(codec.encode(entry))
        assert type(decoded) is type(entry) and decoded.at_s == entry.at_s
    assert codec.decode(codec.encode(stamped[0])).received_s == 12.25
    # A record written before the stamps: the fields are absent from its bytes.
    old = rec_pb.Record(add_request=rec_pb.AddRequestCall(step=1, rid="r", input_ids=[1]))
    decoded = codec.decode(old.SerializeToString())
    assert isinstance(decoded, AddRequest) and decoded.at_s == decoded.received_s == 0.0


def test_the_recorder_stamps_with_its_clock_and_a_simulation_does_not(tmp_path: Path) -> None:
    written: list[Entry] = []

    class Sink:
        def write(self, entry: Entry) -> None:
            written.append(entry)

        def end_step(self, step: int) -> None: ...

        def close(self) -> None: ...

    ticks = itertools.count(100)
    scheduler = RecordingScheduler(SchedulerConfig(), LIMITS, Sink(), lambda: float(next(ticks)))
    note_received(scheduler, "r", 42.0)
    scheduler.add_request("r", [1, 2, 3], RequestParams(max_new_tokens=1))
    plan = scheduler.next_plan()
    assert plan is not None
    scheduler.apply_result(StepResult(plan.step_id, np.array([7], np.int64)))
    scheduler.take_updates()
    add, nxt, apply_, finished = (
        e for e in written if not isinstance(e, Header) and e.__class__.__name__ != "StepFigures"
    )
    assert (add.received_s, add.at_s, nxt.at_s, apply_.at_s, finished.at_s) == (
        42.0,
        100.0,
        101.0,
        102.0,
        103.0,
    )

    plain = tmp_path / "plain"
    write_trace(tmp_path / "t.jsonl", [{"rid": "a", "arrival": 0, "prompt_len": 9, "max_new_tokens": 3}])
    assert sim.main([str(tmp_path / "t.jsonl"), "--summary-only", "--record", str(plain)]) == 0
    stamps = [getattr(e, "at_s", 0.0) for e in read_entries(next(plain.glob("*.rec")))]
    assert stamps and not any(stamps)  # a simulation's recording stays byte-for-byte deterministic


def test_fit_interval_recovers_spans_and_client_terms_from_a_stamped_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _record(tmp_path, "stamped", stamp=True)
    steps = cost_fit.read_steps(path, interval=True)
    assert steps.skipped.by_span and steps.stamps.arrivals and steps.stamps.publishes
    fit = cost_fit.fit_steps([steps])
    a, p, r, c = fit.coefficients
    assert (a, p, r, c) == pytest.approx((MODEL.a + HAND_OFF, MODEL.b, MODEL.b + MODEL.d, MODEL.c), rel=1e-6)
    terms = cost_fit.client_terms([steps])
    assert (terms.arrive_s, terms.publish_s) == pytest.approx((ARRIVE, PUBLISH), rel=1e-3)
    capsys.readouterr()
    assert sim.main(["--fit-cost", str(path), "--fit-interval", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["fitted_to"] == "span"
    assert (fitted["arrive_s"], fitted["publish_s"]) == pytest.approx((ARRIVE, PUBLISH), rel=1e-3)
    assert sim.main(["--fit-cost", str(path), "--fit-interval"]) == 0
    text = capsys.readouterr().out
    assert "steps' spans on the control plane's clock" in text and "client path: arrive 3.1000 ms" in text
    assert "hand-off: 0.7000 ms a busy step's span" in text  # the sim's results wait 0 for their plans
    # Forwards stay forwards: the stamps change only what --fit-interval times.
    by_forward = cost_fit.fit_steps([cost_fit.read_steps(path)])
    assert by_forward.coefficients[0] == pytest.approx(MODEL.a, rel=1e-6)


def test_an_unstamped_recording_fits_as_before(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _record(tmp_path, "unstamped", stamp=False)
    steps = cost_fit.read_steps(path, interval=True)
    assert not steps.stamps.stamped and not steps.skipped.by_span
    assert cost_fit.client_terms([steps]) == ClientPath()
    capsys.readouterr()
    assert sim.main(["--fit-cost", str(path), "--fit-interval", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["fitted_to"] == "interval" and fitted["arrive_s"] == fitted["publish_s"] == 0.0
    assert sim.main(["--fit-cost", str(path), "--fit-interval"]) == 0
    assert "client path: not stamped" in capsys.readouterr().out


def test_a_cost_file_puts_the_client_path_on_the_simulated_clock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One request alone: its TTFT and end to end grow by exactly arrive_s + publish_s."""
    trace = write_trace(
        tmp_path / "one.jsonl", [{"rid": "a", "arrival": 1.0, "prompt_len": 50, "max_new_tokens": 5}]
    )
    figures = {}
    for name, extra in (("without", {}), ("with", {"arrive_s": ARRIVE, "publish_s": PUBLISH})):
        model = tmp_path / f"{name}.json"
        model.write_text(json.dumps({"a": MODEL.a, "b": MODEL.b, "c": MODEL.c, "d": MODEL.d, **extra}))
        capsys.readouterr()
        assert sim.main([str(trace), "--summary-only", "--cost", str(model)]) == 0
        figures[name] = json.loads(capsys.readouterr().out)["summary"]
    for key in ("ttft_p50_s", "latency_p50_s"):
        assert figures["with"][key] - figures["without"][key] == pytest.approx(ARRIVE + PUBLISH, abs=1e-9)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"a": 0.1, "b": 0, "c": 0, "publish_s": -1}))
    assert sim.main([str(trace), "--summary-only", "--cost", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "publish_s" in err and err.count("\n") == 1


def test_cost_jitter_draws_the_fits_residuals_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fit's JSON carries its residuals' quantiles; --cost-jitter adds one draw to each step:
    with every quantile at +10 ms, a lone request's one-step TTFT is 10 ms longer. Draws are
    seeded: two runs print the same bytes."""
    path = _record(tmp_path, "stamped", stamp=True)
    capsys.readouterr()
    assert sim.main(["--fit-cost", str(path), "--fit-interval", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    quantiles = fitted["residual_quantiles_s"]
    assert len(quantiles) == cost_fit.JITTER_QUANTILES and quantiles == sorted(quantiles)
    assert max(map(abs, quantiles)) < 1e-9  # the synthetic spans are the model's exactly

    trace = write_trace(
        tmp_path / "one.jsonl", [{"rid": "a", "arrival": 1.0, "prompt_len": 50, "max_new_tokens": 1}]
    )
    runs = {}
    for name, shift in (("plain", None), ("jitter", 0.01)):
        model = tmp_path / f"{name}.json"
        model.write_text(
            json.dumps({"a": MODEL.a, "b": MODEL.b, "c": MODEL.c, "residual_quantiles_s": [shift or 0.0] * 3})
        )
        jitter = [] if shift is None else ["--cost-jitter"]
        capsys.readouterr()
        assert sim.main([str(trace), "--summary-only", "--cost", str(model), *jitter]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["summary"]
    assert runs["jitter"]["ttft_p50_s"] - runs["plain"]["ttft_p50_s"] == pytest.approx(0.01, abs=1e-9)

    spread = tmp_path / "spread.json"
    spread.write_text(json.dumps({**fitted, "residual_quantiles_s": [-0.001, 0.0, 0.02]}))
    outputs = []
    for _ in range(2):
        capsys.readouterr()
        assert (
            sim.main([str(_trace(tmp_path)), "--summary-only", "--cost", str(spread), "--cost-jitter"]) == 0
        )
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]

    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"a": MODEL.a, "b": MODEL.b, "c": MODEL.c}))
    for cost in ("0.001,0,0", str(bare)):
        assert sim.main([str(trace), "--summary-only", "--cost", cost, "--cost-jitter"]) == 2
        err = capsys.readouterr().err
        assert "--cost-jitter wants --cost FILE" in err and err.count("\n") == 1
