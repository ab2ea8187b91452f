"""Typed values for every message of the worker link (protos/stepwise/v1/worker.proto), shared by
both planes: the scheduler builds step plans and reads step results with them, a worker executes the
plans and answers with the results. Only protos/worker_codec.py converts them to and from protobuf.

A plan is a delta against the worker's per-sequence state (docs/protocols.md#the-worker-protocol):
sequences are introduced once, extended, decoded one token at a time, and released.

Per-entry columns are numpy arrays, with the dtypes the scheduler builds and the codec decodes:
handles and slots int64, token ids, starts and lens int32, sample flags bool. Handles are uint64 on
the wire but int64 here: the control plane hands them out from a counter that never nears 2^63, the
scheduler's columns are int64, and mixing uint64 with int64 in numpy silently makes float64. A
producer may hand in any integer arrays whose values fit; the codec packs them to the wire's widths.
Every default means "off".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

PROTOCOL_VERSION = 2


def _i64(values: object = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _i32(values: object = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


# --- sampling ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Grammar:
    """A constraint the control plane compiled (worker.proto: Grammar): the backend that compiled
    it, and its kind and text (grammars/spec.py)."""

    backend: str
    kind: str
    spec: str


@dataclass(frozen=True, slots=True)
class SamplerParams:
    """How the worker samples for one sequence (fixed for its life); every default means "off".

    A client that sends no temperature still samples at 1.0: that default is the client protocol's,
    applied where client input is read (control_plane/frontend/client_codec.py), not here."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # uint64 on the wire.
    seed: int | None = None
    # 0: none; n: the sampled token's logprob plus n - 1 top alternatives.
    logprobs: int = 0
    # (token id, bias) pairs, ids ascending: added to the logits before sampling.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # With logprobs > 0: the logprobs of these ids too, at every scored position, in this order.
    token_ids_logprob: tuple[int, ...] = ()
    # False: logprobs of the model's logits (raw); True: of what sampling draws from (processed).
    processed_logprobs: bool = False
    # The grammar the output is held to; None: unconstrained.
    grammar: Grammar | None = None

    @property
    def needs_history(self) -> bool:
        """Whether the worker needs the tokens before the first extend: penalties count them, and a
        grammar's matcher accepts the output tokens among them again (a retracted or handed-over
        sequence rebuilds its matcher that way)."""
        return self.uses_penalties or self.grammar is not None

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the sequence's token history (repetition/frequency/presence)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


# --- control plane -> worker: step plans -----------------------------------------------------------


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"

    @staticmethod
    def of(extends: int, decodes: int) -> StepKind:
        """The kind of a plan with this many extend and decode entries (the wire does not carry it:
        a decoded plan's kind is derived; one with neither is a decode step, as the scheduler's
        idle plans are)."""
        if extends and decodes:
            return StepKind.MIXED
        return StepKind.PREFILL if extends else StepKind.DECODE


@dataclass(frozen=True, slots=True)
class NewSeq:
    """A sequence the worker starts holding state for (worker.proto: NewSequence)."""

    handle: int
    sampler: SamplerParams
    # Slots already holding the KV of positions [0, len(prefix_slots)) (a cached prefix).
    prefix_slots: np.ndarray = field(default_factory=_i64)
    # Tokens preceding the first extend, sent only when the sampler applies penalties.
    history_ids: np.ndarray = field(default_factory=_i32)
    # The client's request id (stable across a retraction's new handle); logs and the sim backend.
    request_id: str = ""
    # Length of the client's original prompt: positions from here on are output tokens, on every
    # worker the request runs on (after a retraction, and after a hand-over).
    prompt_len: int = 0
    # Sim backend only: output tokens before EOS (0: the backend's seeded rule).
    sim_output_len: int = 0


