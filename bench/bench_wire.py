"""The worker link's cost per decode step: plan bytes, codec time on both ends, the sim step.

    python bench/bench_wire.py [--running 256 1024 4096] [--steps 200] [--churn 0 6]

For each number of running sequences, page size (1: the allocator hands each step one contiguous
block; 16: each sequence fills its own page, lengths staggered, so 1/16 of them take a new page,
drawn at random, every step) and churn (sequences that leave and join the decode set per step; the
median measured on main was 6), it builds `--steps` decode plans, then pushes them through one
link's codecs in order, serialised bytes included:

- plan B: the median size of a plan on the link (a delta against the previous decode plan), and of
  the same plan on its own (`plan_to_proto`, decode set in full: what a recording holds);
- control us: encode the plan + serialise, parse the result + decode it (token count checked);
- worker us: parse the plan + decode it (the decode set rebuilt), encode the result + serialise
  (both ends use protos/worker_codec.py);
- sim us: `SimExecutor.execute` of the decoded plan with that many live sequences (no churn only).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from protos.worker import DecodeWork, KvReport, StepKind, StepPlan, StepResult

VOCAB = 32_000
PAGES = 1 << 22


@dataclass
class DecodeWorkload:
    """Consecutive decode plans of `running` sequences, `churn` of them replaced every step."""

    running: int
    page_size: int
    churn: int = 0
    seed: int = 0
    rng: np.random.Generator = field(init=False)
    handles: np.ndarray = field(init=False)
    lengths: np.ndarray = field(init=False)
    pages: np.ndarray = field(init=False)
    next_handle: int = field(init=False)
    block: int = 1 << 30

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.handles = np.arange(1, self.running + 1, dtype=np.int64)
        self.next_handle = self.running + 1
        self.lengths = self.rng.integers(64, 2048, size=self.running)
        self.pages = self.rng.integers(0, PAGES, size=self.running) * self.page_size

    def plans(self, steps: int) -> list[StepPlan]:
        return [self._plan(step) for step in range(1, steps + 1)]

    def _plan(self, step: int) -> StepPlan:
        releases = self._churn() if step > 1 else np.zeros(0, dtype=np.int64)
        self.lengths += 1
        if self.page_size == 1:
            slots = self.block + np.arange(self.running, dtype=np.int64)
            self.block += self.running
        else:
            turning = self.lengths % self.page_size == 0
            self.pages[turning] = self.rng.integers(0, PAGES, size=int(turning.sum())) * self.page_size
            slots = self.pages + self.lengths % self.page_size
        decodes = DecodeWork(handles=self.handles.copy(), slots=slots.astype(np.int64))
        return StepPlan(step, StepKind.DECODE, releases=releases, decodes=decodes)

    def _churn(self) -> np.ndarray:
        """Replace `churn` random sequences (they leave, order kept) by new ones at the end."""
        if not self.churn:
            return np.zeros(0, dtype=np.int64)
        gone = self.rng.choice(self.running, size=self.churn, replace=False)
        keep = np.ones(self.running, dtype=bool)
        keep[gone] = False
        released = self.handles[gone]
        fresh = np.arange(self.next_handle, self.next_handle + self.churn, dtype=np.int64)
        self.next_handle += self.churn
        self.handles = np.concatenate((self.handles[keep], fresh))
        self.lengths = np.concatenate((self.lengths[keep], self.rng.integers(64, 2048, size=self.churn)))
        new_pages = self.rng.integers(0, PAGES, size=self.churn) * self.page_size
        self.pages = np.concatenate((self.pages[keep], new_pages))
        return released


def result_for(plan: StepPlan, rng: np.random.Generator) -> StepResult:
    tokens = rng.integers(3, VOCAB, size=len(plan.decodes)).astype(np.int32)
    kv = KvReport(live_seqs=len(plan.decodes), seq_slots=1, capacity_tokens=1 << 24)
    return StepResult(plan.step_id, token_ids=tokens, kv=kv, forward_s=0.01)


@dataclass(frozen=True, slots=True)
class Figures:
    plan_bytes: float
    full_bytes: float
    control_us: float
    worker_us: float


def measure_link(plans: list[StepPlan]) -> Figures:
    """Every plan through one link's codecs, in order; medians over the plans after the first."""
    from protos import worker_codec
    from protos.stepwise.v1 import worker_pb2 as wk_pb

    encoder, decoder = worker_codec.PlanEncoder(), worker_codec.PlanDecoder()
    rng = np.random.default_rng(1)
    sizes, full, control_s, worker_s = [], [], [], []
    for plan in plans:
        typed = result_for(plan, rng)
        # As the worker's executor answers: its sampler's tokens are int64.
        answer = StepResult(typed.step_id, typed.token_ids.astype(np.int64), kv=KvReport(1, 1, 1, 0, 0))
        t0 = time.perf_counter()
        wire = encoder.encode(plan).SerializeToString()
        t1 = time.perf_counter()
        decoder.control(wk_pb.ControlMessage.FromString(wire))
        reply = worker_codec.result_to_proto(answer).SerializeToString()
        t2 = time.perf_counter()
        worker_codec.result_from_proto(wk_pb.WorkerMessage.FromString(reply).result, len(plan.decodes))
        t3 = time.perf_counter()
        sizes.append(len(wire))
        full.append(worker_codec.plan_to_proto(plan).ByteSize())
        control_s.append((t1 - t0) + (t3 - t2))
        worker_s.append(t2 - t1)
    rest = slice(1, None)
    return Figures(
        float(np.median(sizes[rest])),
        float(np.median(full[rest])),
        float(np.median(control_s[rest])) * 1e6,
        float(np.median(worker_s[rest])) * 1e6,
    )


