"""PrefillAdder: the budget arithmetic of one admission pass (docs/scheduler.md#prefill-adder-budgets).

A fresh adder is built for every prefill attempt. It answers each candidate with an AddReqResult:
CONTINUE (keep adding), NO_TOKEN (KV memory exhausted) or OTHER (any other reason to stop). Three
budgets are tracked: total tokens (room for prompts plus everyone's expected future decode), input
tokens (max_prefill_tokens per batch) and chunk tokens (chunked_prefill_size per batch).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from control_plane.request import Request
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.priority import priority_sign, urgency

IGNORE_EOS_RESERVE_TOKENS = 1

T = TypeVar("T")


class AddReqResult(enum.Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class AdderLimits:
    page_size: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None
    clip_max_new_tokens: int = 4096
    prefill_max_requests: int | None = None
    priority_threshold: int = 10
    low_priority_values_first: bool = False


def reserved_offset(remaining: np.ndarray, clip: int, new_token_ratio: float) -> float:
    """Σ min(remaining, clip) · ratio over the running requests (docs/scheduler.md#prefill-adder-budgets),
    summed left to right as a
    Python loop over them would (cumsum is sequential), so the budget is the same to the last bit."""
    if not len(remaining):
        return 0.0
    return float(np.cumsum(np.minimum(remaining, clip) * new_token_ratio)[-1])


class PrefillAdder:
    """Budgets for one pass. Reads the pool's free and evictable sizes live (they change as locks
    move), mutates only its own counters, `can_run_list` and the admitted requests' extend ranges
    and locks.

    `remaining` is max_new_tokens − generated per running request, in `running`'s order; the
    scheduler passes it from its columns (without a pass over the requests), tests may leave it to
    be computed from `running`."""

    def __init__(
        self,
        kv: KvManager,
        limits: AdderLimits,
        running: Sequence[Request],
        new_token_ratio: float,
        mixed_decode_tokens: int = 0,
        remaining: np.ndarray | None = None,
    ) -> None:
        self.kv = kv
        self.limits = limits
        self.page_size = limits.page_size
        self.running = running
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = limits.max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk_tokens = (
            None if limits.chunked_prefill_size is None else limits.chunked_prefill_size - mixed_decode_tokens
        )
        if remaining is None:
            remaining = np.array([self.remaining(r) for r in running], dtype=np.int64)
        reserved = reserved_offset(remaining, limits.clip_max_new_tokens, new_token_ratio)
        self.rem_total_token_offset = float(mixed_decode_tokens) + reserved
        self.cur_rem_token_offset = mixed_decode_tokens
        self.can_run_list: list[Request] = []
        self.new_chunked_req: Request | None = None
        self.preempt_list: list[Request] = []
        self.log_hit_tokens = 0
        self.log_input_tokens = 0
        # The part of the two above that re-does the work of retracted requests
        # (docs/scheduler.md#prefill-adder-budgets, #logs-and-metrics).
        self.reprocessed_hit_tokens = 0
        self.reprocessed_input_tokens = 0
        self.req_states: list[tuple[float, int]] | None = None

    # --- budgets -------------------------------------------------------------------------------

    @staticmethod
    def remaining(req: Request) -> int:
        return req.max_new_tokens - req.num_outputs

    def offset(self, req: Request) -> float:
        """Reserved future decode of a running request: min(remaining, clip) · ratio
        (docs/scheduler.md#prefill-adder-budgets)."""
        return min(self.remaining(req), self.limits.clip_max_new_tokens) * self.new_token_ratio

    @property
    def rem_total_tokens(self) -> float:
        return self.kv.available_size() + self.kv.evictable_size() - self.rem_total_token_offset

    @property
    def cur_rem_tokens(self) -> float:
        return self.kv.available_size() + self.kv.evictable_size() - self.cur_rem_token_offset

    def ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    @property
    def cache_hit_rate(self) -> float:
        """SGLang's prefill cache-hit rate: hit / (hit + input), leaving out re-processed retracted work."""
        hit = self.log_hit_tokens - self.reprocessed_hit_tokens
        seen = hit + self.log_input_tokens - self.reprocessed_input_tokens
        return hit / seen if seen > 0 else 0.0

    def _update_prefill_budget(
        self, req: Request, prefix_len: int, extend_len: int, max_new_tokens: int
    ) -> None:
        extend = self.ceil_page(extend_len)
        self.rem_total_token_offset += extend + max_new_tokens + self.page_size
        self.cur_rem_token_offset += extend + self.page_size
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend
        if req.retracted_stain:
            self.reprocessed_hit_tokens += prefix_len
            self.reprocessed_input_tokens += extend

    def _clip(self, max_new_tokens: int) -> int:
        return min(max_new_tokens, self.limits.clip_max_new_tokens)

    def within_chunk_budget(self, limit: int, add: Callable[[], T]) -> tuple[T, int]:
        """`add()` (an admission through this adder) with the chunk budget held to `limit` tokens
        (step isolation's budget for a heavy tenant, docs/scheduler.md#fairness-isolation); after
        it the budget is what it was less what was admitted. Returns add's verdict and the tokens
        admitted (pages)."""
        own = self.rem_chunk_tokens
        assert own is not None, "a held chunk budget needs chunked prefill"
        held = min(own, limit)
        self.rem_chunk_tokens = held
        try:
            verdict = add()
        finally:
            assert self.rem_chunk_tokens is not None
            used = held - self.rem_chunk_tokens
            self.rem_chunk_tokens = own - used
        return verdict, used

    def would_chunk(self, req: Request) -> bool:
        """Whether admitting `req` now (matched) would start a new chunk: its uncached prompt is
        over the chunk budget (a request restored from the host pool is never chunked)."""
        if self.rem_chunk_tokens is None or req.host_backup_len:
            return False
        return self.ceil_page(req.seqlen - len(req.prefix_indices)) > self.rem_chunk_tokens

    # --- the chunked request's continuation (docs/scheduler.md#chunked-prefill)
    # ------------------------------------------------

    def add_chunked_req(self, req: Request) -> Request | None:
        """Admit the next chunk first; returns req while it is still being chunked, else None."""
        assert self.rem_chunk_tokens is not None, "a chunked request exists only when chunking is on"
        rem = min(self.rem_chunk_tokens, int(self.rem_total_tokens))
        if rem <= 0:
            # SGLang forces progress with the whole chunk budget (the request holds KV and must not be
            # left out), but a forced chunk larger than the pool can supply would fail to allocate:
            # take what the pool really has, page-floored, and park the chunk when that is nothing.
            supply = self.kv.available_size() + self.kv.evictable_size()
            rem = min(self.rem_chunk_tokens, supply // self.page_size * self.page_size)
            if rem <= 0:
                return req
        prefix_len = len(req.prefix_indices)
        candidate = req.seqlen - prefix_len
        truncated = candidate > rem
        length = min(candidate, rem)
        req.extend_range = (prefix_len, prefix_len + length)
        self.can_run_list.append(req)
        self._update_prefill_budget(req, 0, length, 0 if truncated else self._clip(req.max_new_tokens))
        return req if truncated else None

    # --- a new request (docs/scheduler.md#add-one-req)
    # --------------------------------------------------------------------

    def add_one_req(self, req: Request, ignore_eos_path: bool) -> AddReqResult:
        limits = self.limits
        if self.new_chunked_req is not None:
            # A newly chunked request is the last one admitted (docs/scheduler.md#add-one-req): with a chunk
            # budget off the page grid (mixed chunk) the verdict after it can still be CONTINUE.
            return AddReqResult.OTHER
        if limits.prefill_max_requests is not None and len(self.can_run_list) >= limits.prefill_max_requests:
            return AddReqResult.OTHER
        if ignore_eos_path:
            return self.add_one_req_ignore_eos(req)
        total = self.token_total(req)
        real_input = self.ceil_page(req.seqlen - len(req.prefix_indices))
        if total >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if self.rem_chunk_tokens is None and self.can_run_list and real_input >= self.rem_input_tokens:
            return AddReqResult.OTHER
        return self._with_temporary_lock(req, lambda: self._admit(req, total))

    def _with_temporary_lock(self, req: Request, body: Callable[[], AddReqResult | None]) -> AddReqResult:
        # Locking moves the matched prefix from evictable to protected, so budgets can shrink.
        self.kv.inc_lock(req.last_node)
        try:
            verdict = body()
        finally:
            self.kv.dec_lock(req.last_node)
        return verdict if verdict is not None else self.budget_state()

    def _admit(self, req: Request, total: int) -> AddReqResult | None:
        if total >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        prefix_len = len(req.prefix_indices)
        input_tokens = self.ceil_page(req.seqlen - prefix_len)
        if self.rem_chunk_tokens is None and self.can_run_list and input_tokens >= self.rem_input_tokens:
            return AddReqResult.OTHER
        # A request restored from the host pool is not chunked: the restore covers all but its last token.
        if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens or req.host_backup_len:
            req.extend_range = (prefix_len, req.seqlen)
            self.can_run_list.append(req)
            self.kv.inc_lock(req.last_node)
            self._update_prefill_budget(req, prefix_len, input_tokens, self._clip(req.max_new_tokens))
            return None
        return self._admit_chunk(req, prefix_len)

    def _admit_chunk(self, req: Request, prefix_len: int) -> AddReqResult | None:
        assert self.rem_chunk_tokens is not None
        page = self.page_size
        trunc = self.rem_chunk_tokens // page * page
        if trunc <= 0:
            return AddReqResult.OTHER
        end = (prefix_len + trunc) // page * page
        trunc = end - prefix_len
        if trunc <= 0:
            return AddReqResult.OTHER
        req.extend_range = (prefix_len, end)
        self.can_run_list.append(req)
        self.new_chunked_req = req
        self.kv.inc_lock(req.last_node)
        self._update_prefill_budget(req, prefix_len, trunc, 0)
        return None

    # --- ignore_eos with the cache disabled (docs/scheduler.md#add-one-req-ignore-eos)
    # --------------------------------------------------

    def _tokens_left(self, req: Request) -> tuple[float, int]:
        ratio = 1.0 if req.params.ignore_eos else self.new_token_ratio
        return req.max_new_tokens * ratio - req.num_outputs, req.seqlen

    def _insert_req_state(self, state: tuple[float, int]) -> None:
        assert self.req_states is not None
        states = self.req_states
        for i, existing in enumerate(states):
            if state[0] <= existing[0]:
                states.insert(i, state)
                return
        # SGLang's quirk: with no larger entry it inserts before the last element.
        states.insert(max(len(states) - 1, 0), state)

    def add_one_req_ignore_eos(self, req: Request) -> AddReqResult:
        prefix_len = len(req.prefix_indices)
        candidate = req.seqlen - prefix_len
        if self.ceil_page(candidate) > min(self.cur_rem_tokens, self.rem_total_tokens):
            return AddReqResult.NO_TOKEN
        if self.req_states is None:
            states = [self._tokens_left(r) for r in (req, *self.running, *self.can_run_list)]
            self.req_states = sorted(s for s in states if s[0] > 0)
        else:
            state = self._tokens_left(req)
            if state[0] > 0:
                self._insert_req_state(state)
        if not self._simulated_finish_fits(candidate):
            return AddReqResult.NO_TOKEN
        if self.rem_chunk_tokens is None or candidate <= self.rem_chunk_tokens or req.host_backup_len:
            req.extend_range = (prefix_len, req.seqlen)
            self.can_run_list.append(req)
            self._update_prefill_budget(req, prefix_len, candidate, self._clip(req.max_new_tokens))
        else:
            if self.rem_chunk_tokens <= 0:
                return AddReqResult.OTHER
            req.extend_range = (0, self.rem_chunk_tokens)
            self.can_run_list.append(req)
            self.new_chunked_req = req
            self._update_prefill_budget(req, 0, self.rem_chunk_tokens, 0)
        return self.budget_state()

    def _simulated_finish_fits(self, candidate: int) -> bool:
        """Finish the tracked requests in order of tokens left; each must fit before it frees."""
        assert self.req_states is not None
        free = self.cur_rem_tokens - self.ceil_page(candidate)
        freed = 0
        n = len(self.req_states)
        for i, (left, occupied) in enumerate(self.req_states):
            bs = n - i
            if free + freed - left * bs <= IGNORE_EOS_RESERVE_TOKENS * bs:
                return False
            freed += occupied
        return True

    # --- priority preemption (docs/scheduler.md#priority-preemption)
    # ---------------------------------------------------------------

    def preempt_to_schedule(
        self, req: Request, candidates: Sequence[Request], gives_way: Callable[[Request], bool] | None = None
    ) -> list[Request] | None:
        """Pick running requests to give way to `req`; None when the preemption is not allowed.

        Candidates must already be ordered least important first; those chosen earlier in this pass
        are skipped (docs/scheduler.md#priority-preemption). `gives_way`: whether a candidate may give
        way (fairness preemption's rule); None: priority's threshold. Mutates the reserved budget and
        `preempt_list`.
        """
        sign = priority_sign(self.limits.low_priority_values_first)
        # SGLang's fill, not the request's current length: it is refreshed only by a match, which comes
        # after the preemption (docs/scheduler.md#priority-preemption).
        fill = req.matched_fill_len
        need = (fill - len(req.prefix_indices)) + self._clip(req.max_new_tokens) - self.rem_total_tokens
        chosen: list[Request] = []
        already = {id(r) for r in self.preempt_list}
        for cand in (c for c in candidates if id(c) not in already):
            if gives_way is not None:
                if not gives_way(cand):
                    break
            # Only a request more important by more than the threshold may preempt.
            elif urgency(cand, sign) - urgency(req, sign) <= self.limits.priority_threshold:
                break
            chosen.append(cand)
            need -= self.offset(cand)
            if need <= 0:
                break
        if not chosen or need > 0:
            return None
        self.give_way(chosen)
        return chosen

    def give_way(self, victims: Sequence[Request]) -> None:
        """Mutates: `victims`, chosen to be released, no longer hold back their reserved decodes, and
        are not chosen again in this pass."""
        for cand in victims:
            self.rem_total_token_offset -= self.offset(cand)
        self.preempt_list.extend(victims)

    def token_total(self, req: Request) -> int:
        """What add_one_req's token check weighs `req`, as matched, at: its uncached prompt, its
        clipped remaining decode and a page."""
        candidate = req.seqlen - len(req.prefix_indices)
        max_new = min(max(req.max_new_tokens - req.num_outputs, 0), self.limits.clip_max_new_tokens)
        return candidate + max_new + self.page_size

    def shortfall(self, req: Request) -> float:
        """How far `req`, as matched, is from add_one_req's token check (it passes below 0)."""
        return self.token_total(req) - self.rem_total_tokens
