"""Waiting for a condition in a test: poll it until it holds or a deadline passes.

One helper for every test that waits on something it cannot await directly (a stream's tokens, a
worker's health, a log line): the deadline is always explicit, the failure says what was awaited and
for how long, and the poll interval is the caller's (in-process engines are polled every millisecond,
real processes every few tens of milliseconds).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

Condition = Callable[[], object] | Callable[[], Awaitable[object]]


class WaitTimedOut(AssertionError):
    """The condition still did not hold at the deadline (an AssertionError: a test failure, not an error)."""


def _timed_out(timeout_s: float, what: str) -> WaitTimedOut:
    return WaitTimedOut(f"timed out after {timeout_s:g} s waiting for: {what}")


async def until(
    condition: Condition, timeout_s: float, what: str = "the condition", *, every_s: float = 0.01
) -> None:
    """Return once `condition()` is truthy (awaited when it returns an awaitable); fail after `timeout_s`.

    The condition is checked once more after the deadline's last sleep, so a condition that holds
    at the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what)
        await asyncio.sleep(every_s)


def until_sync(
    condition: Callable[[], object], timeout_s: float, what: str, *, every_s: float = 0.05
) -> None:
    """`until` for a test with no event loop: sleeps the thread between checks."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what)
        time.sleep(every_s)
