"""The sim backend: a worker without a model, for scale tests and `stepwise simulate`.

It is a simulator, not an inference engine. It keeps the same per-sequence state a real worker
keeps (slot tables from plan deltas, so its KV report is real) and answers every plan with
deterministic tokens: token i of a request is a hash of (seed, request id, position), and the
request emits EOS once it has produced its output length (`sim_output_len` from the plan, or a
seeded rule). Because tokens depend on the request id and position only, batching, chunking and
retraction never change a request's output. Step time follows a cost model,
`a + b·(new tokens) + c·(Σ context of the batch)` seconds.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np

from data_plane.messages import KvReport, StepPlan, StepResult

# Seeded rule for requests without an output length: between 16 and 271 tokens.
RULE_MIN_OUTPUT, RULE_SPAN = 16, 256
TOKEN_FLOOR = 3  # never emit the low ids that tokenizers reserve for special tokens


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per step: a + b·new_tokens + c·context_tokens."""

    a: float = 0.005
    b: float = 5e-5
    c: float = 5e-7

    @classmethod
    def parse(cls, text: str) -> CostModel:
        """'a,b,c' (seconds); ValueError naming the flag when malformed."""
        try:
            a, b, c = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"--sim-cost wants 'a,b,c' in seconds, got {text!r}") from None
        if min(a, b, c) < 0:
            raise ValueError(f"--sim-cost values must be >= 0, got {text!r}")
        return cls(a, b, c)

    def step_seconds(self, new_tokens: int, context_tokens: int) -> float:
        return self.a + self.b * new_tokens + self.c * context_tokens


@dataclass(slots=True)
class _SimSeq:
    request_id: str
    prompt_len: int
    output_len: int
    length: int = 0
    sampled: bool = False


@dataclass(slots=True)
class SimExecutor:
    """Executes plans without a model. `sleep=True` makes each step take its modelled time."""

    capacity: int
    vocab_size: int
    eos_token_id: int
    cost: CostModel = field(default_factory=CostModel)
    seed: int = 0
    sleep: bool = False
    seqs: dict[int, _SimSeq] = field(default_factory=dict)
    offloaded: dict[int, int] = field(default_factory=dict)

    def execute(self, plan: StepPlan) -> StepResult:
        try:
            return self._execute(plan)
        except (KeyError, ValueError) as exc:
            empty = np.zeros(0, dtype=np.int64)
            return StepResult(
                plan.step_id, empty.astype(np.uint64), empty, self.kv_report(), error=f"sim: {exc!r}"
            )

    def _execute(self, plan: StepPlan) -> StepResult:
        if plan.reset:
            self.seqs.clear()
            self.offloaded.clear()
        for handle in plan.release_handles.tolist():
            del self.seqs[handle]
            self.offloaded.pop(handle, None)
        for t in plan.offloads:
            self.offloaded[t.handle] = self.seqs[t.handle].length
        for t in plan.restores:
            self.offloaded.pop(t.handle)
        for new in plan.new_seqs:
            if new.handle in self.seqs:
                raise ValueError(f"handle {new.handle} is already live")
            self.seqs[new.handle] = _SimSeq(
                new.request_id,
                new.prompt_len,
                new.sim_output_len or self._rule(new.request_id),
                length=len(new.prefix_slots),
            )
        handles = self._extend(plan)
        tokens = [self._sample(self.seqs[h]) for h in handles]
        for handle in plan.decodes.handles.tolist():
            seq = self.seqs[handle]
            seq.length += 1
            handles.append(handle)
            tokens.append(self._sample(seq))
        seconds = self.step_seconds(plan)
        if self.sleep:
            time.sleep(seconds)
        return StepResult(
            step_id=plan.step_id,
            handles=np.asarray(handles, dtype=np.uint64),
            token_ids=np.asarray(tokens, dtype=np.int64),
            kv=self.kv_report(),
            forward_s=seconds,
        )

    def _extend(self, plan: StepPlan) -> list[int]:
        ext = plan.extends
        sampled = []
        for i, handle in enumerate(ext.handles.tolist()):
            seq = self.seqs[handle]
            if int(ext.starts[i]) != seq.length:
                raise ValueError(
                    f"extend of {handle} starts at {int(ext.starts[i])}, sequence has {seq.length}"
                )
            seq.length += int(ext.lens[i])
            if ext.sample[i]:
                sampled.append(handle)
        return sampled

    def _sample(self, seq: _SimSeq) -> int:
        """The token at position `seq.length` (the next one) of this request."""
        position = seq.length
        if position - seq.prompt_len >= seq.output_len:
            return self.eos_token_id
        digest = hashlib.blake2b(f"{self.seed}/{seq.request_id}/{position}".encode(), digest_size=8).digest()
        token = TOKEN_FLOOR + int.from_bytes(digest, "little") % (self.vocab_size - TOKEN_FLOOR)
        return token if token != self.eos_token_id else TOKEN_FLOOR

    def _rule(self, request_id: str) -> int:
        digest = hashlib.blake2b(f"{self.seed}/len/{request_id}".encode(), digest_size=8).digest()
        return RULE_MIN_OUTPUT + int.from_bytes(digest, "little") % RULE_SPAN

    def step_seconds(self, plan: StepPlan) -> float:
        new_tokens = int(plan.extends.lens.sum()) + len(plan.decodes.handles)
        handles = np.concatenate((plan.extends.handles, plan.decodes.handles)).tolist()
        context = sum(self.seqs[h].length for h in handles if h in self.seqs)
        return self.cost.step_seconds(new_tokens, context)

    def kv_report(self) -> KvReport:
        live = [s for h, s in self.seqs.items() if h not in self.offloaded]
        return KvReport(
            live_seqs=len(live),
            seq_slots=sum(s.length for s in live),
            capacity_tokens=self.capacity,
            device_mem_used_bytes=0,
            host_seqs=len(self.offloaded),
        )
