"""Children of `stepwise up` die with it, whatever kills it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

# A child started by `up` asks the kernel to SIGTERM it when this process dies (see die_with_parent).
PARENT_ENV = "STEPWISE_PARENT_PID"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child of `up`: die with the parent, even if it is SIGKILLed.

    Done in the child at start-up rather than in a preexec_fn: a preexec_fn forces fork() in a
    parent whose gRPC threads are running, and gRPC's fork handlers can abort the child.
    """
    parent = os.environ.get(PARENT_ENV)
    if parent:
        die_with_parent_pid(int(parent))


def die_with_parent_pid(parent: int) -> None:
    """SIGTERM this process when its parent (whose pid the caller read before) dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        sys.exit(1)
