"""`stepwise simulate --fit-cost RECORDING...`: a step cost model fitted to a worker's measured steps.

A recording holds every plan and every result the worker sent back, and each result carries the
seconds its forward took (StepResult.forward_s, measured by the worker). A step's shape comes from
its plan: prefill tokens (the extends' lengths), decode rows, and context tokens as the sim worker
counts them (each extended or decoded sequence's length after the step), the lengths followed
through the plans from the session's start. So recordings need nothing new: any recording of
format 2 fits.

The fit: `seconds = a + p·prefill tokens + r·decode rows + c·context tokens`, least squares on
the seconds themselves, every coefficient >= 0 (the best of the fits that leave any negative ones
out). A simulated clock is a sum of step times and a request's latency a sum over its steps: an
unweighted fit with a step term keeps the model's total equal to the measured total (weighting by
1/seconds fitted single short steps better, but ran 13-34% short in total on this project's CPU
recordings). Every fifth step (in recording order) is held out; the model printed is fitted on the other
four fifths, and its error is measured on the held-out fifth: R², mean absolute error, mean and
p90 relative error, and the error of the total (the model's seconds summed over the steps against
the measured sum); `--check-cost` measures it on every step of other runs too. As a CostModel
(a + b·new tokens + c·context + d·decode rows, new tokens counting each decode row once) it is
a, b = p, c, d = r - p.

Steps without work (no extend, no decode), steps the worker failed, and steps whose context is not
known (a recording read from a later part on, before the decoded sequences' prefills) are left out.

`--fit-interval` fits each step's interval instead of its forward: from the start of the step to
the start of the next one on the worker, its forward_s plus the next result's wait_s (how long the
worker waited for the next plan: the control plane's turn between steps, applying a result,
publishing its tokens, planning, encoding and sending, where it outlasts the worker's forward). A
step after which the control plane had nothing to plan (a NextPlan without a plan before the next
one) is left out, its gap being the wait for an arrival, as is the last step. A simulated clock
that advances by such a model counts what a live worker's busy stretch takes, not only its forwards
(docs/performance.md#the-simulator-against-live).

A recording a live control plane stamped (stamps.py) times each step by its span on the control
plane's clock instead, under `--fit-interval`: the interval as the control plane lived it, the
worker's hand-off of each plan to its thread and of its result back, and the way between them,
included, and the steps after an idle wait too (their span is the plan's round trip). A stamped
recording also gives the client path's two terms (`arrive_s`, `publish_s`, stamps.py), which
the fit prints and its JSON carries for `--cost FILE` (stepwise.costs.ClientPath).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from control_plane.record.codec import unsupported_format
from control_plane.record.entries import ApplyResult, Entry, Header, NextPlan
from control_plane.record.files import RecordingError, RecordingReader, TruncatedRecording
from data_plane.sim import CostModel
from flagtypes.table import SWITCH, Flag, Flags
from protos.worker import StepPlan
from stepwise.costs import ClientPath
from stepwise.stamps import Stamps

# Fewer steps than this cannot give a fit and a held-out error worth printing.
MIN_STEPS = 20
HOLDOUT_EVERY = 5
# Residual quantiles a fit's JSON carries (0, 1/1000, ..., 1): the tail to a thousandth.
JITTER_QUANTILES = 1001
TERMS = ("step", "prefill token", "decode row", "context token")


class CostFitError(ValueError):
    """The steps cannot give a fit; the message says why."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """One executed step: what it computed, and the seconds the worker measured."""

    prefill_tokens: int
    decode_rows: int
    context_tokens: int
    seconds: float
    step: int = -1


@dataclass(slots=True)
class Skipped:
    empty: int = 0
    # Failed, or without a measured time (forward_s 0: a replay's results).
    failed: int = 0
    unknown_context: int = 0
    # Fitting intervals: the next step waited for an arrival, or none came (by span: no span).
    no_interval: int = 0
    # Fitting intervals of a stamped recording: timed by spans (stamps.py).
    by_span: bool = False

    def total(self) -> int:
        return self.empty + self.failed + self.unknown_context + self.no_interval


@dataclass(frozen=True, slots=True)
class Errors:
    steps: int
    r2: float
    mean_abs_s: float
    mean_rel: float
    p90_rel: float
    # Σ modelled / Σ measured - 1.
    total_rel: float


@dataclass(frozen=True, slots=True)
class CostFit:
    # a, p, r, c: seconds per step, prefill token, decode row, context token.
    coefficients: tuple[float, float, float, float]
    train: Errors
    test: Errors
    # Terms the non-negative fit left at 0.
    pinned: tuple[str, ...] = ()
    # The error on every step of other runs (--check-cost), when given.
    other: Errors | None = None
    # Quantiles (at 0, 1/1000, ..., 1) of the fitted steps' residuals, measured less modelled seconds:
    # what `simulate --cost-jitter` draws from.
    residual_quantiles: tuple[float, ...] = ()

    @property
    def model(self) -> CostModel:
        """The fit as a CostModel, to four significant digits (the data is noisier than that, and
        the last digits of a solve differ between BLAS builds)."""
        a, p, r, c = (float(f"{x:.4g}") for x in self.coefficients)
        return CostModel(a, p, c, float(f"{r - p:.4g}"))


# --- steps from a recording -----------------------------------------------------------------------


@dataclass(slots=True)
class _Lengths:
    """Each live sequence's length, followed through the plans as the sim worker follows it."""

    of: dict[int, int] = field(default_factory=dict)

    def shape(self, plan: StepPlan) -> tuple[int, int, int] | None:
        """(prefill tokens, decode rows, context tokens) of the plan; None if a decoded sequence's
        length is unknown."""
        if plan.reset:
            self.of.clear()
        for handle in plan.releases.tolist():
            self.of.pop(handle, None)
        for restore in plan.restores:
            self.of[restore.handle] = len(restore.slots)
        for new in plan.new_seqs:
            self.of[new.handle] = len(new.prefix_slots)
        ext = plan.extends
        ends = (ext.starts.astype(np.int64) + ext.lens).tolist()
        for handle, end in zip(ext.handles.tolist(), ends, strict=True):
            self.of[handle] = end
        known = True
        decoded = 0
        for handle in plan.decodes.handles.tolist():
            if handle in self.of:
                self.of[handle] += 1
                decoded += self.of[handle]
            else:
                known = False
        if not known:
            return None
        return int(ext.lens.sum()), len(plan.decodes), int(sum(ends)) + decoded