def measure_sim(running: int, plans: list[StepPlan]) -> float:
    """Median µs of SimExecutor.execute on the decoded plans, `running` sequences prefilled first."""
    from data_plane.sim import SimExecutor
    from protos.worker import ExtendWork, NewSeq, SamplerParams
    from stepwise.wire import WireLink

    sim = SimExecutor(1 << 40, VOCAB, 2)
    handles = plans[0].decodes.handles
    lengths = np.full(running, 64, dtype=np.int64)
    prefill = StepPlan(
        0,
        StepKind.PREFILL,
        new_seqs=tuple(NewSeq(int(h), SamplerParams(), request_id=f"r{h}") for h in handles.tolist()),
        extends=ExtendWork(
            handles=handles,
            starts=np.zeros(running, dtype=np.int64),
            lens=lengths,
            sample=np.ones(running, dtype=bool),
            token_ids=np.ones(int(lengths.sum()), dtype=np.int64),
            slots=np.arange(int(lengths.sum()), dtype=np.int64),
        ),
    )
    assert not sim.execute(prefill).error
    link = WireLink(sim)
    decoder = link.decoder
    times = []
    for plan in plans:
        worker_plan = decoder.plan(link.encoder.encode(plan).plan)
        started = time.perf_counter()
        result = sim.execute(worker_plan)
        times.append(time.perf_counter() - started)
        assert not result.error, result.error
    return float(np.median(times[1:])) * 1e6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--churn", type=int, nargs="+", default=[0, 6])
    parser.add_argument("--steps", type=int, default=200)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"{args.steps} decode steps each; medians per step")
    header = f"{'running':>7} {'page':>4} {'churn':>5} {'plan B':>7} {'full B':>7} {'control us':>10}"
    print(f"{header} {'worker us':>9} {'sim us':>8}")
    for running in args.running:
        for page_size in args.page_sizes:
            for churn in args.churn:
                plans = DecodeWorkload(running, page_size, churn).plans(args.steps)
                f = measure_link(plans)
                sim = f"{measure_sim(running, plans):8.0f}" if churn == 0 else f"{'-':>8}"
                row = f"{running:>7} {page_size:>4} {churn:>5} {f.plan_bytes:>7.0f} {f.full_bytes:>7.0f}"
                print(f"{row} {f.control_us:>10.1f} {f.worker_us:>9.1f} {sim}")


if __name__ == "__main__":
    main()
