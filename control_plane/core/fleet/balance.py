"""Balancing one control plane's workers for KV room by live migration (docs/migration.md#balancing).

After each of its steps, a worker's engine asks whether one of its running calls should move to
another of this control plane's workers, for one of two reasons:

- "kv": its running requests will not fit in its KV within `steps` more decodes (the scheduler's
  `decode_headroom` is negative), so a retraction is coming that would throw their KV away and
  prefill them again later; another worker has room for a request and its growth.
- "balance": its latest plan left requests queued, the other's left none, and its free share of KV
  trails the other's by more than `threshold` (sticky routing keys or cache hits piled work on it).

The calls that move are taken in the scheduler's retraction order (what a retraction would have
released first), those that fit: for "kv" as many as cover the shortfall, for "balance" one. Only a
call whose samples each made a token here moves, so a request never bounces between workers without
making progress, and none that ends within the look-ahead anyway. The worker with the largest free
share receives them. A worker decides again once its moves have had their outcome (the headroom it
reads then includes them).

While a worker is short, its scheduler is also told to send the victims of a retraction to that
worker instead (`Scheduler.spill_to`): pre-copies take a few steps, and the shortfall may come
first.

The rules are pure functions of `Room`s (tested directly); placement.py applies them to a worker's
running calls (`balance`), and the engine starts the moves it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

KV = "kv"
BALANCE = "balance"
REASONS = (KV, BALANCE)


@dataclass(frozen=True, slots=True)
class Room:
    """A worker's KV as the balancer sees it: slots free or evictable once its running requests
    have grown by the look-ahead (negative: missing), of `capacity`, and its queued requests."""

    headroom: int
    capacity: int
    queued: int

    @property
    def share(self) -> float:
        """The free share of the worker's KV after the look-ahead (negative when short)."""
        return self.headroom / self.capacity if self.capacity else 0.0


def why_move(here: Room, there: Room, threshold: float) -> str | None:
    """Why a worker with `here` should move a running call to one with `there` (KV or BALANCE),
    or None."""
    if there.headroom <= 0:
        return None
    if here.headroom < 0:
        return KV
    if here.queued and not there.queued and there.share - here.share > threshold:
        return BALANCE
    return None


def fits(why: str, here: Room, there: Room, tokens: int, growth: int) -> bool:
    """Whether a call holding `tokens` slots that grows by `growth` more in the look-ahead may go
    from `here` to `there`: there must be room for both, and a BALANCE move must not leave `there`
    with the smaller free share (else the next step would move one back)."""
    after = there.headroom - tokens - growth
    if after < 0:
        return False
    if why == KV:
        return True
    return after / there.capacity >= (here.headroom + tokens + growth) / here.capacity


def roomiest(rooms: dict[str, Room]) -> str | None:
    """The worker with the largest free share (ties: the smallest id)."""
    return min(rooms, key=lambda w: (-rooms[w].share, w), default=None)
