"""`stepwise simulate --fit-cost`: the fit recovers known models, refuses steps that cannot give one,
and reads the steps of a recording as the sim worker counted them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from control_plane.record.entries import ApplyResult, Entry, NextPlan
from control_plane.record.files import read_entries
from data_plane.sim import CostModel
from stepwise import cost_fit
from stepwise import simulate as sim
from stepwise.cost_fit import CostFitError, Skipped, StepShape, fit_cost, step_shapes
from tests.record.conftest import write_trace

pytestmark = pytest.mark.timeout(120)

# a, prefill token, decode row, context token (seconds).
KNOWN = (0.002, 3e-5, 7e-5, 1e-7)


def _shapes(n: int, seed: int = 0, noise: float = 0.0, coef: tuple[float, ...] = KNOWN) -> list[StepShape]:
    """Prefill-only, decode-only and mixed steps of random sizes, timed by `coef` (times 1 ± noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prefill = int(rng.integers(1, 2048)) if i % 3 != 1 else 0
        rows = int(rng.integers(1, 64)) if i % 3 != 0 else 0
        context = prefill + rows * int(rng.integers(16, 4096))
        seconds = coef[0] + coef[1] * prefill + coef[2] * rows + coef[3] * context
        out.append(StepShape(prefill, rows, context, seconds * (1 + noise * rng.uniform(-1, 1))))
    return out


def test_the_fit_recovers_known_coefficients() -> None:
    fit = fit_cost(_shapes(200))
    assert fit.coefficients == pytest.approx(KNOWN, rel=1e-9)
    assert fit.pinned == ()
    assert fit.test.steps == 40 and fit.train.steps == 160  # every fifth step held out
    assert fit.test.r2 == pytest.approx(1.0) and fit.test.p90_rel < 1e-9
    model = fit.model
    assert (model.a, model.b, model.c) == pytest.approx(KNOWN[:2] + KNOWN[3:], rel=1e-9)
    assert model.b + model.d == pytest.approx(KNOWN[2], rel=1e-9)  # a decode row's whole price


def test_the_fit_holds_up_under_noise() -> None:
    """±5% noise on every step: each coefficient within 5%, and the held-out error says ~2.5%."""
    fit = fit_cost(_shapes(2000, seed=3, noise=0.05))
    assert fit.coefficients == pytest.approx(KNOWN, rel=0.05)
    assert 0.015 < fit.test.mean_rel < 0.035
    assert fit.test.r2 > 0.99


def test_a_term_that_would_come_out_negative_is_pinned_at_zero() -> None:
    """Steps that get cheaper with context (noise, in a real recording): c is held at 0, not fitted
    below it, and the report says so."""
    fit = fit_cost(_shapes(200, coef=(0.002, 3e-5, 7e-5, -1e-8)))
    assert fit.coefficients[3] == 0.0
    assert fit.pinned == ("context token",)
    assert min(fit.coefficients) >= 0


@pytest.mark.parametrize(
    ("shapes", "why"),
    [
        ([StepShape(0, 8, 800 + i, 0.01) for i in range(100)], "decode-only"),
        ([StepShape(100 + i, 0, 100 + i, 0.01) for i in range(100)], "no step of 80 decodes"),
        ([StepShape(100, 8, 900, 0.01 + 1e-4 * i) for i in range(100)], "cannot tell the four terms apart"),
        (_shapes(19), "19 steps with work; a fit needs at least 20"),
    ],
)
def test_steps_that_cannot_give_a_fit_are_refused(shapes: list[StepShape], why: str) -> None:
    with pytest.raises(CostFitError, match=why):
        fit_cost(shapes)


def _trace(tmp_path: Path) -> Path:
    """Varied prompt lengths, shared prefixes, arrivals during decode: prefill, decode and mixed steps."""
    requests = [
        {"rid": f"r{i}", "arrival": 0.004 * i, "prompt_len": 20 + (37 * i) % 300, "max_new_tokens": 24}
        | {"prefix_group": f"g{i % 3}", "prefix_len": 16, "output_len": 4 + (7 * i) % 19}
        for i in range(40)
    ]
    return write_trace(tmp_path / "trace.jsonl", requests)


def _record(tmp_path: Path, cost: str, *flags: str) -> Path:
    out = tmp_path / f"rec-{cost}-{len(list(tmp_path.glob('rec-*')))}"
    argv = [str(_trace(tmp_path)), "--summary-only", "--cost", cost, "--record", str(out), *flags]
    assert sim.main(argv) == 0
    return out


@pytest.mark.parametrize(
    ("cost", "field"),
    [("1,1,0,0", "new"), ("1,0,1,0", "context_tokens"), ("1,0,0,1", "decode_rows")],
)
def test_recorded_steps_read_as_the_sim_worker_counted_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cost: str, field: str
) -> None:
    """With a model that charges one second a step and one per unit of one term, each step's
    recorded time is 1 + that term as the sim worker counted it; the steps read from the recording
    must agree, step by step (chunked prefills, cached prefixes and retractions included)."""
    monkeypatch.setenv("STEPWISE_INIT_NEW_TOKEN_RATIO", "0.01")  # admit optimistically, then retract
    capsys.readouterr()
    path = _record(tmp_path, cost, "--chunked-prefill-size", "64", "--kv-tokens", "700")
    assert json.loads(capsys.readouterr().out)["summary"]["retractions"] > 0
    skipped = Skipped()
    shapes = step_shapes(read_entries(path), skipped)
    assert len(shapes) > 50 and skipped.failed == skipped.unknown_context == 0
    for shape in shapes:
        counted = shape.prefill_tokens + shape.decode_rows if field == "new" else getattr(shape, field)
        assert shape.seconds == 1 + counted


