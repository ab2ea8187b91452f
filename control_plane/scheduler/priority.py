"""One sign convention for priorities (docs/scheduler.md#ordering-policies, #priority-preemption,
#retraction).

By default a larger priority value is more important; with --schedule-low-priority-values-first a
smaller one is. `urgency` folds the value and the flag into one number where smaller is more
important, so every ordering in the scheduler (queue order, preemption victims, retraction order,
the queue cap's victim) sorts by it ascending.
"""

from __future__ import annotations

from control_plane.request import Request


def priority_sign(low_values_first: bool) -> int:
    """1 when smaller values are more important, -1 when larger ones are (the default)."""
    return 1 if low_values_first else -1


def priority_of(req: Request) -> int:
    """The request's priority value; a request without one counts as 0."""
    return req.priority if req.priority is not None else 0


def urgency(req: Request, sign: int) -> int:
    """Smaller is more important, whichever way the server reads priority values."""
    return sign * priority_of(req)
