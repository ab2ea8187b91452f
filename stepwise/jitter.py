"""`--cost-jitter`'s draws for one simulated worker (docs/debugging.md#jitter).

Each step adds one inverse-CDF draw from a fit's residual quantiles (evenly spaced levels 0..1),
its seconds kept >= 0. Each worker has its own generator, a function of the seed and the worker's
index only: worker 0's is the seed's own (numpy's `default_rng(seed)`, the single-worker
simulator's), worker i's the seed's i-th spawned child (`SeedSequence(seed, spawn_key=(i,))`,
numpy's independent streams). So a worker's n-th step draws the same whatever the other workers
do, and a fleet of one draws what `simulate` draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Jitter:
    def __init__(self, quantiles: Sequence[float], seed: int, worker: int = 0) -> None:
        self.quantiles = tuple(quantiles)
        self.levels = np.linspace(0.0, 1.0, len(self.quantiles))
        spawn_key = (worker,) if worker else ()
        self.rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=spawn_key))

    def __call__(self, seconds: float) -> float:
        """The step's seconds plus one draw, at least 0 (without quantiles: the seconds as they are)."""
        if not self.quantiles:
            return seconds
        draw = float(np.interp(self.rng.random(), self.levels, self.quantiles))
        return max(0.0, seconds + draw)