def step_shapes(entries: Iterable[Entry], skipped: Skipped, interval: bool = False) -> list[StepShape]:
    """Every executed step with work, in recording order, timed by its forward (`interval`: by its
    interval, see the module docstring); what is left out is counted in `skipped`."""
    if interval:
        return _intervals(entries, skipped)
    lengths = _Lengths()
    planned: dict[int, tuple[int, int, int] | None] = {}
    shapes: list[StepShape] = []
    for entry in entries:
        if isinstance(entry, NextPlan) and entry.plan is not None:
            planned[entry.plan.step_id] = lengths.shape(entry.plan)
        elif isinstance(entry, ApplyResult):
            result = entry.result
            shape = planned.pop(result.step_id, None)
            if shape is not None and shape[0] == shape[1] == 0:
                skipped.empty += 1
            elif result.error or result.forward_s <= 0:
                skipped.failed += 1
            elif shape is None:
                skipped.unknown_context += 1
            else:
                shapes.append(StepShape(*shape, seconds=result.forward_s, step=result.step_id))
    return shapes


def _intervals(entries: Iterable[Entry], skipped: Skipped) -> list[StepShape]:
    """The steps by forward, each lengthened by the next result's wait when the next plan was made
    without the control plane having gone idle in between."""
    after_idle: set[int] = set()
    waits: dict[int, float] = {}

    def noting(entries: Iterable[Entry]) -> Iterable[Entry]:
        idle = False
        for entry in entries:
            if isinstance(entry, NextPlan):
                if entry.plan is not None and idle:
                    after_idle.add(entry.plan.step_id)
                idle = entry.plan is None
            elif isinstance(entry, ApplyResult):
                waits[entry.result.step_id] = entry.result.wait_s
            yield entry

    shapes = []
    for shape in step_shapes(noting(entries), skipped):
        following = shape.step + 1
        if following not in waits or following in after_idle:
            skipped.no_interval += 1
            continue
        shapes.append(dataclasses.replace(shape, seconds=shape.seconds + waits[following]))
    return shapes


def _spans(shapes: list[StepShape], stamps: Stamps, skipped: Skipped) -> list[StepShape]:
    """The steps timed by their spans on the control plane's clock (stamps.py)."""
    timed = []
    for shape in shapes:
        span = stamps.spans.get(shape.step)
        if span is None or span <= 0:
            skipped.no_interval += 1
            continue
        timed.append(dataclasses.replace(shape, seconds=span))
    return timed


@dataclass(frozen=True, slots=True)
class RecordingSteps:
    path: Path
    header: Header
    shapes: list[StepShape]
    skipped: Skipped
    stamps: Stamps = field(default_factory=Stamps)


