"""`simulate --tenants FILE`: a minimal reader of a tenant table in TOML, for the simulator only
(docs/scheduler.md#simulating-tenants). The control plane's own table (issue 42 item 1) replaces it;
this one reads what fairness and SLO admission need:

    [[tenant]]
    name = "batch"
    weight = 1          # share of tokens, > 0 (default 1)
    ttft_slo_ms = 2000  # defaults for requests that name none (0: none)
    tpot_slo_ms = 100
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("name", "weight", "ttft_slo_ms", "tpot_slo_ms")


@dataclass(frozen=True, slots=True)
class Tenants:
    weights: dict[str, float]
    slos: dict[str, tuple[float, float]]


def read_tenants(path: Path) -> Tenants:
    """The table; ValueError naming the file, the entry and the field when it is not one."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--tenants {path}: {exc}") from None
    extra = sorted(set(data) - {"tenant"})
    if extra:
        raise ValueError(f"--tenants {path}: unknown table {extra[0]!r} (want [[tenant]] entries)")
    weights: dict[str, float] = {}
    slos: dict[str, tuple[float, float]] = {}
    for i, entry in enumerate(data.get("tenant", [])):
        where = f"--tenants {path}: tenant #{i + 1}"
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ValueError(f"{where}: name: want a string")
        if name in weights:
            raise ValueError(f"{where}: name: {name!r} appears twice")
        weights[name] = _number(entry, "weight", 1.0, where, positive=True)
        ttft = _number(entry, "ttft_slo_ms", 0.0, where)
        tpot = _number(entry, "tpot_slo_ms", 0.0, where)
        if ttft or tpot:
            slos[name] = (ttft, tpot)
    return Tenants(weights, slos)


def _number(
    entry: dict[str, object], field: str, default: float, where: str, positive: bool = False
) -> float:
    value = entry.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: {field}: want a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{where}: {field}: want a number {'>' if positive else '>='} 0, got {value!r}")
    return float(value)
