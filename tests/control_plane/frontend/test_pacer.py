"""The frontend's pacer: at most `per_turn` streaming messages per event-loop turn, in order."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.frontend.pacer import Pacer

pytestmark = pytest.mark.timeout(30)


async def _turns_of(pacer: Pacer, streams: int) -> dict[int, int]:
    """Which loop turn (counted by a ticker that yields once a turn) each stream got its slot in."""
    turn = 0
    granted: dict[int, int] = {}

    async def ticker() -> None:
        nonlocal turn
        while len(granted) < streams:
            await asyncio.sleep(0)
            turn += 1

    async def stream(k: int) -> None:
        await pacer.slot()
        granted[k] = turn

    await asyncio.gather(ticker(), *(stream(k) for k in range(streams)))
    return granted


async def test_no_turn_grants_more_than_its_share_and_the_first_to_ask_go_first() -> None:
    pacer = Pacer(per_turn=4)
    granted = await _turns_of(pacer, 20)
    per_turn: dict[int, int] = {}
    for turn in granted.values():
        per_turn[turn] = per_turn.get(turn, 0) + 1
    assert max(per_turn.values()) <= 4
    assert len(per_turn) >= 5  # 20 streams need at least 5 turns
    # First come, first served: a stream that asked later never got an earlier turn.
    assert all(granted[k] <= granted[k + 1] for k in range(19))


def test_a_stream_alone_never_waits() -> None:
    """One stream asking once a turn gets its slot without suspending: a frontend that keeps up
    sends as it did without a pacer."""

    async def main() -> None:
        pacer = Pacer(per_turn=4)
        for _ in range(50):
            ask = pacer.slot()
            with pytest.raises(StopIteration):
                ask.send(None)  # done on its first step: it never waited
            await asyncio.sleep(0)  # the next turn (a gRPC write takes at least one)

    asyncio.run(main())


async def test_a_cancelled_waiter_gives_its_slot_to_the_next() -> None:
    pacer = Pacer(per_turn=1)
    first, second, third = (asyncio.ensure_future(pacer.slot()) for _ in range(3))
    await asyncio.sleep(0)  # the first takes the turn's slot; the other two wait
    assert first.done() and not second.done() and not third.done()
    second.cancel()
    await asyncio.sleep(0)  # the next turn: its slot skips the cancelled one
    await asyncio.sleep(0)
    assert second.cancelled() and third.done()
