"""Greedy decoding with a tiny pool: random retractions, slot reuse in the same plan, re-prefill.

A miniature control plane (a free list of scrambled slots, retract-and-requeue) drives the
executor; every sequence must equal transformers' greedy continuation of its prompt, whatever
happened to it on the way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from data_plane.executor import Executor
from protos.worker import StepPlan, sampled_handles
from tests.data_plane.factories import Extend, make_plan, new_seq

CAPACITY = 80
NEW_TOKENS = 14


@dataclass
class Request:
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    handle: int = -1
    slots: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= NEW_TOKENS


@dataclass
class MiniControl:
    """Plans like a (very) small control plane; retracts at random and when out of slots."""

    executor: Executor
    rng: np.random.Generator
    waiting: list[Request]
    running: list[Request] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    pending_releases: list[int] = field(default_factory=list)
    next_handle: int = 1
    step_id: int = 0
    retractions: int = 0

    def __post_init__(self) -> None:
        self.free = self.rng.permutation(CAPACITY).tolist()

    def run(self) -> None:
        while self.waiting or self.running:
            self.step()
            assert self.step_id < 500, "no progress"

    def step(self) -> None:
        releases, self.pending_releases = self.pending_releases, []
        if self.running and self.rng.random() < 0.25:
            releases.append(self._retract(self.running.pop(int(self.rng.integers(len(self.running))))))
        decodes = self._plan_decodes(releases)
        admitted = self._admit()
        plan = make_plan(
            self.step_id + 1,
            releases=releases,
            new_seqs=[new_seq(r.handle) for r in admitted],
            extends=[Extend(r.handle, 0, r.prompt + r.output, np.array(r.slots)) for r in admitted],
            decodes=[(r.handle, r.slots[-1]) for r in decodes],
        )
        self._apply(plan, admitted + decodes)

    def _plan_decodes(self, releases: list[int]) -> list[Request]:
        decodes = []
        for r in self.running:
            if not self.free:
                releases.append(self._retract(r))
                continue
            r.slots.append(self._take(1)[0])
            decodes.append(r)
        return decodes

    def _admit(self) -> list[Request]:
        admitted = []
        while (
            self.waiting and len(self.free) >= len(self.waiting[0].prompt) + len(self.waiting[0].output) + 4
        ):
            r = self.waiting.pop(0)
            r.handle, self.next_handle = self.next_handle, self.next_handle + 1
            r.slots = self._take(len(r.prompt) + len(r.output))
            admitted.append(r)
        return admitted

    def _apply(self, plan: StepPlan, sampled: list[Request]) -> None:
        self.step_id = plan.step_id
        result = self.executor.execute(plan)
        assert result.error == "", result.error
        tokens = dict(zip(sampled_handles(plan).tolist(), result.token_ids.tolist(), strict=True))
        for r in sampled:
            r.output.append(tokens[r.handle])
            if r.done:
                self.pending_releases.append(r.handle)
                self.free.extend(r.slots)
        self.running = [r for r in sampled if not r.done]

    def _retract(self, r: Request) -> int:
        """Free a request's slots (reusable by this very plan) and requeue it with its output so far."""
        self.retractions += 1
        self.free.extend(r.slots)
        r.slots = []
        self.waiting.insert(0, r)
        return r.handle

    def _take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken


def _hf_greedy(hf_model, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    config = copy.deepcopy(hf_model.generation_config)
    config.do_sample, config.max_new_tokens, config.eos_token_id, config.pad_token_id = (
        False,
        NEW_TOKENS,
        None,
        0,
    )
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_survives_random_retraction_and_slot_reuse(make_executor, hf_model, seed: int) -> None:
    rng = np.random.default_rng(seed)
    requests = [Request(rng.integers(1, 1024, size=int(rng.integers(3, 12))).tolist()) for _ in range(6)]
    control = MiniControl(make_executor(capacity=CAPACITY), rng, waiting=list(requests))
    control.run()
    assert control.retractions > 0
    for r in requests:
        assert r.output[:NEW_TOKENS] == _hf_greedy(hf_model, r.prompt)
    final = control.executor.execute(make_plan(control.step_id + 1, releases=control.pending_releases))
    assert (final.kv.live_seqs, final.kv.seq_slots) == (0, 0)
