"""A step cost model's coefficients, 'a,b,c[,d]' in seconds: the one parser of every cost flag.

A worker's step takes a + b·new tokens + c·context tokens + d·decode rows seconds (data_plane/sim.py's
CostModel). The worker's `--sim-cost`, the simulator's `--cost` and the control plane's `--slo-cost`
all read that text, so they accept and refuse the same values in the same words.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Collection


def linear_cost(text: str, terms: Collection[int] = (3, 4)) -> tuple[float, ...]:
    """The coefficients `text` gives, `terms` of them (d is 0 where three are allowed and given).

    a, b and c are finite and >= 0; d is what a decode row costs beyond a prefill token, so it may be
    negative down to -b (a row never costs less than nothing). ArgumentTypeError, one line in
    flagtypes' words (`expected ..., got '...'`), for anything else; argparse names the flag.
    """
    wanted = " or ".join(("'a,b,c'", "'a,b,c,d'")[n - 3] for n in sorted(terms))
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in terms:
        raise argparse.ArgumentTypeError(f"expected {wanted} in seconds, got {text!r}")
    a, b, c, d = (*values, 0.0)[:4]
    if not all(0 <= x < math.inf for x in (a, b, c)):  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a, b, c finite and >= 0, got {text!r}")
    if not -b <= d < math.inf:
        raise argparse.ArgumentTypeError(
            f"expected d finite and >= -b (a decode row costs >= 0), got {text!r}"
        )
    return values