def read_steps(path: Path, interval: bool = False) -> RecordingSteps:
    """The steps of one recording (`interval`: timed by their spans when the recording is
    stamped, else by their intervals); RecordingError (one line) when it cannot be read."""
    if not path.exists():
        raise RecordingError(f"{path}: no such file or directory")
    reader = RecordingReader(path)
    entries = iter(reader.entries())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncatedRecording)  # a torn tail: the whole steps before it fit
        header = next(entries, None)
        if not isinstance(header, Header):
            raise RecordingError(f"{path}: does not start with a recording header")
        if why := unsupported_format(header):
            raise RecordingError(f"{path}: {why}")
        skipped = Skipped()
        stamps = Stamps()
        listed = list(stamps.noting(entries))
        if interval and stamps.stamped:
            skipped.by_span = True
            shapes = _spans(step_shapes(listed, skipped), stamps, skipped)
        else:
            shapes = step_shapes(listed, skipped, interval)
    return RecordingSteps(path, header, shapes, skipped, stamps)


def client_terms(recordings: Sequence[RecordingSteps]) -> ClientPath:
    """The client path's terms of the stamped recordings, pooled (zeros where none is stamped)."""
    pooled = Stamps()
    for r in recordings:
        pooled.arrivals += r.stamps.arrivals
        pooled.publishes += r.stamps.publishes
    return ClientPath(float(f"{pooled.arrive_s:.4g}"), float(f"{pooled.publish_s:.4g}"))


# --- the fit --------------------------------------------------------------------------------------


def design(shapes: Sequence[StepShape]) -> tuple[np.ndarray, np.ndarray]:
    """The columns (1, prefill tokens, decode rows, context tokens) and the measured seconds."""
    x = np.array([(1.0, s.prefill_tokens, s.decode_rows, s.context_tokens) for s in shapes], dtype=np.float64)
    y = np.array([s.seconds for s in shapes], dtype=np.float64)
    return x.reshape(len(shapes), 4), y


def fit_cost(shapes: Sequence[StepShape], holdout_every: int = HOLDOUT_EVERY) -> CostFit:
    """The non-negative least-squares model of the steps, fitted on all but every `holdout_every`-th
    step and measured on those; CostFitError when the steps cannot tell the terms apart."""
    if len(shapes) < MIN_STEPS:
        raise CostFitError(f"{len(shapes)} steps with work; a fit needs at least {MIN_STEPS}")
    x, y = design(shapes)
    held = np.arange(len(shapes)) % holdout_every == holdout_every - 1
    _check_separable(x[~held])
    coef, pinned = _nonnegative_lstsq(x[~held], y[~held])
    residuals = y[~held] - x[~held] @ coef
    quantiles = np.quantile(residuals, np.linspace(0.0, 1.0, JITTER_QUANTILES))
    return CostFit(
        residual_quantiles=tuple(float(f"{q:.4g}") for q in quantiles),
        coefficients=(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3])),
        train=_errors(x[~held] @ coef, y[~held]),
        test=_errors(x[held] @ coef, y[held]),
        pinned=tuple(TERMS[i] for i in pinned),
    )


