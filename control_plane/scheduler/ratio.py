"""The new-token-ratio tracker (docs/scheduler.md#new-token-ratio).

The ratio is the fraction of each running request's remaining `max_new_tokens` that admission
reserves. It starts conservative, decays linearly toward a floor on every decode step that did not
retract, jumps to a fresh estimate after a retraction, and resets when the scheduler goes idle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from control_plane.config import SchedulerConfig
from control_plane.request import Request


@dataclass(slots=True)
class NewTokenRatioTracker:
    init: float
    min: float
    decay: float
    current: float

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> NewTokenRatioTracker:
        init = min(config.init_new_token_ratio * config.schedule_conservativeness, 1.0)
        floor = min(init * config.min_new_token_ratio_factor, 1.0)
        decay = (init - floor) / config.new_token_ratio_decay_steps
        return cls(init=init, min=floor, decay=decay, current=init)

    def decay_step(self) -> None:
        self.current = max(self.current - self.decay, self.min)

    def reset(self) -> None:
        self.current = self.init

    def after_retract(self, kept: Iterable[Request], retract_decode_steps: int) -> None:
        """A retraction replaces the ratio by a fresh estimate over the requests it kept."""
        self.current = self.estimate_after_retract(kept, retract_decode_steps)

    def estimate_after_retract(self, kept: Iterable[Request], retract_decode_steps: int) -> float:
        """(Σ generated + steps·n) / (Σ max_new_tokens + 1) over the kept requests, capped at 1."""
        generated = total = n = 0
        for req in kept:
            generated += req.num_outputs
            total += req.max_new_tokens
            n += 1
        return min(1.0, (generated + retract_decode_steps * n) / (total + 1))
