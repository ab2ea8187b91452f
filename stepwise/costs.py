"""Step cost models by name: `--cost` takes numbers, a named model, or a JSON file.

A model prices one step of one kind of worker (a model on a device):
`a + b·new tokens + c·context tokens + d·decode rows` seconds (data_plane.sim.CostModel). The same
spec names a model wherever a worker kind needs one, so a fleet's kinds can each name theirs.

- `a,b,c` or `a,b,c,d`: the coefficients, in seconds;
- a name from NAMED (`stepwise simulate --help` lists them; docs/performance.md says where each
  comes from);
- a path to a JSON object with keys `a`, `b`, `c` and optionally `d` (what `stepwise simulate
  --fit-cost ... --json` prints; other keys are ignored by the step model); its optional keys
  `arrive_s` and `publish_s` are the client path's terms (ClientPath), which a fit of a stamped
  recording gives;
- `recorded:DIR` (`stepwise simulate` only): no model, each step's seconds as a live recording
  measured them (its results' forward_s, by step), for a simulation of that very run
  (docs/debugging.md#twin).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from control_plane.record.entries import ApplyResult, NextPlan
from control_plane.record.files import RecordingError, read_entries
from data_plane.sim import CostModel

RECORDED = "recorded:"


@dataclass(frozen=True, slots=True)
class NamedCost:
    model: CostModel
    # Where the figures come from: a fit (its command and error) or published figures.
    source: str


# docs/performance.md#step-cost-models gives each one's command, data and error.
NAMED: dict[str, NamedCost] = {
    "default": NamedCost(CostModel(0.005, 5e-5, 5e-7), "made up: 5 ms a step, no model behind it"),
    "h100-llama3-8b": NamedCost(
        CostModel(0.006, 3.25e-5, 4.9e-8),
        "published specs, not measured: H100 SXM (989 TFLOPS bf16 dense, 3.35 TB/s) and Llama 3 8B in "
        "bf16 (16.06 GB of weights, 128 KiB of K/V a token) at 50% of peak FLOPs and 80% of peak bandwidth",
    ),
    "h200-llama3-8b": NamedCost(
        CostModel(0.0042, 3.25e-5, 3.4e-8),
        "published specs, not measured: as h100-llama3-8b with the H200's 4.8 TB/s",
    ),
}


def parse_cost(text: str, flag: str = "--cost") -> CostModel:
    """The model `text` names; ValueError naming `flag` when it names none."""
    if text in NAMED:
        return NAMED[text].model
    if "," in text:
        return CostModel.parse(text, flag)
    path = Path(text)
    if not path.is_file():
        names = ", ".join(NAMED)
        raise ValueError(f"{flag} wants 'a,b,c[,d]', a named model ({names}) or a JSON file, got {text!r}")
    return _from_file(path, flag)


def _from_file(path: Path, flag: str) -> CostModel:
    try:
        obj = json.loads(path.read_text())
        values = [obj[k] for k in ("a", "b", "c")] + ([obj["d"]] if "d" in obj else [])
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise TypeError("a, b, c, d must be numbers")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{flag} {path}: not a cost model (a JSON object with a, b, c[, d]): {exc!s}"
        ) from None
    return CostModel.parse(",".join(repr(float(v)) for v in values), f"{flag} {path}")


@dataclass(frozen=True, slots=True)
class ClientPath:
    """What a request spends outside the worker's steps, on the simulated clock
    (docs/debugging.md#step-cost-models): `arrive_s` from its call reaching the control plane to the
    scheduler taking it, `publish_s` from the step that made a token or finish being applied to its
    publication. Zero for every model but a fitted file that gives them."""

    arrive_s: float = 0.0
    publish_s: float = 0.0

    def reaches(self, arrival: float) -> float:
        """When a request that arrived at `arrival` reaches the scheduler (and the fleet's router)."""
        return arrival + self.arrive_s

    def published(self, applied: float) -> float:
        """When the tokens and finishes of a result applied at `applied` are published."""
        return applied + self.publish_s


def client_path(text: str, flag: str = "--cost") -> ClientPath:
    """The client path's terms of the cost spec `text`: a JSON file's `arrive_s` and `publish_s`
    (each 0 when absent); zeros for every other spec. ValueError naming `flag` for a term that is
    not a finite number >= 0."""
    obj = _cost_file(text)
    if obj is None:
        return ClientPath()  # not a file, or parse_cost says what is wrong with it
    terms = {}
    for key in ("arrive_s", "publish_s"):
        value = obj.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise ValueError(f"{flag} {text}: {key} must be a finite number of seconds >= 0, got {value!r}")
        terms[key] = float(value)
    return ClientPath(**terms)


def _cost_file(text: str) -> dict[str, object] | None:
    """The JSON object of the cost spec `text` when it names a readable JSON file holding one (a
    fit's output); None for every other spec and for a file that is not one."""
    path = Path(text)
    if text in NAMED or "," in text or text.startswith(RECORDED) or not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def residual_quantiles(text: str, flag: str = "--cost") -> tuple[float, ...]:
    """A fitted JSON file's `residual_quantiles_s` (stepwise simulate --fit-cost --json), for
    `--cost-jitter`; ValueError naming `flag` when `text` names no such file or the list is not
    finite non-decreasing numbers."""
    obj = _cost_file(text)
    values = obj.get("residual_quantiles_s") if obj is not None else None
    if not isinstance(values, list) or len(values) < 2:
        raise ValueError(
            f"--cost-jitter wants {flag} FILE from `stepwise simulate --fit-cost ... --json` "
            f"(its residual_quantiles_s), got {text!r}"
        )
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ValueError(f"{flag} {text}: residual_quantiles_s must be finite numbers")
    if any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"{flag} {text}: residual_quantiles_s must not decrease")
    return tuple(float(v) for v in values)


@dataclass(frozen=True, slots=True)
class RecordedSteps:
    """What `recorded:DIR` times a simulation with."""

    # step id -> the worker's measured forward_s.
    seconds: dict[int, float]
    # The planned steps after the last measured one: those a stop cut off while they ran (under
    # overlap, `up` stopped as soon as the client had its last finish, see `unmeasured`).
    cut_off: frozenset[int] = frozenset()


def recorded_steps(text: str, flag: str = "--cost") -> RecordedSteps | None:
    """`recorded:DIR`'s measured steps; None for any other spec; ValueError naming `flag` when the
    recording cannot be read."""
    if not text.startswith(RECORDED):
        return None
    path = Path(text.removeprefix(RECORDED))
    seconds: dict[int, float] = {}
    last_planned: int | None = None
    try:
        for entry in read_entries(path):
            if isinstance(entry, ApplyResult):
                seconds[entry.result.step_id] = entry.result.forward_s
            elif isinstance(entry, NextPlan) and entry.plan is not None:
                last_planned = entry.plan.step_id
    except (OSError, RecordingError) as exc:
        raise ValueError(f"{flag} {text}: cannot read the recording: {exc}") from None
    if not seconds:
        raise ValueError(f"{flag} {text}: the recording measured no step")
    return RecordedSteps(seconds, unmeasured(last_planned, seconds))


def unmeasured(last_planned: int | None, seconds: Mapping[int, float]) -> frozenset[int]:
    """A recording's planned steps after its last measured one (RecordedSteps.cut_off). Under overlap
    the engine publishes a finish after it has sent the next plan, so when the client has its last
    finish two steps can still be running: the one planned before that finish was applied and the
    one just sent (each decodes rows already finished, or none); a stop then leaves both unmeasured."""
    if last_planned is None:
        return frozenset()
    return frozenset(range(max(seconds, default=0) + 1, last_planned + 1))


def describe_named() -> str:
    """The names, for --help."""
    return ", ".join(NAMED)
