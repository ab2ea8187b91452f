"""Worker-to-worker KV transfer: what any transport does, and where received transfers wait.

A transfer moves the K and V of some of a worker's slots ([num_layers, n_tokens, num_kv_heads,
head_dim] each) to another worker, under an id the control plane chose. The receiver keeps it in
host memory, in its `TransferStore`, until a later step writes it into slots it names, or until
nobody can name it any more: its session with the control plane ended, or its hold deadline passed.

`KvTransport` is the interface: data_plane/kv_transfer_grpc.py implements it over gRPC; an RDMA
(NIXL) transport would implement the same four methods and check the same `TransferHeader`.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import structlog
import torch

from data_plane.kv_pool import HostCopy
from protos.worker import TransferOutcome

# Ids a receive told the store to forget before they arrived, remembered at most this many.
MAX_DISCARDED = 4096
# A received copy no step claimed within this many seconds of landing is released. A step claims
# one within a step or two of the word that it landed; steps are bounded by the control plane's
# --worker-step-timeout (60 s, plus 2 ms a planned token), so this leaves room for the longest.
DEFAULT_HOLD_S = 300.0
# A send's deadline (TransferDeadline): this floor, for the round trips and a busy receiver (a peer
# that stopped answering is found sooner, by keepalive: data_plane/kv_transfer_grpc.py). 5 s failed
# a 100 KB copy between two model workers on a 2-core machine at a load average of 9.
DEFAULT_DEADLINE_FLOOR_S = 15.0
# ... plus its bytes, and those the sender has in flight with it, at this rate: a third of what 64
# concurrent pre-copies (196 MB) moved between sim workers on a loaded 2-core machine, far below
# any network a GPU worker sits on.
DEFAULT_DEADLINE_BYTES_PER_S = 50_000_000

# The dtypes a worker runs in (--dtype) and so the ones its K and V travel in.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_TRANSFER_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")

log = structlog.get_logger("data_plane.kv_transfer")


class BadTransfer(ValueError):
    """The transfer is malformed: its header, its byte count, or an id the receiver already holds."""


class TransferRefused(Exception):
    """The receiver will not take the transfer (its buffer cannot hold it)."""


class TransferFailed(Exception):
    """A send did not complete; `code` is the receiver's (or the transport's) status name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True, slots=True)
