"""Factories for data-plane tests: slot layouts, plan builders and a tiny in-test control plane."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from data_plane.executor import Executor
from protos.worker import (
    DecodeWork,
    ExtendWork,
    KvTransfer,
    NewSeq,
    SamplerParams,
    StepKind,
    StepPlan,
    sampled_handles,
)

GREEDY = SamplerParams()


def hf_next_logits(hf_model, token_ids: Sequence[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' logits for the token after `token_ids` (full recompute, no cache)."""
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([list(token_ids)])).logits[0, -1].float()


@dataclass
class SlotAllocator:
    """Hands out scrambled, non-contiguous slot ids in pages of `page_size`, like a paged allocator.

    Pages are drawn in random order; a sequence fills its current page before taking a new one.
    """

    capacity: int
    page_size: int = 1
    seed: int = 0
    _free_pages: list[int] = field(default_factory=list)
    _tail: dict[int, tuple[int, int]] = field(default_factory=dict)  # handle -> (page, used)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self._free_pages = rng.permutation(self.capacity // self.page_size).tolist()

    def alloc(self, handle: int, n: int) -> np.ndarray:
        out: list[int] = []
        page, used = self._tail.get(handle, (-1, self.page_size))
        for _ in range(n):
            if used == self.page_size:
                page, used = self._free_pages.pop(), 0
            out.append(page * self.page_size + used)
            used += 1
        self._tail[handle] = (page, used)
        return np.array(out, dtype=np.int64)


@dataclass
class Extend:
    handle: int
    start: int
    tokens: Sequence[int]
    slots: np.ndarray
    sample: bool = True


def make_plan(
    step_id: int,
    extends: Sequence[Extend] = (),
    decodes: Sequence[tuple[int, int]] = (),
    new_seqs: Sequence[NewSeq] = (),
    releases: Sequence[int] = (),
    offloads: Sequence[KvTransfer] = (),
    restores: Sequence[KvTransfer] = (),
) -> StepPlan:
    """A StepPlan from readable pieces; decodes are (handle, slot) pairs. Columns take the dtypes the
    codec decodes (protos/worker.py), so a decoded plan compares equal to the one built here."""
    return StepPlan(
        step_id=step_id,
        kind=StepKind.of(len(extends), len(decodes)),
        releases=np.array(releases, dtype=np.int64),
        offloads=tuple(offloads),
        restores=tuple(restores),
        new_seqs=tuple(new_seqs),
        extends=ExtendWork(
            handles=np.array([e.handle for e in extends], dtype=np.int64),
            starts=np.array([e.start for e in extends], dtype=np.int32),
            lens=np.array([len(e.tokens) for e in extends], dtype=np.int32),
            sample=np.array([e.sample for e in extends], dtype=np.bool_),
            token_ids=np.array([t for e in extends for t in e.tokens], dtype=np.int32),
            slots=np.concatenate([e.slots for e in extends]) if extends else np.zeros(0, np.int64),
        ),
        decodes=DecodeWork(
            handles=np.array([h for h, _ in decodes], dtype=np.int64),
            slots=np.array([s for _, s in decodes], dtype=np.int64),
        ),
    )


def new_seq(
    handle: int,
    sampler: SamplerParams = GREEDY,
    prefix_slots: np.ndarray | None = None,
    history: Sequence[int] = (),
) -> NewSeq:
    return NewSeq(
        handle=handle,
        sampler=sampler,
        prefix_slots=np.zeros(0, np.int64) if prefix_slots is None else prefix_slots,
        history_ids=np.array(history, dtype=np.int32),
    )


@dataclass
class Driver:
    """A minimal in-test control plane: prefill whole prompts, then decode everyone each step.

    Tracks each handle's tokens (prompt + sampled) so tests can compare with transformers.
    """

    executor: Executor
    slots: SlotAllocator
    tokens: dict[int, list[int]] = field(default_factory=dict)
    step_id: int = 0

    def prefill(
        self, prompts: dict[int, Sequence[int]], samplers: dict[int, SamplerParams] | None = None
    ) -> dict:
        samplers = samplers or {}
        extends = [Extend(h, 0, list(p), self.slots.alloc(h, len(p))) for h, p in prompts.items()]
        seqs = [new_seq(h, samplers.get(h, GREEDY)) for h in prompts]
        for h, p in prompts.items():
            self.tokens[h] = list(p)
        return self._run(make_plan(self._next_id(), extends=extends, new_seqs=seqs))

    def decode(self, handles: Sequence[int]) -> dict:
        decodes = [(h, int(self.slots.alloc(h, 1)[0])) for h in handles]
        return self._run(make_plan(self._next_id(), decodes=decodes))

    def _next_id(self) -> int:
        self.step_id += 1
        return self.step_id

    def _run(self, plan: StepPlan) -> dict[int, int]:
        result = self.executor.execute(plan)
        assert result.error == "", result.error
        sampled = dict(zip(sampled_handles(plan).tolist(), result.token_ids.tolist(), strict=True))
        for h, t in sampled.items():
            self.tokens[h].append(t)
        return sampled
