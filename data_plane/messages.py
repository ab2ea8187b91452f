"""Typed values for everything that crosses the worker link (see protos/stepwise/v1/worker.proto).

Only data_plane/codec.py converts between these and protobuf. Per-request columns are numpy
arrays: handles uint64, token ids / starts / lens / slots int64, sample flags bool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PROTOCOL_VERSION = 2


def _empty(dtype: type) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass(frozen=True, slots=True)
class SamplerParams:
    """How one sequence is sampled, normalised so that every default means "off"."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    # 0: none; n: the sampled token's logprob plus n - 1 top alternatives.
    logprobs: int = 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass(frozen=True, slots=True)
class NewSequence:
    handle: int
    sampler: SamplerParams
    # KV slots of the cached prefix, positions 0..len-1.
    prefix_slots: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    # Tokens preceding the first extend, used only by penalties.
    history_ids: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    # The client's request id (stable across a retraction's new handle) and the sim backend's hint.
    request_id: str = ""
    sim_output_len: int = 0
    prompt_len: int = 0


@dataclass(frozen=True, slots=True)
class ExtendBatch:
    """Entry i owns lens[i] consecutive tokens and slots of the concatenated arrays."""

    handles: np.ndarray = field(default_factory=lambda: _empty(np.uint64))
    starts: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    lens: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    sample: np.ndarray = field(default_factory=lambda: _empty(np.bool_))
    token_ids: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    slots: np.ndarray = field(default_factory=lambda: _empty(np.int64))


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    handles: np.ndarray = field(default_factory=lambda: _empty(np.uint64))
    slots: np.ndarray = field(default_factory=lambda: _empty(np.int64))


@dataclass(frozen=True, slots=True)
class KvTransfer:
    handle: int
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class SlotRemap:
    """Positions [start, start + len(slots)) of `handle` now read their KV from `slots`."""

    handle: int
    start: int
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    release_handles: np.ndarray = field(default_factory=lambda: _empty(np.uint64))
    offloads: tuple[KvTransfer, ...] = ()
    restores: tuple[KvTransfer, ...] = ()
    new_seqs: tuple[NewSequence, ...] = ()
    extends: ExtendBatch = field(default_factory=ExtendBatch)
    decodes: DecodeBatch = field(default_factory=DecodeBatch)
    # Applied right after releases.
    remaps: tuple[SlotRemap, ...] = ()
    # Applied before everything: forget every sequence and host copy (the control plane starts over).
    reset: bool = False


@dataclass(frozen=True, slots=True)
class KvReport:
    """What the worker holds after a step, for the control plane to check against its books."""

    # Sequences with a device-resident slot table (offloaded ones are counted in host_seqs instead).
    live_seqs: int
    # Sum of slot-table lengths over live_seqs (shared prefix slots count once per sequence).
    seq_slots: int
    capacity_tokens: int
    device_mem_used_bytes: int
    # Sequences whose KV currently sits in the host pool.
    host_seqs: int


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    # One per sampling entry, in plan order: the extends with `sample` set, then every decode (the
    # plan names the sequences; see sampled_handles).
    token_ids: np.ndarray
    kv: KvReport
    forward_s: float = 0.0
    # Empty, or one per sampled token when any sequence of the step asked for logprobs.
    logprobs: tuple[TokenLogprobs, ...] = ()
    error: str = ""
    # Set by the worker loop: seconds it waited for this plan after finishing the previous step.
    wait_s: float = 0.0


def sampled_handles(plan: StepPlan) -> np.ndarray:
    """The sequences a plan's result tokens belong to, in result order (uint64)."""
    ext = plan.extends
    return np.concatenate((ext.handles[ext.sample.astype(bool)], plan.decodes.handles)).astype(np.uint64)


@dataclass(frozen=True, slots=True)
class Hello:
    worker_id: str
    model_fingerprint: str
    kv_capacity_tokens: int
    page_size: int
    max_context: int
    vocab_size: int
    dtype: str
    device: str
    eos_token_ids: tuple[int, ...]
    host_pool_capacity_tokens: int = 0
    protocol_version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Welcome:
    accepted: bool
    reason: str = ""
    # A refusal that may pass later, here or at another control plane (it drains, or still holds
    # a session under this worker id); other refusals are final.
    retryable: bool = False


@dataclass(frozen=True, slots=True)
class Shutdown:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Move:
    """Detach and attach to another control plane (this one has more than its share, or drains)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Drain:
    """Worker -> control plane: the worker is stopping; it runs plans until a Shutdown comes."""

    reason: str = ""


ControlEvent = Welcome | StepPlan | Shutdown | Move


@dataclass(frozen=True, slots=True)
class Census:
    """A control plane's answer to "how many workers do you hold, and how busy are they?"."""

    # Random per control-plane process.
    control_plane_id: str = ""
    # Workers attached and not draining or moving away.
    workers: int = 0
    queued: int = 0
    running: int = 0
    # False while the control plane drains: no worker should attach to it.
    accepting: bool = True
    # The attached workers' model fingerprint; empty when none is attached.
    model_fingerprint: str = ""
