"""The sim backend: a worker without a model, for scale tests, benchmarks and `stepwise simulate`.

It is a simulator, not an inference engine. It keeps the per-sequence state a real worker keeps
(each sequence's length from the plan deltas, so its KV report is real) and answers every plan with
deterministic tokens: the token at position p of a request is a hash of (seed, request id, p), and
the request's output token number `sim_output_len` (from the plan, or a seeded rule) is EOS. Tokens
depend on the request id and position only, so batching, chunking and retraction never change a
request's output; a sequence decoded past its EOS (the control plane learns of a finish a step late
under overlap) simply gets more tokens. Step time follows a cost model (CostModel),
`a + b·(new tokens) + c·(Σ context of the batch) + d·(decode rows)` seconds.

KV moves (prefill/decode workers, migration) go over a real transfer link when the worker serves one:
a send carries zeros of the K/V shape the model's config.json gives (`kv_shape`, in float16), so its
bytes on the wire are a real worker's; a receive checks the transfer's length against its slots and
drops it. The tokens after a move are the same as without it (they depend on the request id and
position only).

A step costs a few vectorised numpy operations whatever the batch size: sequences are rows of
arrays, found by one binary search per step, and the KV report is kept up to date incrementally.

Logprobs: the sim's "model" puts all probability on the token it picks. So when a sequence of the
step asks (SamplerParams.logprobs > 0), every sampled token gets an entry: its logprob is 0.0, its
alternatives are just that token (one, at 0.0, when logprobs >= 2: every other token has
probability 0), and its token_ids_logprob report 0.0 for that token and -inf for any other; a
sequence that did not ask gets the logprob alone. Processed and raw logprobs are the same here.
Prompt scoring (ExtendWork.score_*, checked as the real worker checks it) follows the same
convention with the next prompt token as the pick: each scored row reports 0.0 for the token that
follows it (next_ids for an extend's last row), that token as its one alternative, and 0.0/-inf for
token_ids_logprob.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from data_plane.scoring import score_rows
from data_plane.state import PlanError
from flagtypes.cost import linear_cost
from protos.arrays import SortedIndex
from protos.worker import (
    KvReport,
    PromptScores,
    SamplerParams,
    StepPlan,
    StepResult,
    TokenLogprobs,
    TransferOutcome,
)

if TYPE_CHECKING:
    from data_plane.kv_transfer import Transfers

# Seeded rule for requests without an output length: between 16 and 271 tokens.
RULE_MIN_OUTPUT, RULE_SPAN = 16, 256
TOKEN_FLOOR = 3  # never emit the low ids that tokenizers reserve for special tokens
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1
_GOLDEN_INT, _MIX1_INT, _MIX2_INT = int(_GOLDEN), int(_MIX1), int(_MIX2)
_INITIAL_ROWS = 64
# Up to this many handles a step finds their rows by dict, beyond by a sorted index.
_FEW_ROWS = 64


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per step: a + b·new_tokens + c·context_tokens + d·decode_rows.

    new_tokens counts every token computed (prefill tokens and one per decode row), so `d` is what a
    decode row costs beyond a prefill token: 0 by default (the three-term model), negative when a
    row is cheaper (b + d >= 0 keeps it from costing less than nothing)."""

    a: float = 0.005
    b: float = 5e-5
    c: float = 5e-7
    d: float = 0.0

    @classmethod
    def parse(cls, text: str, flag: str = "--sim-cost") -> CostModel:
        """'a,b,c' or 'a,b,c,d' (seconds, flagtypes.cost); ValueError naming the flag when malformed."""
        try:
            return cls(*linear_cost(text))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{flag}: {exc}") from None

    def step_seconds(self, new_tokens: int, context_tokens: int, decode_rows: int = 0) -> float:
        return self.a + self.b * new_tokens + self.c * context_tokens + self.d * decode_rows

    def spec(self) -> str:
        """The 'a,b,c,d' text `parse` reads back to this model."""
        return ",".join(repr(x) for x in (self.a, self.b, self.c, self.d))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread uint64 hash of each uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    """`_mix` of one uint64 held in a Python int."""
    x ^= x >> 30
    x = (x * _MIX1_INT) & _MASK
    x ^= x >> 27
    x = (x * _MIX2_INT) & _MASK
    return x ^ (x >> 31)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class _SimTable:
    """The sim's sequences as rows of arrays, with the KV report's totals kept incrementally."""

    def __init__(self) -> None:
        self.row_of: dict[int, int] = {}
        self._free: list[int] = []
        self.handle = np.zeros(0, dtype=np.int64)
        self.key = np.zeros(0, dtype=np.uint64)
        self.length = np.zeros(0, dtype=np.int64)
        self.prompt_len = np.zeros(0, dtype=np.int64)
        self.output_len = np.zeros(0, dtype=np.int64)
        self.live = np.zeros(0, dtype=bool)
        # SamplerParams.logprobs of each row, and the token_ids_logprob of the rows that ask.
        self.logprobs = np.zeros(0, dtype=np.int64)
        self.logprob_ids: dict[int, tuple[int, ...]] = {}
        self.asking = 0  # live rows with logprobs > 0: none, and a step never looks
        self.offloaded: set[int] = set()
        self.seq_slots = 0
        self._index: tuple[SortedIndex, np.ndarray] | None = None
        self._grow(_INITIAL_ROWS)

    def add(
        self, handle: int, key: int, prompt_len: int, output_len: int, length: int, sampler: SamplerParams
    ) -> None:
        if handle in self.row_of:
            raise ValueError(f"handle {handle} is already live")
        if not self._free:
            self._grow(len(self.length))
        row = self.row_of[handle] = self._free.pop()
        self.handle[row], self.key[row] = handle, key
        self.prompt_len[row], self.output_len[row], self.length[row] = prompt_len, output_len, length
        self.live[row] = True
        self.logprobs[row] = max(0, sampler.logprobs)
        if sampler.logprobs > 0:
            self.asking += 1
            self.logprob_ids[row] = sampler.token_ids_logprob
        self.seq_slots += length
        self._index = None

    def remove(self, handle: int) -> None:
        row = self.row_of.pop(handle)  # KeyError: not live
        if handle in self.offloaded:
            self.offloaded.discard(handle)
        else:
            self.seq_slots -= int(self.length[row])
        self.live[row] = False
        if self.logprobs[row] > 0:
            self.asking -= 1
            self.logprobs[row] = 0
            self.logprob_ids.pop(row, None)
        self._free.append(row)
        self._index = None

    def offload(self, handle: int) -> None:
        row = self.row_of[handle]
        if handle not in self.offloaded:
            self.offloaded.add(handle)
            self.seq_slots -= int(self.length[row])

    def restore(self, handle: int, length: int) -> None:
        """The host copy comes back as the sequence's first `length` positions (an offload names
        only committed KV: under overlap, one position fewer than the table held)."""
        self.offloaded.remove(handle)  # KeyError: nothing to restore
        self.length[self.row_of[handle]] = length
        self.seq_slots += length

    def rows(self, handles: np.ndarray) -> np.ndarray:
        """Rows of `handles`; KeyError naming the first that is not live."""
        if len(handles) <= _FEW_ROWS:  # a dict beats building and searching an index
            row_of = self.row_of
            return np.array([row_of[h] for h in handles.tolist()], dtype=np.int64)
        if self._index is None:
            live = np.flatnonzero(self.live)
            self._index = (SortedIndex(self.handle[live]), live)
        index, live = self._index
        at = index.positions(handles)
        if len(at) and int(at.min()) < 0:
            raise KeyError(int(handles[int(np.argmin(at))]))
        return live[at]

    def advance(self, rows: np.ndarray, counts: np.ndarray | int) -> None:
        """The sequences in `rows` (distinct) hold `counts` more tokens each."""
        self.length[rows] += counts
        self.seq_slots += int(counts.sum()) if isinstance(counts, np.ndarray) else counts * len(rows)

    def _grow(self, extra: int) -> None:
        old = len(self.length)
        for name in ("handle", "key", "length", "prompt_len", "output_len", "live", "logprobs"):
            array = getattr(self, name)
            setattr(self, name, np.concatenate((array, np.zeros(extra, dtype=array.dtype))))
        self._free.extend(range(old + extra - 1, old - 1, -1))


