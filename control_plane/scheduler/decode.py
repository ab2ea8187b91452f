"""The decode step (docs/scheduler.md#decode-memory-check, SGLang's update_running_batch): drop finished
requests, check that the next decode fits and retract when it does not (docs/scheduler.md#retraction),
decay the new-token ratio otherwise, and give every running request a slot for its next token."""

from __future__ import annotations

from control_plane.config import SchedulerConfig
from control_plane.scheduler.batch import RunningBatch, ScheduledBatch
from control_plane.scheduler.books import SequenceBooks
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.ratio import NewTokenRatioTracker
from control_plane.scheduler.records import StepStats
from control_plane.scheduler.retraction import Retraction
from protos.worker import StepKind


class Decode:
    """The running batch's decode step."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KvManager,
        books: SequenceBooks,
        running: RunningBatch,
        retraction: Retraction,
        ratio: NewTokenRatioTracker,
    ) -> None:
        self.config = config
        self.kv = kv
        self.books = books
        self.running = running
        self.retraction = retraction
        self.ratio = ratio

    def update_running_batch(self, stats: StepStats, forward_ct: int) -> ScheduledBatch | None:
        """The decode batch of step `stats.step_id`, or None when nothing is left to decode.
        `forward_ct` counts the batches launched so far (TEST_RETRACT retracts every interval-th).
        Whatever leaves the running batch here clears its batch_is_full (RunningBatch.keep)."""
        running = self.running
        running.filter_finished()
        if not len(running):
            running.clear_full()
            return None
        kv_full = not self.kv.check_decode_mem(running.seq_lens)
        test_retract = self.config.test_retract and forward_ct % self.config.test_retract_interval == 0
        if kv_full or test_retract:
            stats.kv_full = kv_full
            self.retraction.retract_decode(stats)
        else:
            self.ratio.decay_step()
        if not len(running):
            return None
        stats.kind = StepKind.DECODE
        stats.decode_bs = len(running)
        batch = ScheduledBatch(StepKind.DECODE, stats.step_id)
        self.prepare_for_decode(batch)
        return batch

    def prepare_for_decode(self, batch: ScheduledBatch) -> None:
        """The whole running batch decodes in `batch`: a slot for every request's next position
        (plan-time work on the columns only)."""
        running = self.running
        rows = running.rows
        slots = self.kv.alloc_for_decode(rows, running.seq_lens)
        batch.decode_from(running, self.kv.columns.handle[rows], slots)
        self.books.grow(len(rows))
