"""Whether the control plane takes a caller's key, asked before the gateway reads the caller's body.

The gateway holds no keys: the control plane decides who may generate. It is asked with a
GetServerInfo call carrying the key, which a frontend answers UNAUTHENTICATED before it reads
anything else; a key it took is remembered for KEY_TTL_S, so a known caller costs one such call a
minute. A refused key is not remembered (the set of wrong keys has no bound): each refusal costs
the control plane one small call, never the parse of the caller's body. A stranger's body was
parsed whole before this (16 bodies of 8 MiB kept the gateway at 1.6 GiB).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import grpc

from gateway.errors import GatewayError, from_grpc

# How long a key the control plane took is taken without asking again.
KEY_TTL_S = 60.0
# Keys remembered at once (the control plane's own keys bound how many can be right).
MAX_KEYS = 1024
# How long the question may take; past it, the request goes on and the control plane decides on it.
ASK_TIMEOUT_S = 5.0

Ask = Callable[[str | None, float], Awaitable[object]]


class KeyCheck:
    """Asks the control plane about each caller's key, remembering the keys it took."""

    def __init__(self, ask: Ask, clock: Callable[[], float] = time.monotonic) -> None:
        """`ask(key, timeout)`: a call the control plane refuses with UNAUTHENTICATED for a key
        it does not take."""
        self._ask = ask
        self._clock = clock
        self._taken: OrderedDict[bytes, float] = OrderedDict()
        self._asking: dict[bytes, asyncio.Future[GatewayError | None]] = {}

    async def check(self, key: str | None) -> GatewayError | None:
        """None when the caller may go on; else the 401 to answer. A question that fails for any
        other reason (the control plane away) lets the request go on: its call will say why."""
        digest = hashlib.sha256((key or "").encode()).digest()
        expires = self._taken.get(digest)
        if expires is not None and expires > self._clock():
            return None
        asking = self._asking.get(digest)
        if asking is None:
            asking = asyncio.ensure_future(self._question(key, digest))
            self._asking[digest] = asking
            asking.add_done_callback(lambda _: self._asking.pop(digest, None))
        return await asyncio.shield(asking)

    async def _question(self, key: str | None, digest: bytes) -> GatewayError | None:
        try:
            await self._ask(key, ASK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return from_grpc(exc)
            return None
        self._taken[digest] = self._clock() + KEY_TTL_S
        self._taken.move_to_end(digest)
        while len(self._taken) > MAX_KEYS:
            self._taken.popitem(last=False)
        return None
