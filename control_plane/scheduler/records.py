"""What the scheduler reports across its boundary: streamed tokens and finishes (StepUpdates), the
figures of a step (StepStats), and intake's refusals."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from control_plane.request import FinishReason
from protos.worker import StepKind, TokenLogprobs

MAX_INT = 2**63 - 1


class QueueFull(Exception):
    """The waiting queue is at --max-queued-requests and the newcomer may not displace anyone."""


class RequestRejected(Exception):
    """Refused at intake (e.g. a priority while priority scheduling is off)."""


def _no_uids() -> np.ndarray:
    return np.zeros(0, dtype=np.uint64)


def _no_tokens() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Streamed tokens, one entry each, in the order they were produced (a uid appears once per
    result that gave its request a token). A matched EOS / stop token is not streamed."""

    uids: np.ndarray = field(default_factory=_no_uids)  # uint64: the request's `uid`
    token_ids: np.ndarray = field(default_factory=_no_tokens)  # int32
    # (index into the tokens, logprobs) of tokens whose requests asked for log probabilities.
    scores: tuple[tuple[int, TokenLogprobs], ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """A request ended (its last visible token, if any, is in the same or an earlier TokenBatch)."""

    rid: str
    uid: int
    reason: FinishReason
    # Prompt tokens that were served from the prefix cache.
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """A request's prompt log probabilities: rows[j] scores position start + 1 + j (the prompt token
    there, given every one before it); position `start` has none (docs/protocols.md#log-probabilities)."""

    uid: int
    start: int
    prompt: list[int]
    rows: tuple[TokenLogprobs, ...]


@dataclass(frozen=True, slots=True)
class StepUpdates:
    """What to publish since the last `take_updates`: consume `prompt_scores` first, then `tokens`,
    then `finished` (a request's prompt scores precede its tokens, every token its finish)."""

    tokens: TokenBatch = field(default_factory=TokenBatch)
    finished: tuple[RequestFinished, ...] = ()
    prompt_scores: tuple[PromptScoring, ...] = ()

    @property
    def empty(self) -> bool:
        return not len(self.tokens) and not self.finished and not self.prompt_scores


@dataclass(slots=True)
class StepStats:
    """Per-step figures for the log lines (docs/scheduler.md#logs-and-metrics) and the recorder."""

    step_id: int
    kind: StepKind
    new_seqs: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0
    running_at_admission: int = 0
    decode_bs: int = 0
    queued: int = 0
    pending_tokens: int = 0
    new_token_ratio: float = 0.0
    rem_total_tokens: float | None = None
    rem_input_tokens: int | None = None
    rem_chunk_tokens: int | None = None
    retracted: list[str] = field(default_factory=list)
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    retract_tokens_gained: int = 0
    ratio_before_retract: float = 0.0
    # Whether the retraction was forced by a full pool (else by the TEST_RETRACT switch).
    kv_full: bool = False
    # Prefill cache-hit rate without re-processed retracted work (docs/scheduler.md#logs-and-metrics); 0 for a
    # decode step.
    cache_hit_rate: float = 0.0
    # Requests aborted because even alone they did not fit (docs/scheduler.md#retraction's OOM abort of the
    # last request).
    oom_aborted: list[str] = field(default_factory=list)
    # Running requests first predicted in this step to miss their TPOT objective
    # (docs/scheduler.md#slo-admission).
    tpot_at_risk: int = 0