@dataclass(frozen=True, slots=True)
class ExtendWork:
    """Columnar extends (worker.proto: ExtendBatch): entry i owns lens[i] consecutive values of
    token_ids and slots."""

    handles: np.ndarray = field(default_factory=_i64)
    # Position of each entry's first new token (tokens already in that sequence's KV).
    starts: np.ndarray = field(default_factory=_i32)
    lens: np.ndarray = field(default_factory=_i32)
    # False for a non-final chunk: nothing is sampled after it.
    sample: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    token_ids: np.ndarray = field(default_factory=_i32)
    slots: np.ndarray = field(default_factory=_i64)
    # Prompt scoring: empty when no entry scores, else one value per entry. Entry i scores the rows
    # at positions score_starts[i] .. score_starts[i] + score_lens[i] - 1 (inside its extend) against
    # the token after each; the one after its last position is next_ids[i] (-1: none known).
    score_starts: np.ndarray = field(default_factory=_i32)
    score_lens: np.ndarray = field(default_factory=_i32)
    next_ids: np.ndarray = field(default_factory=_i32)

    def __len__(self) -> int:
        return len(self.handles)


@dataclass(frozen=True, slots=True)
class DecodeWork:
    """Columnar decodes, whole (the wire's DecodeBatch is a delta against the previous decode plan:
    protos/decode_set.py). The input token is the one the worker sampled last for the sequence."""

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
class KvSend:
    """Send the KV of `slots` to the transfer service at `address` under `transfer_id` (snapshot
    first in the plan; the bytes go in the background)."""

    transfer_id: str
    address: str
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class KvReceive:
    """Write the received transfer `transfer_id` into `slots`, its tokens from `skip` on (the first
    `skip` are cached here already); empty slots: forget it unwritten."""

    transfer_id: str
    slots: np.ndarray
    skip: int = 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    # Not on the wire: the scheduler's, and derived when a plan is decoded (StepKind.of).
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
    # Worker-to-worker KV moves: sends are snapshot before anything else, receives written after
    # restores (worker.proto: KvSend, KvReceive).
    sends: tuple[KvSend, ...] = ()
    receives: tuple[KvReceive, ...] = ()


def sampled_count(plan: StepPlan) -> int:
    """Tokens the plan's result must carry: one per extend with `sample` set, one per decode."""
    return int(np.count_nonzero(plan.extends.sample)) + len(plan.decodes)


def sampled_handles(plan: StepPlan) -> np.ndarray:
    """The sequences a plan's result tokens belong to, in result order (int64)."""
    ext = plan.extends
    return np.concatenate((ext.handles[ext.sample.astype(bool)], plan.decodes.handles)).astype(np.int64)


# --- worker -> control plane: step results ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvReport:
    """What the worker holds after a step (checked against the control plane's books)."""

    # Sequences with a device-resident slot table (offloaded ones count in host_seqs instead).
    live_seqs: int = 0
    # Sum over live sequences of the slots in their slot tables (a shared prefix counts once per
    # sequence).
    seq_slots: int = 0
    capacity_tokens: int = 0
    device_mem_used_bytes: int = 0
    # Sequences whose KV sits in the host pool.
    host_seqs: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position's scores: the chosen (or next prompt) token's logprob, the top alternatives
    (most likely first) and the logprobs of the sequence's token_ids_logprob, in its order."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    ids_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptScores:
    """The scored rows of extend entry `entry`: rows[j] scores position score_starts[entry] + j."""

    entry: int
    rows: tuple[TokenLogprobs, ...]


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """How a KvSend ended: delivered (`error` empty; the destination received `bytes`) or not."""

    transfer_id: str
    error: str = ""
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    # One sampled token per sampling entry, in plan order: the extends with `sample` set, then every
    # decode. The plan names the sequences (sampled_handles); the result carries only their tokens.
    token_ids: np.ndarray = field(default_factory=_i32)
    # Empty, or one per sampled token when any sequence of the step asked for logprobs.
    logprobs: tuple[TokenLogprobs, ...] = ()
    # One per extend entry that scores prompt rows, in entry order.
    prompt_scores: tuple[PromptScores, ...] = ()
    kv: KvReport = KvReport()
    forward_s: float = 0.0
    # Seconds the worker waited for this plan after it had finished the previous step (its idle gap);
    # set by the worker's session loop.
    wait_s: float = 0.0
    # Non-empty when the worker could not execute the plan.
    error: str = ""
    # Sends that ended since the previous result, in the order they ended.
    transfers: tuple[TransferOutcome, ...] = ()
    # Indices into token_ids (ascending) of samples whose grammar could not be satisfied: the
    # worker sampled EOS for them, and they end with finish reason grammar_unsatisfiable.
    grammar_failed: np.ndarray = field(default_factory=_i32)