def test_fit_cost_recovers_the_model_a_simulation_ran_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`simulate --record` with a known model, then `simulate --fit-cost` on the recording: the same
    model, printed and as JSON that `--cost FILE` reads back."""
    model = CostModel(0.002, 3e-5, 1e-7, 4e-5)
    path = _record(tmp_path, model.spec(), "--chunked-prefill-size", "128")
    capsys.readouterr()
    assert sim.main(["--fit-cost", str(path)]) == 0
    text = capsys.readouterr().out
    assert "held out: R² 1.0000" in text and "p90 0.0%" in text
    assert sim.main(["--fit-cost", str(path), "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert [fitted[k] for k in "abcd"] == pytest.approx([model.a, model.b, model.c, model.d], rel=1e-6)
    saved = tmp_path / "model.json"
    saved.write_text(json.dumps(fitted))
    assert sim.main([str(_trace(tmp_path)), "--summary-only", "--cost", str(saved)]) == 0
    by_file = capsys.readouterr().out
    assert sim.main([str(_trace(tmp_path)), "--summary-only", "--cost", model.spec()]) == 0
    # Close to the bit but not always on it: the fit's last digits differ.
    assert json.loads(by_file)["summary"]["steps"] == json.loads(capsys.readouterr().out)["summary"]["steps"]


def test_fit_cost_refuses_a_bad_path_and_a_short_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert sim.main(["--fit-cost", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere" in err and "--fit-cost" in err
    short = tmp_path / "short.jsonl"
    write_trace(short, [{"rid": "a", "arrival": 0, "prompt_len": 10, "max_new_tokens": 3}])
    assert sim.main([str(short), "--summary-only", "--record", str(tmp_path / "rec")]) == 0
    capsys.readouterr()
    assert sim.main(["--fit-cost", str(tmp_path / "rec")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs at least 20" in err


def test_recordings_of_different_worker_kinds_are_not_fitted_together(tmp_path: Path) -> None:
    """One model per kind of worker: the same steps said to come from another device are refused."""
    sim_steps = cost_fit.read_steps(_record(tmp_path, "0.001,0.0001,0,0.0001"))
    assert cost_fit.fit_steps([sim_steps, sim_steps]).test.r2 == pytest.approx(1.0)
    limits = dataclasses.replace(sim_steps.header.limits, device="cuda:0")
    other = dataclasses.replace(sim_steps, header=dataclasses.replace(sim_steps.header, limits=limits))
    with pytest.raises(CostFitError, match="different worker kinds"):
        cost_fit.fit_steps([sim_steps, other])


@pytest.mark.parametrize("cost", ["0.01,0,0,-1", "fast", "1,2"])
def test_a_bad_cost_is_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cost: str
) -> None:
    capsys.readouterr()
    assert sim.main([str(_trace(tmp_path)), "--cost", cost]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cost" in err


def test_a_named_cost_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--cost default` is the built-in default, byte for byte."""
    capsys.readouterr()
    assert sim.main([str(_trace(tmp_path)), "--summary-only", "--cost", "default"]) == 0
    named = capsys.readouterr().out
    assert sim.main([str(_trace(tmp_path)), "--summary-only"]) == 0
    assert named == capsys.readouterr().out


def test_fit_cost_from_the_environment_and_not_with_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """STEPWISE_FIT_COST names one recording; a trace beside --fit-cost is refused, not ignored."""
    path = _record(tmp_path, "0.001,0.0001,1e-06,0.0002")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        sim.main([str(_trace(tmp_path)), "--fit-cost", str(path)])
    assert exited.value.code == 2 and "--fit-cost" in capsys.readouterr().err
    monkeypatch.setenv("STEPWISE_FIT_COST", str(path))
    assert sim.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost"] == "0.001,0.0001,1e-06,0.0002"


