"""Executes one StepPlan: apply the deltas, run one forward over the ragged batch, sample, report.

The step reads like the protocol: releases, offloads, restores, new sequences, then extends and
decodes as one forward, then sampling and prompt scoring. A plan that contradicts the worker's state
is answered with an error string instead of crashing the worker. Plan checks for the forward (the
score columns' among them) happen before any slot table changes; a failure in
releases/offloads/new sequences may leave those earlier deltas applied, so the control plane should
treat an error result as fatal for the sequences the plan touched.

Prompt scoring (ExtendWork.score_*, data_plane/scoring.py) reports, for each scored position, the
raw log-softmax of the model's logits there (never penalised, biased or truncated: prompt rows are
not sampled, so the processed mode does not apply to them), scored against the next prompt token,
with the sequence's `logprobs - 1` top alternatives and its token_ids_logprob. The forward hands back
only the scored rows' final-normed hidden states; the LM head runs over them in slices of at most
SCORE_SLICE_BYTES of logits, so scoring a long prompt never holds [positions, vocab] logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import structlog
import torch

from data_plane.backends.base import AttentionBackend, StepLayout
from data_plane.backends.sdpa import SdpaBackend
from data_plane.constraints import Constraints, GrammarMasks
from data_plane.kv_pool import HostCopy, KvPool
from data_plane.kv_transfer import Transfers
from data_plane.models.llama import ForwardBatch, LlamaModel
from data_plane.sampler import BiasRow, PenaltyRow, SampleOutput, ids_logprobs, logprob_rows, sample
from data_plane.scoring import ScoreRows, score_rows
from data_plane.state import NO_TOKEN, PlanError, SequenceTable
from protos.worker import (
    Grammar,
    KvReceive,
    KvReport,
    KvSend,
    KvTransfer,
    PromptScores,
    SamplerParams,
    StepPlan,
    StepResult,
    TokenLogprobs,
)

log = structlog.get_logger(__name__)

# A CPU step of at most this many tokens runs on the worker's event loop thread (data_plane/session.py):
# tens of milliseconds at most on a small model, so the loop stays responsive.
INLINE_MAX_TOKENS = 256

# Prompt scoring runs the LM head over slices of the scored rows: a slice's float32 logits
# ([rows, vocab]) stay under this many bytes, so the scoring's memory is bounded whatever the prompt
# (about twice this at its peak: a slice's logits and their log-softmax), where 2,000 rows at a 128k
# vocabulary would be 1 GB of logits at once.
SCORE_SLICE_BYTES = 16 * 2**20


def score_slice_rows(vocab_size: int) -> int:
    """Rows per scoring slice (at least one, for vocabularies past the budget)."""
    return max(1, SCORE_SLICE_BYTES // (4 * vocab_size))


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """The forward batch plus who samples from which logits row."""

    batch: ForwardBatch
    sample_rows: np.ndarray  # table rows, in result order
    # The scored prompt rows and the table row of each extend entry; None when nothing scores.
    scoring: ScoreRows | None = None
    ext_rows: np.ndarray | None = None


class Executor:
    """Owns the model, the KV pool, the sequence table and the host pool of one worker."""

    def __init__(
        self,
        model: LlamaModel,
        pool: KvPool,
        host_pool_tokens: int = 0,
        seed: int | None = None,
        decode_cache: bool = True,
        attention: AttentionBackend | None = None,
        constraints: Constraints | None = None,
    ) -> None:
        """`attention` defaults to the SDPA backend, with the decode block unless `decode_cache` is off;
        `constraints` to none (a worker without a tokenizer cannot constrain)."""
        self.model = model
        self.pool = pool
        self.table = SequenceTable(model.config.max_position_embeddings)
        self.host_pool_tokens = host_pool_tokens
        self.host: dict[int, HostCopy] = {}
        self.rng = np.random.default_rng(seed)
        self.device = model.device
        self.attention = attention or SdpaBackend(model, decode_cache=decode_cache)
        self.constraints = (
            constraints
            if constraints is not None
            else Constraints(None, model.config.vocab_size, model.config.eos_token_ids)
        )
        # Fills the step's grammar masks while the forward runs (made on the first constrained step).
        self._mask_thread: ThreadPoolExecutor | None = None
        # Sends and receives KV from other workers (set once the worker's transport serves); None:
        # a plan that asks for either is refused.
        self.transfers: Transfers | None = None

    # ---- the step ----------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan; never raises for a bad plan or a failed forward (see StepResult.error)."""
        started = time.perf_counter()
        try:
            return self._execute(plan, started)
        except PlanError as exc:
            self._invalidate_attention()
            return self._error_result(plan, str(exc), started)
        except Exception as exc:
            self._invalidate_attention()
            log.exception("step_failed", step_id=plan.step_id)
            return self._error_result(plan, f"{type(exc).__name__}: {exc}", started)

    def _execute(self, plan: StepPlan, started: float) -> StepResult:
        prepared = self._apply(plan)
        if prepared is None:
            return self._result(plan.step_id, np.zeros(0, np.int64), (), started)
        started_masks = self._start_masks(prepared.sample_rows)
        forward = self.model.forward(prepared.batch, self.pool)
        masks = started_masks.result() if started_masks else None
        output = self._sample(forward.logits, prepared.sample_rows, masks)
        if self.constraints:
            self.constraints.accept(prepared.sample_rows, output.token_ids)
        self.table.last_token[prepared.sample_rows] = output.token_ids
        ones = np.ones(len(prepared.sample_rows), dtype=np.int64)
        self.table.extend_history(prepared.sample_rows, ones, output.token_ids)
        scores: tuple[PromptScores, ...] = ()
        if prepared.scoring is not None and forward.scored_hidden is not None:
            assert prepared.ext_rows is not None
            scores = self._score_prompts(forward.scored_hidden, prepared.scoring, prepared.ext_rows)
        result = self._result(plan.step_id, output.token_ids, output.logprobs, started, prompt_scores=scores)
        if masks is not None and len(masks.failed):
            return replace(result, grammar_failed=masks.failed.astype(np.int32))
        return result

    def _start_masks(self, rows: np.ndarray) -> Future[GrammarMasks | None] | None:
        """Fill the constrained rows' masks on a thread of their own while the forward runs (the
        masks depend only on the tokens already accepted); None when no sequence is constrained."""
        if not self.constraints:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._mask_thread.submit(self.constraints.fill, rows)

    def prepare_grammar(self, grammar: Grammar, done: Callable[[str], None]) -> None:
        """Compile `grammar` off the step (Constraints.prepare); `done` is called on its thread."""
        self.constraints.prepare(grammar, done)

    def runs_inline(self, plan: StepPlan) -> bool:
        """A CPU step of few tokens; CUDA steps wait for the device, so they never block the loop."""
        tokens = len(plan.extends.token_ids) + len(plan.decodes.handles)
        return self.device.type == "cpu" and tokens <= INLINE_MAX_TOKENS

    def forward_logits(self, plan: StepPlan) -> torch.Tensor:
        """Apply a plan and return its sampling rows' logits without sampling (for tests and replay)."""
        prepared = self._apply(plan)
        if prepared is None:
            return torch.zeros(0, self.model.config.vocab_size)
        return self.model.forward(prepared.batch, self.pool).logits

    def _forget_cached_kv(self, plan: StepPlan) -> None:
        """Tell the backend of every sequence whose KV or slots this plan changes."""
        self.attention.forget(_kv_changing_handles(plan))

    def _invalidate_attention(self) -> None:
        """After a failed step what the backend keeps may describe K/V the forward never wrote."""
        self.attention.invalidate()

    def reset(self) -> None:
        """Forget every sequence and host copy (a plan's `reset`, and every new session)."""
        self._release(np.array(self.table.handles(), dtype=np.int64))
        self.host.clear()
        self._invalidate_attention()

    def kv_report(self) -> KvReport:
        return KvReport(
            live_seqs=self.table.live_seqs - len(self.host),
            seq_slots=self.table.seq_slots,
            capacity_tokens=self.pool.capacity,
            device_mem_used_bytes=self._device_mem_used(),
            host_seqs=len(self.host),
        )

    # ---- deltas ------------------------------------------------------------------------------

    def _apply(self, plan: StepPlan) -> PreparedStep | None:
        """Apply every delta in protocol order; None when the plan has no forward work."""
        if (plan.sends or plan.receives) and self.transfers is None:
            raise PlanError("the plan sends or receives KV, but this worker serves no KV transfer link")
        self._check_slots(plan)
        self._forget_cached_kv(plan)
        self._send(plan.sends)  # first: the slots may be freed and reused by this very plan
        if plan.reset:
            self.reset()
        self._release(plan.releases)
        for remap in plan.remaps:
            self.table.remap(remap.handle, remap.start, remap.slots)
        self._offload(plan.offloads)
        self._restore(plan.restores)
        self._receive(plan.receives)
        for seq in plan.new_seqs:
            self.table.add(seq.handle, seq.sampler, seq.prefix_slots, seq.history_ids)
            if seq.sampler.grammar is not None:
                self.constraints.start(
                    self.table.row(seq.handle), seq.sampler.grammar, seq.prompt_len, seq.history_ids
                )
        return self._prepare(plan)

    def _check_slots(self, plan: StepPlan) -> None:
        arrays = [plan.extends.slots, plan.decodes.slots]
        arrays += [s.prefix_slots for s in plan.new_seqs]
        arrays += [t.slots for t in (*plan.offloads, *plan.restores)]
        arrays += [r.slots for r in plan.remaps]
        arrays += [t.slots for t in plan.sends] + [t.slots for t in plan.receives]
        for slots in arrays:
            if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= self.pool.capacity):
                raise PlanError(f"slot id out of range [0, {self.pool.capacity})")

    def _release(self, handles: np.ndarray) -> None:
        for handle in handles.tolist():
            self.host.pop(handle, None)
            self.constraints.remove(self.table.row(handle))
            self.table.remove(handle)

    def _offload(self, transfers: tuple[KvTransfer, ...]) -> None:
        """Copy each sequence's KV to the host pool; its device slot table becomes empty."""
        for t in transfers:
            if t.handle in self.host:
                raise PlanError(f"handle {t.handle} is already offloaded")
            self.table.row(t.handle)
            if self._host_tokens() + len(t.slots) > self.host_pool_tokens:
                raise PlanError(
                    f"host pool full ({self.host_pool_tokens} tokens) offloading handle {t.handle}"
                )
            self.host[t.handle] = self.pool.copy_out(self._slot_tensor(t.slots))
            self.table.replace_slots(t.handle, np.zeros(0, dtype=np.int64))

    def _restore(self, transfers: tuple[KvTransfer, ...]) -> None:
        """Copy saved KV into the named device slots, which become the sequence's slot table."""
        for t in transfers:
            saved = self.host.get(t.handle)
            if saved is None:
                raise PlanError(f"handle {t.handle} has nothing in the host pool to restore")
            if saved.tokens != len(t.slots):
                raise PlanError(
                    f"handle {t.handle}: restore names {len(t.slots)} slots, saved {saved.tokens}"
                )
            self.pool.copy_in(self._slot_tensor(t.slots), saved)
            self.table.replace_slots(t.handle, t.slots)
            del self.host[t.handle]

    def _send(self, sends: tuple[KvSend, ...]) -> None:
        """Snapshot each send's slots into host memory and start sending it."""
        if not sends:
            return
        assert self.transfers is not None  # _apply refused the plan otherwise
        for send in sends:
            snapshot = self.pool.copy_out(self._slot_tensor(send.slots))
            self.transfers.send(send.address, send.transfer_id, snapshot)

    def _receive(self, receives: tuple[KvReceive, ...]) -> None:
        """Write each received transfer into its slots (or forget it, for a receive without slots)."""
        if not receives:
            return
        assert self.transfers is not None
        store = self.transfers.received
        for receive in receives:
            if not len(receive.slots):
                store.discard(receive.transfer_id)
                continue
            try:
                copy = store.take(receive.transfer_id)
            except KeyError:
                raise PlanError(f"receives: no transfer {receive.transfer_id!r} has arrived") from None
            pool = self.pool.k
            want = (pool.shape[0], receive.skip + len(receive.slots), *pool.shape[2:])
            if tuple(copy.k.shape) != want or copy.k.dtype != pool.dtype:
                raise PlanError(
                    f"receives: transfer {receive.transfer_id!r} holds K/V of shape {list(copy.k.shape)} "
                    f"in {copy.k.dtype}; the plan's slots (after skipping {receive.skip}) in this pool "
                    f"take {list(want)} in {pool.dtype}"
                )
            if receive.skip:
                copy = HostCopy(copy.k[:, receive.skip :], copy.v[:, receive.skip :])
            self.pool.copy_in(self._slot_tensor(receive.slots), copy)

    def _host_tokens(self) -> int:
        return sum(copy.tokens for copy in self.host.values())

    def _slot_tensor(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(slots.astype(np.int64)).to(self.device)

    # ---- batch building ----------------------------------------------------------------------

    def _prepare(self, plan: StepPlan) -> PreparedStep | None:
        """Check the extends/decodes, append their slots to the tables, and lay out the forward."""
        ext, dec = plan.extends, plan.decodes
        if len(ext.handles) == 0 and len(dec.handles) == 0:
            return None
        ext_rows, dec_rows = self._check_work(plan)
        scoring = score_rows(ext)
        self.table.extend_history(ext_rows, ext.lens, ext.token_ids)
        if self.constraints:
            self.constraints.feed(ext_rows, ext.starts, ext.lens, ext.token_ids)
        ext_positions = self.table.append_slots(ext_rows, ext.lens, ext.slots)
        dec_ones = np.ones(len(dec_rows), dtype=np.int64)
        dec_positions = self.table.append_slots(dec_rows, dec_ones, dec.slots)
        num_ext_tokens = len(ext.token_ids)
        layout = StepLayout(
            ext_rows=ext_rows,
            ext_q_lens=ext.lens.astype(np.int64),
            dec_handles=dec.handles,
            dec_rows=dec_rows,
            lengths=self.table.lengths,
            slots=self.table.slots,
        )
        sample_mask = ext.sample.astype(bool)
        sample_index = np.concatenate(
            ((np.cumsum(ext.lens) - 1)[sample_mask], num_ext_tokens + np.arange(len(dec_rows)))
        )
        batch = ForwardBatch(
            token_ids=self._tensor(np.concatenate((ext.token_ids, self.table.last_token[dec_rows]))),
            positions=self._tensor(np.concatenate((ext_positions, dec_positions))),
            write_slots=self._tensor(np.concatenate((ext.slots, dec.slots))),
            attention=self.attention.plan(layout),
            sample_index=self._tensor(sample_index),
            score_index=self._tensor(scoring.flat_index) if scoring is not None else None,
        )
        return PreparedStep(
            batch=batch,
            sample_rows=np.concatenate((ext_rows[sample_mask], dec_rows)),
            scoring=scoring,
            ext_rows=ext_rows if scoring is not None else None,
        )

    def _check_work(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the extend and decode entries; PlanError (before any change) if inconsistent."""
        ext, dec = plan.extends, plan.decodes
        n = len(ext.handles)
        columns_agree = len(ext.starts) == len(ext.lens) == len(ext.sample) == n
        if not columns_agree or len(dec.slots) != len(dec.handles):
            raise PlanError("extend/decode columns have different lengths")
        if n and int(ext.lens.min()) < 1:
            raise PlanError("an extend entry has no tokens")
        if not int(ext.lens.sum()) == len(ext.token_ids) == len(ext.slots):
            raise PlanError("extend lens do not match token_ids/slots")
        ext_rows, dec_rows = self.table.rows(ext.handles), self.table.rows(dec.handles)
        all_rows = np.concatenate((ext_rows, dec_rows))
        if len(np.unique(all_rows)) != len(all_rows):
            raise PlanError("a handle appears more than once in extends/decodes")
        self._check_not_offloaded(np.concatenate((ext.handles, dec.handles)))
        mismatch = np.flatnonzero(self.table.lengths[ext_rows] != ext.starts)
        if len(mismatch):
            i = int(mismatch[0])
            have = int(self.table.lengths[ext_rows[i]])
            raise PlanError(
                f"extend of handle {ext.handles[i]} starts at {ext.starts[i]}, worker holds {have}"
            )
        no_token = np.flatnonzero(self.table.last_token[dec_rows] == NO_TOKEN)
        if len(no_token):
            raise PlanError(f"decode of handle {dec.handles[no_token[0]]} before any token was sampled")
        return ext_rows, dec_rows

    def _check_not_offloaded(self, handles: np.ndarray) -> None:
        if self.host:
            for handle in handles.tolist():
                if handle in self.host:
                    raise PlanError(f"handle {handle} is offloaded; restore it first")

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    # ---- sampling and results ----------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, masks: GrammarMasks | None) -> SampleOutput:
        penalties = []
        if self.table.any_penalties:  # skip the per-row scan in the common case
            penalties = [
                PenaltyRow(index=i, params=self.table.params(row), history=history)
                for i, row in enumerate(rows.tolist())
                if (history := self.table.history(row)) is not None
            ]
        biases = []
        if self.table.any_bias:
            for i, row in enumerate(rows.tolist()):
                bias = self.table.bias(row)
                if bias is not None:
                    biases.append(BiasRow(i, *bias))
        # Slot tables already include this step's tokens, so the sampled token's position is the length.
        positions = self.table.lengths[rows]
        cols = self.table.sampler_columns(rows)
        ids: list[np.ndarray] = []
        if int(cols.logprobs.max(initial=0)) > 0:  # per-row lookups only when some row asks
            ids = [_ids_of(self.table.params(row)) for row in rows.tolist()]
        return sample(
            logits, cols, positions, penalties, self.rng, biases, logprob_ids=ids, grammar_masks=masks
        )

    @torch.inference_mode()
    def _score_prompts(
        self, hidden: torch.Tensor, scoring: ScoreRows, ext_rows: np.ndarray
    ) -> tuple[PromptScores, ...]:
        """One PromptScores per scoring entry, from the scored rows' hidden states, slice by slice."""
        step = score_slice_rows(self.model.config.vocab_size)
        out = []
        start = 0
        for entry, count in zip(scoring.entries.tolist(), scoring.counts.tolist(), strict=True):
            params = self.table.params(int(ext_rows[entry]))
            top_n, ids = max(0, params.logprobs - 1), _ids_of(params)
            rows: list[TokenLogprobs] = []
            for a in range(start, start + count, step):
                b = min(a + step, start + count)
                rows.extend(self.score_slice(hidden[a:b], scoring.targets[a:b], top_n, ids))
            out.append(PromptScores(entry=entry, rows=tuple(rows)))
            start += count
        return tuple(out)

    def score_slice(
        self, hidden: torch.Tensor, targets: np.ndarray, top_n: int, ids: np.ndarray
    ) -> tuple[TokenLogprobs, ...]:
        """Score one slice of rows: raw logprobs of `targets`, top_n alternatives, the `ids`."""
        # Two [rows, vocab] buffers at most: the logits, and their log-softmax (the logits then go).
        logprobs = torch.log_softmax(self.model.head(hidden), dim=-1)
        rows = len(targets)
        ids_values: list[tuple[float, ...]] = [()] * rows
        if len(ids):
            ids_values = [tuple(v) for v in ids_logprobs(logprobs, ids).tolist()]
        return logprob_rows(logprobs, targets, np.full(rows, top_n), ids_values)

    def _result(
        self,
        step_id: int,
        token_ids: np.ndarray,
        logprobs: tuple[TokenLogprobs, ...],
        started: float,
        error: str = "",
        prompt_scores: tuple[PromptScores, ...] = (),
    ) -> StepResult:
        return StepResult(
            step_id=step_id,
            token_ids=token_ids,
            kv=self.kv_report(),
            forward_s=time.perf_counter() - started,
            logprobs=logprobs,
            prompt_scores=prompt_scores,
            error=error,
            transfers=self.transfers.take_outcomes() if self.transfers is not None else (),
        )

    def _error_result(self, plan: StepPlan, message: str, started: float) -> StepResult:
        return self._result(plan.step_id, np.zeros(0, np.int64), (), started, message or "step failed")

    def _device_mem_used(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self.model.weight_bytes + self.pool.nbytes + self.attention.nbytes


def _ids_of(params: SamplerParams) -> np.ndarray:
    """The token_ids_logprob a sequence's logprobs report (int64; empty when it asks for none)."""
    if params.logprobs <= 0 or not params.token_ids_logprob:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(params.token_ids_logprob, dtype=np.int64)


def _kv_changing_handles(plan: StepPlan) -> list[int]:
    """Sequences whose slot tables a plan's deltas replace, rewrite or end."""
    moved = [r.handle for r in plan.remaps] + [t.handle for t in (*plan.offloads, *plan.restores)]
    return [*plan.releases.tolist(), *moved]