# --- the session: hello, welcome, and how it ends ----------------------------------------------------


ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """What a worker says in its hello (worker.proto: Hello); the scheduler's T, page size and
    context come from here."""

    worker_id: str
    kv_capacity_tokens: int
    page_size: int
    max_context: int
    vocab_size: int
    # Token ids that end generation for this model (from its configs).
    eos_token_ids: frozenset[int] = frozenset()
    # Identifies the weights: hash of config plus weight file names and sizes.
    model_fingerprint: str = ""
    dtype: str = ""
    device: str = ""
    # 0: the worker cannot back sequences up to host memory.
    host_pool_capacity_tokens: int = 0
    protocol_version: int = PROTOCOL_VERSION
    # The grammar backends the worker can run (constrained decoding).
    grammar_backends: tuple[str, ...] = ()
    # HOST:PORT of the worker's KV transfer service (data_plane/kv_transfer.py); "": none.
    transfer_address: str = ""
    # ROLES: mixed (prefill and decode), prefill (new requests, handed to a decode worker after
    # their first token), decode (requests handed over by prefill workers).
    role: str = "mixed"
    # The worker compiles a grammar off its step when asked (a Prepare) and says when it is ready.
    prepares_grammars: bool = False


@dataclass(frozen=True, slots=True)
class Prepare:
    """Control plane -> worker: compile `grammar` and build its first matcher off the step."""

    grammar: Grammar


@dataclass(frozen=True, slots=True)
class GrammarReady:
    """Worker -> control plane: a Prepare's grammar is compiled (`error` empty), or why it is not."""

    grammar: Grammar
    error: str = ""


@dataclass(frozen=True, slots=True)
class Welcome:
    accepted: bool
    reason: str = ""
    # A refusal that may pass later, here or at another control plane (it drains, or still holds
    # a session under this worker id); other refusals are final.
    retryable: bool = False
    # The control plane reads the worker's own reports of transfers it received (`received`
    # WorkerMessages); without it the worker sends none.
    transfer_reports: bool = False


@dataclass(frozen=True, slots=True)
class Shutdown:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Move:
    """Detach and attach to another control plane (this one has more than its share, or drains)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Dropped:
    """The control plane dropped the worker (a broken protocol, a missed step deadline, its own
    step loop failing on it): the worker logs why and searches again, never stops for it."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Drain:
    """Worker -> control plane: the worker is stopping; it runs plans until a Shutdown comes."""

    reason: str = ""


# What a worker reads off its Connect stream (ControlMessage's oneof).
ControlEvent = Welcome | StepPlan | Shutdown | Move | Dropped | Prepare


# --- the census ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Census:
    """A control plane's answer to "how many workers do you hold, and how busy are they?"
    (worker.proto: CensusReply)."""

    # Random per control-plane process: a control plane recognises itself among its peers by it.
    control_plane_id: str = ""
    # Workers attached and not draining or moving away.
    workers: int = 0
    # Requests waiting and running over those workers.
    queued: int = 0
    running: int = 0
    # False while the control plane drains: no worker should attach to it. True by default: a
    # control plane too old to answer Census is taken to accept workers.
    accepting: bool = True
    # The attached workers' model fingerprint; empty when none is attached.
    model_fingerprint: str = ""
    # Whether the census judged the hello it was asked about (False: none was asked about, or the
    # control plane predates the question), and why it would refuse that worker for good ("": it
    # would take it).
    hello_judged: bool = False
    refusal: str = ""

    def refuses(self) -> bool:
        """Whether this control plane said it would refuse the worker asked about for good."""
        return self.hello_judged and bool(self.refusal)
