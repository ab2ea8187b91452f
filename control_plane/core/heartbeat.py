"""Whether a frontend still answers: the core's reading of one frontend's heartbeat.

A frontend that is stopped (SIGSTOP), wedged or starved closes no socket, so its link never reports
EOF; its clients' streams freeze and new connections the kernel hands it time out. The core pings
every frontend once per `--frontend-heartbeat-interval` on a connection of its own, and a thread of
the frontend answers at once (control_plane/frontend/heartbeat.py), with how long ago its event
loop last ran. A frontend is stalled when it has not answered for `--frontend-heartbeat-timeout`,
or when its event loop has not run for that long though the process answers.

Silence is counted in the core's own time, tick by tick: a tick adds the time since the previous one
but at most two intervals. A core that stalls itself (a long GC pause, a burst of work on its loop)
has not read the answers waiting on the socket, and must not blame its frontends for that.
The figures and why: docs/protocols.md#the-frontend-heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Silence:
    """One frontend's heartbeat: pings sent, the latest answer, and how long it has been silent."""

    interval_s: float
    timeout_s: float
    # The last ping's sequence number (pings are counted from the link's start, sent or not: a
    # frontend that never opens its heartbeat connection is silent from the start).
    seq: int = 0
    answered: int = 0
    silent_s: float = 0.0
    loop_silent_s: float = 0.0
    _last_tick: float | None = None

    def tick(self, now: float) -> int:
        """A heartbeat interval passed: count the silence since the last tick; the next ping's seq."""
        if self._last_tick is not None and self.answered < self.seq:
            self.silent_s += min(now - self._last_tick, 2 * self.interval_s)
        self._last_tick = now
        self.seq += 1
        return self.seq

    def pong(self, seq: int, loop_silent_s: float) -> None:
        """An answer arrived: the process runs (a late answer counts too: it is slow, not stopped)."""
        if not 0 < seq <= self.seq or seq <= self.answered:
            return  # not an answer to a ping of ours, or older than one already answered
        self.answered = seq
        self.silent_s = 0.0
        self.loop_silent_s = loop_silent_s

    def stalled(self) -> str:
        """Why the frontend counts as stalled, or "" while it does not."""
        if self.silent_s > self.timeout_s:
            return f"it has not answered a heartbeat for {self.silent_s:.1f} s"
        if self.loop_silent_s > self.timeout_s:
            return f"its event loop has not run for {self.loop_silent_s:.1f} s"
        return ""
