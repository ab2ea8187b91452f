"""A recording read as a timeline: one line per planned step (what ran, budgets, retractions, finishes).

`TimelineBuilder.feed` takes entries in recorded order and returns the lines it completed. A step's
line is complete when the next plan arrives (finishes published after a step's result belong to
that step), or at `finish()`. Handles are mapped to request ids through the plans' NewSeqs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from control_plane.record.entries import Entry, Finished, NextPlan, StepFigures
from control_plane.request import FinishKind
from protos.worker import StepPlan


@dataclass(frozen=True, slots=True)
class ExtendSpan:
    rid: str
    start: int
    end: int
    # True for a non-final chunk (nothing sampled after it).
    chunked: bool


@dataclass(slots=True)
class StepLine:
    """One step of the timeline; the JSON form is `to_json()`."""

    step: int
    kind: str
    extends: list[ExtendSpan] = field(default_factory=list)
    decodes: list[str] = field(default_factory=list)
    retracted: list[str] = field(default_factory=list)
    aborted: list[tuple[str, str]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    # The ratio admission used this step.
    new_token_ratio: float = 0.0
    # Budgets as left after admission; None when nothing was admitted from the queue.
    rem_total_tokens: float | None = None
    rem_input_tokens: int | None = None
    rem_chunk_tokens: int | None = None
    cached_tokens: int = 0
    running: int = 0
    queued: int = 0
    kv_used: int = 0
    kv_capacity: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "kind": self.kind,
            "extends": [
                {"rid": e.rid, "start": e.start, "end": e.end, "chunked": e.chunked} for e in self.extends
            ],
            "decodes": self.decodes,
            "retracted": self.retracted,
            "aborted": [{"rid": rid, "reason": reason} for rid, reason in self.aborted],
            "finished": self.finished,
            "new_token_ratio": self.new_token_ratio,
            "rem_total_tokens": self.rem_total_tokens,
            "rem_input_tokens": self.rem_input_tokens,
            "rem_chunk_tokens": self.rem_chunk_tokens,
            "cached_tokens": self.cached_tokens,
            "running": self.running,
            "queued": self.queued,
            "kv_used": self.kv_used,
            "kv_capacity": self.kv_capacity,
        }


class TimelineBuilder:
    def __init__(self) -> None:
        self.rids: dict[int, str] = {}
        self._current: StepLine | None = None
        # Finishes published before the first plan (refused arrivals) go on the first line.
        self._early: list[Finished] = []

    def feed(self, entry: Entry) -> list[StepLine]:
        if isinstance(entry, NextPlan) and entry.plan is not None:
            done = self.finish()
            self._current = self._line_for(entry.plan)
            for early in self._early:
                self._add_finish(early)
            self._early = []
            return done
        if isinstance(entry, StepFigures) and self._current is not None:
            _apply_figures(self._current, entry)
        elif isinstance(entry, Finished):
            self._add_finish(entry)
        return []

    def finish(self) -> list[StepLine]:
        """The line in progress, if any (call at the end of the recording)."""
        done, self._current = self._current, None
        return [done] if done is not None else []

    def _line_for(self, plan: StepPlan) -> StepLine:
        for seq in plan.new_seqs:
            self.rids[seq.handle] = seq.request_id
        line = StepLine(plan.step_id, plan.kind.value)
        ext = plan.extends
        for handle, start, length, sample in zip(
            ext.handles.tolist(), ext.starts.tolist(), ext.lens.tolist(), ext.sample.tolist(), strict=True
        ):
            line.extends.append(ExtendSpan(self._rid(handle), start, start + length, not sample))
        line.decodes = [self._rid(h) for h in plan.decodes.handles.tolist()]
        return line

    def _rid(self, handle: int) -> str:
        return self.rids.get(handle, f"#{handle}")

    def _add_finish(self, entry: Finished) -> None:
        line = self._current
        if line is None:
            self._early.append(entry)
        elif entry.reason.kind is FinishKind.ABORT:
            line.aborted.append((entry.rid, entry.reason.message))
        else:
            line.finished.append(entry.rid)


def _apply_figures(line: StepLine, figures: StepFigures) -> None:
    stats = figures.stats
    line.retracted = list(stats.retracted)
    line.new_token_ratio = figures.admission_ratio
    line.rem_total_tokens = stats.rem_total_tokens
    line.rem_input_tokens = stats.rem_input_tokens
    line.rem_chunk_tokens = stats.rem_chunk_tokens
    line.cached_tokens = stats.cached_tokens
    line.running = figures.running
    line.queued = stats.queued
    line.kv_used = figures.kv_used
    line.kv_capacity = figures.kv_capacity


class TimelineSink:
    """A recorder sink that turns entries into timeline lines as they come (for `simulate`)."""

    def __init__(self, emit: Callable[[StepLine], None]) -> None:
        self.builder = TimelineBuilder()
        self.emit = emit

    def write(self, entry: Entry) -> None:
        for line in self.builder.feed(entry):
            self.emit(line)

    def end_step(self, step: int) -> None:
        pass

    def close(self) -> None:
        for line in self.builder.finish():
            self.emit(line)