@dataclass(slots=True)
class SimExecutor:
    """Executes plans without a model. `sleep=True` makes each step take its modelled time, its own
    bookkeeping included (so a step's length is the model's, as a device's forward would be)."""

    capacity: int
    vocab_size: int
    eos_token_id: int
    cost: CostModel = field(default_factory=CostModel)
    seed: int = 0
    sleep: bool = False
    # (layers, KV heads, head dim) of the model a send's zeros stand for.
    kv_shape: tuple[int, int, int] = (1, 1, 1)
    table: _SimTable = field(default_factory=_SimTable, init=False)
    # The transfer link (set by the worker when it serves one).
    transfers: Transfers | None = field(default=None, init=False)

    def runs_inline(self, plan: StepPlan) -> bool:
        """A step that only computes runs on the loop; one that sleeps its modelled time must not."""
        return not self.sleep

    def execute(self, plan: StepPlan) -> StepResult:
        try:
            return self._execute(plan)
        except (KeyError, ValueError, PlanError) as exc:
            return StepResult(
                plan.step_id,
                np.zeros(0, np.int32),
                kv=self.kv_report(),
                error=f"sim: {exc!r}",
                transfers=self._outcomes(),
            )

    def _execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        self._apply_deltas(plan)
        ext, dec = plan.extends, plan.decodes
        table = self.table
        if len(ext.handles) or len(ext.score_lens) or len(ext.score_starts) or len(ext.next_ids):
            ext_rows = self._extend_rows(plan)
            dec_rows = table.rows(dec.handles)
            scoring = score_rows(ext)
            table.advance(ext_rows, ext.lens)
            table.advance(dec_rows, 1)
            sampled_rows = np.concatenate((ext_rows[ext.sample.astype(bool)], dec_rows))
            new_tokens = int(ext.lens.sum()) + len(dec_rows)
            context = int(table.length[ext_rows].sum() + table.length[dec_rows].sum())
        else:  # a decode step (most steps): no extend columns to read
            dec_rows = sampled_rows = table.rows(dec.handles)
            scoring = None
            table.advance(dec_rows, 1)
            new_tokens = len(dec_rows)
            context = int(table.length[dec_rows].sum())
        tokens = self._tokens(sampled_rows)
        logprobs: tuple[TokenLogprobs, ...] = ()
        if self.table.asking and int(self.table.logprobs[sampled_rows].max(initial=0)) > 0:
            logprobs = tuple(self._certain(int(r), int(t)) for r, t in zip(sampled_rows, tokens, strict=True))
        scores: tuple[PromptScores, ...] = ()
        if scoring is not None:
            targets = iter(scoring.targets.tolist())
            scores = tuple(
                PromptScores(
                    entry, tuple(self._certain(int(ext_rows[entry]), next(targets)) for _ in range(count))
                )
                for entry, count in zip(scoring.entries.tolist(), scoring.counts.tolist(), strict=True)
            )
        seconds = self.cost.step_seconds(new_tokens, context, len(dec_rows))
        if self.sleep:
            time.sleep(max(seconds - (time.perf_counter() - started), 0.0))
        return StepResult(
            plan.step_id,
            tokens,
            logprobs,
            scores,
            kv=self.kv_report(),
            forward_s=seconds,
            transfers=self._outcomes(),
        )

    def _outcomes(self) -> tuple[TransferOutcome, ...]:
        return self.transfers.take_outcomes() if self.transfers is not None else ()

    def _move_kv(self, plan: StepPlan) -> None:
        """A plan's sends (zeros of the model's K/V shape) and receives (checked, then dropped)."""
        if not (plan.sends or plan.receives):
            return
        if self.transfers is None:
            raise PlanError("this sim worker serves no KV transfer link: it cannot send or receive KV")
        # torch only here: `stepwise simulate` never sends, and importing it costs a second of CPU.
        import torch

        from data_plane.kv_pool import HostCopy

        layers, heads, dim = self.kv_shape
        for send in plan.sends:
            zeros = torch.zeros((layers, len(send.slots), heads, dim), dtype=torch.float16)
            self.transfers.send(send.address, send.transfer_id, HostCopy(zeros, zeros))
        store = self.transfers.received
        for receive in plan.receives:
            if not len(receive.slots):
                store.discard(receive.transfer_id)
                continue
            try:
                copy = store.take(receive.transfer_id)
            except KeyError:
                raise PlanError(f"receives: no transfer {receive.transfer_id!r} has arrived") from None
            if copy.k.shape[1] != receive.skip + len(receive.slots):
                raise PlanError(
                    f"receives: transfer {receive.transfer_id!r} holds {copy.k.shape[1]} positions, "
                    f"the plan's slots take {receive.skip + len(receive.slots)}"
                )

    def _certain(self, row: int, token: int) -> TokenLogprobs:
        """A position whose whole probability is on `token` (see the module docstring)."""
        n = int(self.table.logprobs[row])
        ids = self.table.logprob_ids.get(row, ()) if n > 0 else ()
        alternatives = (token,) if n >= 2 else ()
        return TokenLogprobs(
            logprob=0.0,
            top_ids=alternatives,
            top_logprobs=(0.0,) * len(alternatives),
            ids_logprobs=tuple(0.0 if i == token else -math.inf for i in ids),
        )

    def _extend_rows(self, plan: StepPlan) -> np.ndarray:
        """Rows of the extends; ValueError unless each starts where its sequence ends."""
        ext = plan.extends
        rows = self.table.rows(ext.handles)
        stale = np.flatnonzero(self.table.length[rows] != ext.starts)
        if len(stale):
            i = int(stale[0])
            have = int(self.table.length[rows[i]])
            raise ValueError(f"extend of {ext.handles[i]} starts at {ext.starts[i]}, sequence has {have}")
        return rows

    def reset(self) -> None:
        """Forget every sequence (a plan's `reset`, and every new session)."""
        self.table = _SimTable()

    def _apply_deltas(self, plan: StepPlan) -> None:
        self._move_kv(plan)
        if plan.reset:
            self.reset()
        for handle in plan.releases.tolist():
            self.table.remove(handle)
        for t in plan.offloads:
            self.table.offload(t.handle)
        for t in plan.restores:
            self.table.restore(t.handle, len(t.slots))
        for new in plan.new_seqs:
            output_len = new.sim_output_len or self._rule(new.request_id)
            key = _digest(f"{self.seed}/{new.request_id}")
            self.table.add(new.handle, key, new.prompt_len, output_len, len(new.prefix_slots), new.sampler)

    def _tokens(self, rows: np.ndarray) -> np.ndarray:
        """The token at each row's next position: hashed, or EOS at its output length."""
        if len(rows) <= _FEW_ROWS:
            return self._few_tokens(rows)
        return self._many_tokens(rows)

    def _many_tokens(self, rows: np.ndarray) -> np.ndarray:
        table = self.table
        position = table.length[rows]
        hashed = _mix(table.key[rows] + position.astype(np.uint64) * _GOLDEN)
        span = np.uint64(self.vocab_size - TOKEN_FLOOR)
        tokens = (hashed % span).astype(np.int32) + TOKEN_FLOOR
        tokens[tokens == self.eos_token_id] = TOKEN_FLOOR
        tokens[position - table.prompt_len[rows] == table.output_len[rows]] = self.eos_token_id
        return tokens

    def _few_tokens(self, rows: np.ndarray) -> np.ndarray:
        """`_tokens` in plain ints (the same tokens): a dozen numpy calls cost more on a few rows."""
        table, eos, span = self.table, self.eos_token_id, self.vocab_size - TOKEN_FLOOR
        keys, positions = table.key[rows].tolist(), table.length[rows].tolist()
        ends = (table.prompt_len[rows] + table.output_len[rows]).tolist()
        out = []
        for key, position, end in zip(keys, positions, ends, strict=True):
            if position == end:
                out.append(eos)
                continue
            token = _mix_int((key + position * _GOLDEN_INT) & _MASK) % span + TOKEN_FLOOR
            out.append(TOKEN_FLOOR if token == eos else token)
        return np.array(out, dtype=np.int32)

    def _rule(self, request_id: str) -> int:
        return RULE_MIN_OUTPUT + _digest(f"{self.seed}/len/{request_id}") % RULE_SPAN

    def kv_report(self) -> KvReport:
        table = self.table
        return KvReport(
            live_seqs=len(table.row_of) - len(table.offloaded),
            seq_slots=table.seq_slots,
            capacity_tokens=self.capacity,
            device_mem_used_bytes=0,
            host_seqs=len(table.offloaded),
        )
