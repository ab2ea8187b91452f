"""The only time the scheduler knows (docs/scheduler.md#queue-clock): it has no wall clock, so waits
are measured on what results bring. `busy_s` sums the `forward_s` of every applied result (the
worker's time on the steps; in `stepwise simulate` the simulated clock less its idle gaps), and
`prefill_tokens` counts the prompt tokens computed by the prefill steps planned so far (SGLang's
processed-tokens counter for HRRN). Both replay exactly: results are recorded with their forward_s."""

from __future__ import annotations


class QueueClock:
    __slots__ = ("busy_s", "last_s", "prefill_tokens")

    def __init__(self) -> None:
        self.busy_s = 0.0
        # The seconds of the step whose result was applied last.
        self.last_s = 0.0
        self.prefill_tokens = 0

    def worked(self, seconds: float) -> None:
        """A result was applied: the worker spent `seconds` on its step."""
        self.busy_s += seconds
        self.last_s = seconds

    def prefilled(self, tokens: int) -> None:
        """A planned prefill step computes `tokens` prompt tokens."""
        self.prefill_tokens += tokens