class TransferHeader:
    """What precedes a transfer's bytes: its id, and the dtype and shape of K and of V."""

    transfer_id: str
    dtype: str
    shape: tuple[int, ...]
    total_bytes: int

    @staticmethod
    def of(transfer_id: str, k: torch.Tensor, v: torch.Tensor) -> TransferHeader:
        """The header for sending `k` and `v`; BadTransfer when they cannot go together."""
        if k.shape != v.shape or k.dtype != v.dtype:
            raise BadTransfer(f"k and v differ: {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
        dtype = str(k.dtype).removeprefix("torch.")
        header = TransferHeader(transfer_id, dtype, tuple(k.shape), 2 * k.numel() * k.element_size())
        header.check()
        return header

    def check(self) -> torch.dtype:
        """The torch dtype; BadTransfer naming the field that is wrong."""
        if _TRANSFER_ID.fullmatch(self.transfer_id) is None:
            raise BadTransfer(f"transfer_id {self.transfer_id[:40]!r}: must be 1-128 of [A-Za-z0-9._:@/-]")
        dtype = DTYPES.get(self.dtype)
        if dtype is None:
            raise BadTransfer(f"dtype {self.dtype[:40]!r}: must be one of {', '.join(DTYPES)}")
        if len(self.shape) != 4 or min(self.shape) < 1:
            raise BadTransfer(
                f"shape {list(self.shape)[:8]}: must be 4 positive sizes "
                "[num_layers, n_tokens, num_kv_heads, head_dim]"
            )
        expected = 2 * math.prod(self.shape) * dtype.itemsize
        if self.total_bytes != expected:
            raise BadTransfer(
                f"total_bytes {self.total_bytes}: K and V of shape {list(self.shape)} in {self.dtype} "
                f"are {expected} bytes"
            )
        return dtype


@dataclass(frozen=True, slots=True)
class TransferDeadline:
    """How long a send may take before it fails (docs/migration.md#deadlines-and-hung-peers).

    The bytes counted are all the sender has in flight when the send starts, its own included:
    concurrent sends share the sender's link, so 64 pre-copies of a drain each get the time the
    whole batch needs at `bytes_per_s`, not the time their own bytes alone would take."""

    floor_s: float = DEFAULT_DEADLINE_FLOOR_S
    bytes_per_s: float = DEFAULT_DEADLINE_BYTES_PER_S

    def seconds(self, bytes_in_flight: int) -> float:
        return self.floor_s + bytes_in_flight / self.bytes_per_s


class TransferStore:
    """Received transfers by id, in host memory, at most `capacity_bytes` of them (counting those
    still arriving). Listeners (`listening`) hear of each one as soon as it is complete.

    A copy is held until a step takes or discards it, and no longer than nobody can: a new session
    (`new_session`) releases those of the sessions before, whose control plane forgot them with the
    session, and a copy held `hold_s` seconds after it landed is released unclaimed (`expire`: when
    a header needs room, and whenever the transport calls it; the gRPC one does when each deadline
    passes). A copy still arriving is held no longer than its sender's deadline: the transport ends
    the call then and releases it.

    Steps take and discard from their own thread while the transport's event loop reserves,
    completes and expires: each release pops the held copy first, so of two that race for one copy
    exactly one gets it."""

    def __init__(
        self, capacity_bytes: int, hold_s: float = DEFAULT_HOLD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.hold_s = hold_s
        self._clock = clock
        self._listeners: list[Callable[[str, int], None]] = []
        self._reserved: dict[str, int] = {}
        self._held: dict[str, HostCopy] = {}
        # When each held copy is released unclaimed, in the order they landed (so, of deadlines).
        self._due: dict[str, float] = {}
        # Forgotten before they arrived: dropped on arrival (oldest first past MAX_DISCARDED).
        self._discarded: deque[str] = deque(maxlen=MAX_DISCARDED)

    @property
    def used_bytes(self) -> int:
        return sum(self._reserved.values())

    def reserve(self, header: TransferHeader) -> None:
        """Room for `header`'s bytes; BadTransfer for an id already held or arriving,
        TransferRefused when the buffer cannot hold it."""
        if header.transfer_id in self._reserved:
            raise BadTransfer(f"transfer_id {header.transfer_id!r}: already received or arriving")
        self.expire()
        free = self.capacity_bytes - self.used_bytes
        if header.total_bytes > free:
            raise TransferRefused(
                f"transfer {header.transfer_id!r} needs {header.total_bytes} bytes; the buffer has "
                f"{free} of {self.capacity_bytes} free (--transfer-buffer-bytes)"
            )
        self._reserved[header.transfer_id] = header.total_bytes

    def release(self, transfer_id: str) -> None:
        """Give back a reservation whose transfer did not complete."""
        if transfer_id not in self._held:
            self._reserved.pop(transfer_id, None)

    @contextlib.contextmanager
    def listening(self, listener: Callable[[str, int], None]) -> Iterator[None]:
        """While the block runs, `listener(transfer_id, nbytes)` is called for each transfer the
        store completes, on the thread that completes it (a transport's: its event loop's)."""
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)

    def complete(self, transfer_id: str, copy: HostCopy) -> None:
        """Hold a reserved transfer's K and V until its deadline, and tell the listeners; one
        discarded meanwhile is dropped."""
        if transfer_id in self._discarded:
            self._discarded.remove(transfer_id)
            self._reserved.pop(transfer_id, None)
            return
        self._due[transfer_id] = self._clock() + self.hold_s
        self._held[transfer_id] = copy
        nbytes = self._reserved[transfer_id]
        for listener in tuple(self._listeners):
            listener(transfer_id, nbytes)

    def take(self, transfer_id: str) -> HostCopy:
        """A completed transfer, which the store then forgets; KeyError naming it when none."""
        try:
            copy = self._held.pop(transfer_id)
        except KeyError:
            raise KeyError(f"no received transfer {transfer_id!r}") from None
        del self._reserved[transfer_id]
        self._due.pop(transfer_id, None)
        return copy

    def discard(self, transfer_id: str) -> None:
        """Forget a transfer unwritten: now if it is held, or as soon as it arrives."""
        if not self._drop_held(transfer_id):
            self._discarded.append(transfer_id)

    def new_session(self) -> None:
        """A session with a control plane begins: forget the transfers of those before, held ones
        now and arriving ones when they land. No step will claim them: the control plane that
        would have forgot them when their session ended."""
        held = list(self._held)
        released = sum(self._drop_held(transfer_id) for transfer_id in held)
        arriving = [transfer_id for transfer_id in list(self._reserved) if transfer_id not in self._held]
        self._discarded.extend(arriving)
        if held or arriving:
            log.info(
                "transfers_released",
                reason="session ended",
                held=len(held),
                bytes=released,
                arriving=len(arriving),
            )

    def expire(self) -> None:
        """Release every copy held past its deadline."""
        now = self._clock()
        due = [transfer_id for transfer_id, at in list(self._due.items()) if at <= now]
        released = sum(self._drop_held(transfer_id) for transfer_id in due)
        if due:
            log.warning(
                "transfers_released",
                reason="unclaimed past the hold deadline",
                held=len(due),
                bytes=released,
                hold_s=self.hold_s,
            )

    def _drop_held(self, transfer_id: str) -> int:
        """Forget a held copy; the bytes it held (0: none was held)."""
        if self._held.pop(transfer_id, None) is None:
            return 0
        self._due.pop(transfer_id, None)
        return self._reserved.pop(transfer_id, 0)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._held


class KvTransport(abc.ABC):
    """Sends K/V to other workers' transports and receives theirs into `received`."""

    received: TransferStore

    @abc.abstractmethod
    async def start(self) -> str:
        """Start receiving; the address other workers send to (HOST:PORT)."""

    @abc.abstractmethod
    async def send(self, dest_address: str, transfer_id: str, k: torch.Tensor, v: torch.Tensor) -> int:
        """Send `k` and `v` to the transport at `dest_address`; the bytes it received once it holds
        them. BadTransfer for tensors that cannot go; TransferFailed when the receiver refuses or
        the link breaks."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop receiving and close links to other workers."""


class TransferAgent:
    """A worker's sends, started from whichever thread runs a step and carried out on the event loop
    its transport serves on; each one's outcome waits here for the next step's result."""

    def __init__(self, transport: KvTransport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._ended: deque[TransferOutcome] = deque()

    @property
    def received(self) -> TransferStore:
        return self.transport.received

    def send(self, address: str, transfer_id: str, copy: HostCopy) -> None:
        """Start sending `copy` (the worker's own snapshot: nothing else writes it)."""
        coro = self.transport.send(address, transfer_id, copy.k, copy.v)
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        future.add_done_callback(partial(self._ended_one, transfer_id))

    def _ended_one(self, transfer_id: str, future: concurrent.futures.Future[int]) -> None:
        if future.cancelled():
            self._ended.append(TransferOutcome(transfer_id, "CANCELLED: the worker is stopping"))
            return
        exc = future.exception()
        if exc is None:
            self._ended.append(TransferOutcome(transfer_id, "", future.result()))
        elif isinstance(exc, TransferFailed | BadTransfer):
            self._ended.append(TransferOutcome(transfer_id, str(exc)))
        else:
            self._ended.append(TransferOutcome(transfer_id, f"{type(exc).__name__}: {exc}"))

    def take_outcomes(self) -> tuple[TransferOutcome, ...]:
        """The outcomes since the last call, in the order the sends ended (more may end meanwhile:
        they wait for the next call)."""
        return tuple(self._ended.popleft() for _ in range(len(self._ended)))


class Transfers(Protocol):
    """What an executor moves KV with: TransferAgent over a transport, or LoopbackTransfers."""

    @property
    def received(self) -> TransferStore: ...

    def send(self, address: str, transfer_id: str, copy: HostCopy) -> None: ...

    def take_outcomes(self) -> tuple[TransferOutcome, ...]: ...


class LoopbackTransfers:
    """Transfers among executors in one process (`stepwise replay worker` of recordings made
    together): a send lands in the store they share at once, and succeeds; the address is not
    used, transfer ids being unique."""

    def __init__(self, store: TransferStore) -> None:
        self.received = store
        self._ended: deque[TransferOutcome] = deque()

    def send(self, address: str, transfer_id: str, copy: HostCopy) -> None:
        header = TransferHeader.of(transfer_id, copy.k, copy.v)
        self.received.reserve(header)
        self.received.complete(transfer_id, copy)
        self._ended.append(TransferOutcome(transfer_id, "", header.total_bytes))

    def take_outcomes(self) -> tuple[TransferOutcome, ...]:
        return tuple(self._ended.popleft() for _ in range(len(self._ended)))


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor` in host memory, contiguous: a view of it on CPU (a copy only when it is
    not contiguous); a CUDA tensor is staged through pinned host memory."""
    if tensor.is_cuda:
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staged.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        tensor = staged
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def tensors_from(buffer: bytearray, header: TransferHeader) -> HostCopy:
    """K and V as views of `buffer` (K's bytes, then V's), without a copy."""
    dtype = header.check()
    half = header.total_bytes // 2
    k = torch.frombuffer(buffer, dtype=dtype, count=half // dtype.itemsize).view(header.shape)
    v = torch.frombuffer(buffer, dtype=dtype, offset=half, count=half // dtype.itemsize).view(header.shape)
    return HostCopy(k=k, v=v)