def _check_separable(x: np.ndarray) -> None:
    """CostFitError unless every term varies on its own somewhere in the steps."""
    prefill, rows, context = x[:, 1], x[:, 2], x[:, 3]
    if not prefill.any():
        raise CostFitError(
            f"all {len(x)} steps are decode-only: a prefill token's cost cannot be told apart; "
            "record a run where prompts arrive while others decode"
        )
    if not rows.any():
        raise CostFitError(f"no step of {len(x)} decodes: a decode row's cost cannot be told apart")
    scaled = x / np.abs(x).max(axis=0)
    rank = int(np.linalg.matrix_rank(scaled))
    if rank < x.shape[1]:
        same = "context moves in step with the tokens" if context.any() else "no step has context"
        raise CostFitError(
            f"the {len(x)} steps cannot tell the four terms apart (rank {rank}: {same}); "
            "record a run with varied prompt lengths and batch sizes"
        )


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """Least squares with every coefficient >= 0: the best unconstrained fit over each subset of
    the terms whose coefficients all come out >= 0 (four terms: sixteen small solves, exact)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best = np.zeros(x.shape[1])
    best_sse = float(y @ y)
    for size in range(1, x.shape[1] + 1):
        for subset in itertools.combinations(range(x.shape[1]), size):
            cols = list(subset)
            sol, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(x.shape[1])
            coef[cols] = sol / scale[cols]
            residual = x @ coef - y
            sse = float(residual @ residual)
            if sse < best_sse * (1 - 1e-12):
                best, best_sse = coef, sse
    pinned = tuple(int(i) for i in np.flatnonzero(best == 0))
    return best, pinned


def _errors(predicted: np.ndarray, measured: np.ndarray) -> Errors:
    residual = predicted - measured
    total = float(((measured - measured.mean()) ** 2).sum())
    r2 = 1.0 - float(residual @ residual) / total if total > 0 else 0.0
    relative = np.abs(residual) / np.maximum(measured, 1e-12)
    return Errors(
        steps=len(measured),
        r2=r2,
        mean_abs_s=float(np.abs(residual).mean()),
        mean_rel=float(relative.mean()),
        p90_rel=float(np.percentile(relative, 90)),
        total_rel=float(predicted.sum() / measured.sum() - 1.0),
    )


# --- command line ---------------------------------------------------------------------------------


def _kind(header: Header) -> tuple[str, str, str]:
    limits = header.limits
    return limits.model_fingerprint, limits.device, limits.dtype


def fit_steps(recordings: Sequence[RecordingSteps], others: Sequence[RecordingSteps] = ()) -> CostFit:
    """One fit of the recordings' steps, measured also on every step of `others` (other runs);
    CostFitError unless all are of one kind of worker."""
    every = [*recordings, *others]
    if len({_kind(r.header) for r in every}) > 1:
        seen = "; ".join(f"{r.path}: {' '.join(_kind(r.header))}" for r in every)
        raise CostFitError(f"the recordings are of different worker kinds (model, device, dtype): {seen}")
    fit = fit_cost([shape for r in recordings for shape in r.shapes])
    if not others:
        return fit
    checked = [shape for r in others for shape in r.shapes]
    if not checked:
        raise CostFitError("the --check-cost recordings hold no step with work")
    x, y = design(checked)
    return dataclasses.replace(fit, other=_errors(x @ np.asarray(fit.coefficients), y))


def report(
    recordings: Sequence[RecordingSteps],
    fit: CostFit,
    others: Sequence[RecordingSteps] = (),
    interval: bool = False,
) -> str:
    lines = []
    for r, only in [*((r, "") for r in recordings), *((r, "; checked only") for r in others)]:
        limits, skipped = r.header.limits, r.skipped
        lines.append(
            f"{r.path}: {len(r.shapes)} steps (left out: {skipped.empty} empty, "
            f"{skipped.failed} failed or untimed, {skipped.unknown_context} of unknown context"
            f"{f', {skipped.no_interval} {_untimed(skipped)}' if skipped.no_interval else ''}); "
            f"worker {limits.worker_id}, device {limits.device}, dtype {limits.dtype}, "
            f"model {limits.model_fingerprint[:12]}{only}"
        )
    held = f"every {HOLDOUT_EVERY}th step"
    timed = "forwards"
    if interval:
        spans = sum(r.skipped.by_span for r in recordings)
        timed = (
            "intervals (forward and the wait for the next plan)"
            if not spans
            else (
                "spans on the control plane's clock (result to result, or plan to result after an idle wait)"
            )
        )
    lines.append(f"fitted on {fit.train.steps} steps' {timed}, error on {fit.test.steps} held out ({held})")
    for term, value in zip(TERMS, fit.coefficients, strict=True):
        pinned = "  (pinned at 0: no weight in the data)" if term in fit.pinned else ""
        lines.append(f"  per {term:<14} {value * 1e6:12.4f} µs{pinned}")
    shown = [("held out", fit.test), ("fitted", fit.train)]
    if fit.other is not None:
        shown.insert(0, ("other run", fit.other))
    for name, errors in shown:
        lines.append(
            f"{name:>9}: R² {errors.r2:.4f}, mean |error| {errors.mean_abs_s * 1e3:.4f} ms, "
            f"relative error mean {errors.mean_rel:.1%}, p90 {errors.p90_rel:.1%}, "
            f"total {_signed(errors.total_rel)}"
        )
    client = client_terms(recordings)
    if any(r.stamps.stamped for r in recordings):
        arrivals = sum(len(r.stamps.arrivals) for r in recordings)
        publishes = sum(len(r.stamps.publishes) for r in recordings)
        lines.append(
            f"client path: arrive {client.arrive_s * 1e3:.4f} ms (median of {arrivals} arrivals at an idle "
            f"scheduler), publish {client.publish_s * 1e3:.4f} ms (median of {publishes} finishes); "
            "with --json, --cost FILE applies them"
        )
        hand_offs = [h for r in recordings for h in r.stamps.hand_offs]
        if hand_offs:
            lines.append(
                f"hand-off: {statistics.median(hand_offs) * 1e3:.4f} ms a busy step's span beyond its "
                f"forward and wait (median of {len(hand_offs)}; in the spans, no term of its own)"
            )
    else:
        lines.append("client path: not stamped (a recording made before the stamps): no terms")
    lines.append(f"--cost {fit.model.spec()}")
    return "\n".join(lines)


def _untimed(skipped: Skipped) -> str:
    return "without a span" if skipped.by_span else "before an idle wait or none"


def _signed(fraction: float) -> str:
    """+1.2% or -1.2%; a rounding error's -0.0 prints as +0.0."""
    return f"{round(fraction, 4) + 0.0:+.1%}"


