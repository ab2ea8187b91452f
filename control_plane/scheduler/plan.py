"""The typed boundary between the scheduler and a worker: step plans down, step results up.

A plan is a delta against the worker's per-sequence state (docs/protocols.md#the-worker-protocol):
sequences are introduced once, extended, decoded one token at a time, and released. Per-request
columns are numpy arrays; only control_plane/worker_codec.py turns them into protobuf messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from control_plane.request import SamplerSpec


def _i64(values: object = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _i32(values: object = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass(frozen=True, slots=True)
class NewSeq:
    handle: int
    sampler: SamplerSpec
    # Slots already holding the KV of positions [0, len(prefix_slots)) (a cached prefix).
    prefix_slots: np.ndarray = field(default_factory=_i64)
    # Tokens preceding the first extend, sent only when the sampler applies penalties.
    history_ids: np.ndarray = field(default_factory=_i32)
    request_id: str = ""
    prompt_len: int = 0
    # Sim backend only: output tokens before EOS (0: the backend's seeded rule).
    sim_output_len: int = 0


@dataclass(frozen=True, slots=True)
class ExtendWork:
    """Columnar extends: entry i owns lens[i] consecutive values of token_ids and slots."""

    handles: np.ndarray = field(default_factory=_i64)
    # Position of each entry's first new token (tokens already in that sequence's KV).
    starts: np.ndarray = field(default_factory=_i32)
    lens: np.ndarray = field(default_factory=_i32)
    # False for a non-final chunk: nothing is sampled after it.
    sample: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    token_ids: np.ndarray = field(default_factory=_i32)
    slots: np.ndarray = field(default_factory=_i64)

    def __len__(self) -> int:
        return len(self.handles)


@dataclass(frozen=True, slots=True)
class DecodeWork:
    """Columnar decodes: the input token is the one the worker sampled last for the sequence."""

    handles: np.ndarray = field(default_factory=_i64)
    slots: np.ndarray = field(default_factory=_i64)

    def __len__(self) -> int:
        return len(self.handles)


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """Copy one sequence's KV between the device pool and the worker's host pool."""

    handle: int
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class SlotRemap:
    """Positions [start, start + len(slots)) of `handle` now live in `slots` (the tree's copy)."""

    handle: int
    start: int
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    kind: StepKind
    # Applied first; their slots may be reused by this very plan.
    releases: np.ndarray = field(default_factory=_i64)
    offloads: tuple[KvTransfer, ...] = ()
    restores: tuple[KvTransfer, ...] = ()
    new_seqs: tuple[NewSeq, ...] = ()
    extends: ExtendWork = field(default_factory=ExtendWork)
    decodes: DecodeWork = field(default_factory=DecodeWork)
    # Applied after releases, before any other work.
    remaps: tuple[SlotRemap, ...] = ()
    # Set by the engine, never by the scheduler: the worker forgets everything before this plan (the
    # first plan of a fresh scheduler after a fault on the control plane's side).
    reset: bool = False


@dataclass(frozen=True, slots=True)
class KvReport:
    """What the worker holds after a step (checked against the control plane's books)."""

    live_seqs: int = 0
    # Sum over live sequences of the slots in their slot tables.
    seq_slots: int = 0
    capacity_tokens: int = 0
    device_mem_used_bytes: int = 0
    host_seqs: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    # One sampled token per sampling entry, in plan order: the extends with `sample` set, then every
    # decode. The plan names the sequences; the result carries only their tokens.
    token_ids: np.ndarray = field(default_factory=_i32)
    logprobs: tuple[TokenLogprobs, ...] = ()
    kv: KvReport = KvReport()
    forward_s: float = 0.0
    # Seconds the worker waited for this plan after it had finished the previous step (its idle gap).
    wait_s: float = 0.0
    error: str = ""


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """What a worker said in its hello; the scheduler's T, page size and context come from here."""

    worker_id: str
    kv_capacity_tokens: int
    page_size: int
    max_context: int
    vocab_size: int
    eos_token_ids: frozenset[int] = frozenset()
    model_fingerprint: str = ""
    dtype: str = ""
    device: str = ""
    host_pool_capacity_tokens: int = 0
