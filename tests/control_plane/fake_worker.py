"""A worker stand-in that checks the control plane's slot bookkeeping as it runs plans.

It keeps a "KV pool" where each slot holds the (token, position) written to it, and a slot table per
sequence, exactly as a real worker would. Every forward reads each sequence's whole context back
through its slot table and fails loudly if any slot holds the wrong token or position: a slot
freed while still referenced, a wrong prefix, or a bad remap shows up at once. The next token is a
hash of the context read back, so outputs depend only on the sequence's content: batching, chunking,
retraction and overlap must not change them.

Plans run in the order they are given, the moment `run` is called, as a real worker runs the plans of
one stream: a test may run plan N+1 before it hands plan N's result to the scheduler (overlap
scheduling, docs/scheduler.md#overlap), and every read still checks what the earlier plans wrote.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from protos.worker import KvReport, PromptScores, StepPlan, StepResult, TokenLogprobs, TransferOutcome


class KvCorruption(AssertionError):
    pass


@dataclass
class _Seq:
    slots: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    last: int = -1
    logprobs: bool = False


def next_token(context: list[int], vocab: int, eos: int | None, eos_every: int) -> int:
    """Deterministic in the context alone; EOS after roughly every `eos_every` tokens if given."""
    digest = hashlib.blake2b(np.asarray(context, dtype=np.int64).tobytes(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    if eos is not None and eos_every > 0 and value % eos_every == 0:
        return eos
    token = value % vocab
    return token if token != eos else (token + 1) % vocab


class FakeWorker:
    """`network`: where KvSends go and KvReceives come from (transfer id -> the (token, position)
    contents of the sent slots, in order); workers that share one can move KV between them."""

    def __init__(
        self,
        capacity: int,
        vocab: int = 1000,
        eos: int | None = None,
        eos_every: int = 0,
        network: dict[str, list[tuple[int, int]]] | None = None,
    ) -> None:
        self.network = network if network is not None else {}
        self.capacity = capacity
        self.vocab = vocab
        self.eos = eos
        self.eos_every = eos_every
        self.pool: dict[int, tuple[int, int]] = {}
        self.seqs: dict[int, _Seq] = {}
        # Host backup pool: handle -> the (token, position) contents of its slots, in order.
        self.host: dict[int, list[tuple[int, int]]] = {}
        self.offloads = self.restores = 0

    def run(self, plan: StepPlan) -> StepResult:
        for send in plan.sends:  # before the releases: the plan may reuse the slots it sends
            self.network[send.transfer_id] = [self.pool[s] for s in send.slots.tolist()]
        if plan.reset:
            self.seqs.clear()
            self.host.clear()
        for handle in plan.releases.tolist():
            del self.seqs[handle]
            self.host.pop(handle, None)
        for remap in plan.remaps:
            seq = self.seqs[remap.handle]
            for i, slot in enumerate(remap.slots.tolist()):
                seq.slots[remap.start + i] = slot
        self._offload_and_restore(plan)
        for receive in plan.receives:
            if not len(receive.slots):
                self.network.pop(receive.transfer_id, None)
                continue
            sent = self.network.pop(receive.transfer_id)
            assert len(sent) == receive.skip + len(receive.slots), "a receive names the wrong slot count"
            for slot, content in zip(receive.slots.tolist(), sent[receive.skip :], strict=True):
                self.pool[slot] = content
        for new in plan.new_seqs:
            assert new.handle not in self.seqs, f"handle {new.handle} introduced twice"
            self.seqs[new.handle] = _Seq(slots=new.prefix_slots.tolist(), logprobs=new.sampler.logprobs > 0)
        tokens: list[int] = []
        scores: list[TokenLogprobs] = []
        prompt_scores: list[PromptScores] = []
        self._extends(plan, tokens, scores, prompt_scores)
        self._decodes(plan, tokens, scores)
        # Sends arrive at once: this very result says so (16 bytes a token, a made-up size).
        transfers = tuple(TransferOutcome(s.transfer_id, "", 16 * len(s.slots)) for s in plan.sends)
        return StepResult(
            step_id=plan.step_id,
            token_ids=np.asarray(tokens, dtype=np.int32),
            logprobs=tuple(scores) if any(s.logprobs for s in self.seqs.values()) else (),
            prompt_scores=tuple(prompt_scores),
            kv=KvReport(
                live_seqs=len(self.seqs) - len(self.host),
                seq_slots=sum(len(s.slots) for s in self.seqs.values()),
                capacity_tokens=self.capacity,
                host_seqs=len(self.host),
            ),
            transfers=transfers,
        )

    def _offload_and_restore(self, plan: StepPlan) -> None:
        for t in plan.offloads:
            seq = self.seqs[t.handle]
            # The committed positions only: under overlap the table also holds the position a decode
            # still in flight wrote, whose token the scheduler discards (docs/scheduler.md#overlap).
            kept = len(t.slots)
            assert t.slots.tolist() == seq.slots[:kept], f"offload of {t.handle}: not its table's first slots"
            self._read_context(t.handle)
            self.host[t.handle] = [self.pool[s] for s in seq.slots[:kept]]
            seq.slots = []
            self.offloads += 1
        for t in plan.restores:
            saved = self.host.pop(t.handle)
            assert len(saved) == len(t.slots), "restore names a different number of slots"
            for slot, content in zip(t.slots.tolist(), saved, strict=True):
                self.pool[slot] = content
            self.seqs[t.handle].slots = t.slots.tolist()
            self.restores += 1

    def _write(self, seq: _Seq, slot: int, token: int, pos: int) -> None:
        assert 0 <= slot < self.capacity, f"slot {slot} outside the pool"
        assert len(seq.slots) == pos, f"write at position {pos} but the table holds {len(seq.slots)}"
        self.pool[slot] = (token, pos)
        seq.slots.append(slot)

    def _read_context(self, handle: int) -> list[int]:
        seq = self.seqs[handle]
        context = []
        for pos, slot in enumerate(seq.slots):
            token, written_pos = self.pool.get(slot, (-1, -1))
            if written_pos != pos:
                raise KvCorruption(
                    f"handle {handle}: slot {slot} holds position {written_pos}, expected {pos}"
                )
            context.append(token)
        return context

    def _extends(
        self,
        plan: StepPlan,
        tokens: list[int],
        scores: list[TokenLogprobs],
        prompt_scores: list[PromptScores],
    ) -> None:
        """Prompt rows and sampled-token scores are labels, not numbers a model would give: a row
        says the position it scored and the token after it (`logprob` = position, `top_ids` =
        (token,)), read back through the sequence's slots, so tests see exactly what was scored."""
        ext = plan.extends
        offset = 0
        for i, handle in enumerate(ext.handles.tolist()):
            seq = self.seqs[handle]
            start, n = int(ext.starts[i]), int(ext.lens[i])
            assert start == len(seq.slots), (
                f"extend of {handle} starts at {start}, table has {len(seq.slots)}"
            )
            for j in range(n):
                self._write(seq, int(ext.slots[offset + j]), int(ext.token_ids[offset + j]), start + j)
            offset += n
            if len(ext.score_lens) and ext.score_lens[i]:
                first, count = int(ext.score_starts[i]), int(ext.score_lens[i])
                assert start <= first and first + count <= start + n, f"entry {i} scores outside its extend"
                context = self._read_context(handle)
                following = [*context, int(ext.next_ids[i])]
                assert following[-1] >= 0 or first + count < start + n, "a row at the end has no next token"
                rows = tuple(
                    TokenLogprobs(float(p), (following[p + 1],)) for p in range(first, first + count)
                )
                prompt_scores.append(PromptScores(i, rows))
            if ext.sample[i]:
                context = self._read_context(handle)
                token = next_token(context, self.vocab, self.eos, self.eos_every)
                seq.last = token
                tokens.append(token)
                scores.append(TokenLogprobs(float(len(context)), (token,)))

    def _decodes(self, plan: StepPlan, tokens: list[int], scores: list[TokenLogprobs]) -> None:
        dec = plan.decodes
        for handle, slot in zip(dec.handles.tolist(), dec.slots.tolist(), strict=True):
            seq = self.seqs[handle]
            assert seq.last >= 0, f"decode of {handle} before any sampled token"
            self._write(seq, slot, seq.last, len(seq.slots))
            context = self._read_context(handle)
            token = next_token(context, self.vocab, self.eos, self.eos_every)
            seq.last = token
            tokens.append(token)
            scores.append(TokenLogprobs(float(len(context)), (token,)))
