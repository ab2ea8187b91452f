"""The running batch (kept columnar for the decode hot path) and the batch a plan was built from."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from control_plane.request import Request
from control_plane.scheduler.plan import StepKind


class RunningBatch:
    """Requests being decoded, with their rows, lengths and handles as numpy columns.

    The columns are rebuilt only when membership changes (merge, filter); a decode step updates
    `seq_lens` in place, so planning a decode costs no Python work per request.
    """

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.rows = np.zeros(0, dtype=np.int64)
        self.seq_lens = np.zeros(0, dtype=np.int64)
        self.handles = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.reqs)

    def _rebuild(self) -> None:
        n = len(self.reqs)
        self.rows = np.fromiter((r.req_pool_idx for r in self.reqs), dtype=np.int64, count=n)
        self.seq_lens = np.fromiter((r.kv_committed_len for r in self.reqs), dtype=np.int64, count=n)
        self.handles = np.fromiter((r.handle for r in self.reqs), dtype=np.int64, count=n)

    def merge(self, reqs: Iterable[Request]) -> None:
        self.reqs.extend(reqs)
        self._rebuild()

    def keep(self, indices: list[int]) -> None:
        """Keep these positions, in this order."""
        self.reqs = [self.reqs[i] for i in indices]
        self._rebuild()

    def filter_finished(self) -> bool:
        """Drop finished requests; returns whether any were dropped."""
        keep = [i for i, r in enumerate(self.reqs) if not r.finished]
        if len(keep) == len(self.reqs):
            return False
        self.keep(keep)
        return True

    def remove(self, drop: Iterable[Request]) -> None:
        gone = {id(r) for r in drop}
        self.keep([i for i, r in enumerate(self.reqs) if id(r) not in gone])


@dataclass(slots=True)
class ScheduledBatch:
    """What one plan asked the worker to do, kept until its result is applied."""

    kind: StepKind
    # Requests extended in this step, in plan order (the chunked continuation first).
    extend_reqs: list[Request] = field(default_factory=list)
    # Requests decoded in this step, in plan order.
    decode_reqs: list[Request] = field(default_factory=list)
    # The request still mid-chunk after this step, if any.
    chunked_req: Request | None = None

    @property
    def is_extend(self) -> bool:
        return self.kind in (StepKind.PREFILL, StepKind.MIXED)