def test_check_cost_measures_the_fit_on_another_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--check-cost: the fit of one run measured on every step of another. Another run of the same
    model (other chunks) is predicted exactly; one whose steps cost twice as much comes out at half."""
    fitted = _record(tmp_path, "0.001,0.0001,1e-06,0.0002")
    same = _record(tmp_path, "0.001,0.0001,1e-06,0.0002", "--chunked-prefill-size", "32")
    double = _record(tmp_path, "0.002,0.0002,2e-06,0.0004")
    capsys.readouterr()
    assert sim.main(["--fit-cost", str(fitted), "--check-cost", str(same), "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)["other_runs"]
    assert checked["r2"] == pytest.approx(1.0) and checked["total_rel"] == pytest.approx(0.0, abs=1e-9)
    assert sim.main(["--fit-cost", str(fitted), "--check-cost", str(double)]) == 0
    assert "other run: R²" in capsys.readouterr().out
    assert sim.main(["--fit-cost", str(fitted), "--check-cost", str(double), "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)["other_runs"]
    assert checked["total_rel"] == pytest.approx(-0.5) and checked["mean_rel"] == pytest.approx(0.5)
    with pytest.raises(SystemExit) as exited:
        sim.main(["--check-cost", str(same)])
    assert exited.value.code == 2 and "--fit-cost" in capsys.readouterr().err


def test_every_named_model_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each name --cost offers runs a trace; the H200 model (more bandwidth, same FLOPs) is faster
    than the H100's on the same trace."""
    from stepwise import costs

    simulated = {}
    for name in costs.NAMED:
        capsys.readouterr()
        assert sim.main([str(_trace(tmp_path)), "--summary-only", "--cost", name]) == 0
        simulated[name] = json.loads(capsys.readouterr().out)["summary"]["simulated_s"]
    assert simulated["h200-llama3-8b"] < simulated["h100-llama3-8b"]


def test_an_interval_is_the_forward_and_the_wait_for_the_next_plan(tmp_path: Path) -> None:
    """`--fit-interval`: each step timed by its forward plus the next result's wait_s, except the
    steps after which the scheduler went idle (the next wait is for an arrival) and the last one (no
    next result)."""
    burst = [
        {"rid": f"r{i}", "arrival": 100.0 * (i // 3), "prompt_len": 20 + i, "max_new_tokens": 3}
        for i in range(9)
    ]
    trace = write_trace(tmp_path / "bursts.jsonl", burst)
    path = tmp_path / "rec"
    assert sim.main([str(trace), "--summary-only", "--cost", "1,0,0,0", "--record", str(path)]) == 0
    entries = list(read_entries(path))
    # Step k's result says it waited k ms for its plan; the scheduler also planned nothing just
    # before plan 2 (as when the last request of a step finished and the next had not arrived).
    timed: list[Entry] = []
    for e in entries:
        if isinstance(e, ApplyResult):
            e = dataclasses.replace(e, result=dataclasses.replace(e.result, wait_s=e.result.step_id / 1000))
        if isinstance(e, NextPlan) and e.plan is not None and e.plan.step_id == 2:
            timed.append(NextPlan(e.step, None))
        timed.append(e)
    by_forward = step_shapes(timed, Skipped())
    skipped = Skipped()
    by_interval = step_shapes(timed, skipped, interval=True)
    results = {e.result.step_id for e in timed if isinstance(e, ApplyResult)}
    idle_before = {e.plan.step_id for e in _after_none(timed)}
    assert {2, 6, 11} <= idle_before  # the one made up and the two between the bursts
    kept = [s for s in by_forward if s.step + 1 in results and s.step + 1 not in idle_before]
    assert 1 in {s.step for s in by_forward} - {s.step for s in kept}
    assert [(s.step, s.seconds + (s.step + 1) / 1000) for s in kept] == [
        (s.step, s.seconds) for s in by_interval
    ]
    assert skipped.no_interval == len(by_forward) - len(kept) > 0


def _after_none(entries: list[object]) -> list[NextPlan]:
    """The plans made after a NextPlan that planned nothing."""
    out, idle = [], False
    for e in entries:
        if isinstance(e, NextPlan):
            if e.plan is not None and idle:
                out.append(e)
            idle = e.plan is None
    return out


def test_fit_interval_is_said_and_wants_a_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _record(tmp_path, "0.002,3e-05,1e-07,4e-05")
    capsys.readouterr()
    assert sim.main(["--fit-cost", str(path), "--fit-interval", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fitted_to"] == "interval"
    assert sim.main(["--fit-cost", str(path), "--fit-interval"]) == 0
    assert "steps' intervals (forward and the wait for the next plan)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        sim.main([str(_trace(tmp_path)), "--fit-interval"])
    assert exit_.value.code == 2
    assert "--fit-interval says what --fit-cost fits" in capsys.readouterr().err
