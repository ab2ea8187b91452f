"""The share of each event-loop turn a frontend gives to streaming.

Everything of a frontend runs on one loop: new calls (accepting, validating, tokenizing, sending the
arrival), the link to the core (verdicts, replies to GetServerInfo and Abort), health, and the
streams' messages. gRPC's work for a message (its write, and the completion that follows) runs as
callbacks on the same loop, and each turn runs every callback that is ready, first in first out. A
frontend with thousands of streams due would spend each turn on all of them, and whatever else
arrived would wait out the whole turn at every step it takes: a new caller's first token takes
several. So a stream's next message waits for a slot: at most `per_turn` messages are cut per turn,
in the order the streams asked, and the rest wait for the next turn while their ids pile up (they
leave together, the pressure valve). A call's first message never waits (the handler does not ask).
"""

from __future__ import annotations

import asyncio
from collections import deque

# Messages cut per loop turn. A new call takes several turns to reach its handler (grpc.aio accepts
# one call per trip through its polling thread and the loop), so the turn's length is what admission
# waits on: 8 gave new callers 3.7x the accepts a second of 32 and half the first-token time, at the
# same tokens a second (docs/performance.md#the-pacers-share-of-a-turn).
MESSAGES_PER_TURN = 8


class Pacer:
    """Grants at most `per_turn` slots per event-loop turn, first come first served."""

    def __init__(self, per_turn: int = MESSAGES_PER_TURN) -> None:
        self.per_turn = per_turn
        self._used = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._reset_scheduled = False

    async def slot(self) -> None:
        """Return at once while this turn has slots left and nobody waits; else in a later turn."""
        self._schedule_reset()
        if self._used < self.per_turn and not self._waiting:
            self._used += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        await waiter  # a cancelled caller leaves a cancelled future, skipped when its turn comes

    def _schedule_reset(self) -> None:
        if not self._reset_scheduled:
            self._reset_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """A new turn: its slots go to the longest waiting first."""
        self._reset_scheduled = False
        self._used = 0
        while self._waiting and self._used < self.per_turn:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._used += 1
        if self._waiting:
            self._schedule_reset()