def as_json(recordings: Sequence[RecordingSteps], fit: CostFit) -> dict[str, object]:
    """The model (keys a, b, c, d: what --cost FILE reads) with its fit and error."""
    model, client = fit.model, client_terms(recordings)
    return {
        "residual_quantiles_s": list(fit.residual_quantiles),
        "arrive_s": client.arrive_s,
        "publish_s": client.publish_s,
        "a": model.a,
        "b": model.b,
        "c": model.c,
        "d": model.d,
        "cost": model.spec(),
        "per_term_s": dict(zip(TERMS, fit.coefficients, strict=True)),
        "pinned": list(fit.pinned),
        "held_out": _errors_json(fit.test),
        "fitted": _errors_json(fit.train),
        "other_runs": None if fit.other is None else _errors_json(fit.other),
        "recordings": [
            {"path": str(r.path), "steps": len(r.shapes), "device": r.header.limits.device}
            for r in recordings
        ],
    }


def _errors_json(errors: Errors) -> dict[str, float | int]:
    return {
        "steps": errors.steps,
        "r2": errors.r2,
        "mean_abs_s": errors.mean_abs_s,
        "mean_rel": errors.mean_rel,
        "p90_rel": errors.p90_rel,
        "total_rel": errors.total_rel,
    }


FIT_FLAGS = Flags(
    None,
    (
        Flag(
            "--fit-cost",
            Path,
            nargs="+",
            metavar="RECORDING",
            help="fit a step cost model to recorded steps (stepwise up --record), print it and its error on "
            "held-out steps, and exit (no trace); with --json, a JSON object --cost FILE reads",
        ),
        Flag(
            "--fit-interval",
            SWITCH,
            help="with --fit-cost: fit each step's interval (a stamped recording's: its span on the control "
            "plane's clock, result to result; an older one's: its forward plus the worker's wait for "
            "the next plan, the control plane's turn between steps) instead of its forward alone",
        ),
        Flag(
            "--check-cost",
            Path,
            nargs="+",
            metavar="RECORDING",
            help="with --fit-cost: also measure the fitted model on every step of these (other runs)",
        ),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`stepwise simulate`'s flags of the fit."""
    FIT_FLAGS.add_to(parser)


def run_from_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int | None:
    """`simulate --fit-cost`'s exit status, or None when simulate runs a trace; a usage error
    (exit 2) for a trace beside --fit-cost, --check-cost alone, or neither a trace nor a fit."""
    if ns.fit_cost is not None:
        if ns.trace is not None:
            parser.error(f"--fit-cost fits recordings and runs no trace: drop {ns.trace}")
        return main(_paths(ns.fit_cost), _paths(ns.check_cost), ns.json, ns.fit_interval)
    if ns.check_cost is not None:
        parser.error("--check-cost measures a fit: give --fit-cost RECORDING too")
    if ns.fit_interval:
        parser.error("--fit-interval says what --fit-cost fits: give --fit-cost RECORDING too")
    if ns.trace is None:
        parser.error("the following arguments are required: trace")
    return None


def _paths(value: list[Path] | Path | None) -> list[Path]:
    """A list flag's paths (its STEPWISE_* variable gives one path, not a list)."""
    return [] if value is None else value if isinstance(value, list) else [value]


def main(paths: Sequence[Path], others: Sequence[Path], as_json_output: bool, interval: bool = False) -> int:
    """Print the fit of the recordings at `paths` (and its error on `others`), by forward or by
    `interval`: 0, or one line on stderr and 2."""
    try:
        recordings = [read_steps(path, interval) for path in paths]
        checked = [read_steps(path, interval) for path in others]
        fit = fit_steps(recordings, checked)
    except (OSError, RecordingError, CostFitError) as exc:
        print(f"stepwise simulate: --fit-cost: {exc}", file=sys.stderr)
        return 2
    if as_json_output:
        timed = (
            "span" if any(r.skipped.by_span for r in recordings) else "interval" if interval else "forward"
        )
        print(json.dumps({**as_json(recordings, fit), "fitted_to": timed}))
    else:
        print(report(recordings, fit, checked, interval))
    return 0
