"""Executor bookkeeping: KV reports, releases, offload/restore, and plans it must refuse."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from protos.worker import KvTransfer
from tests.data_plane.factories import Extend, SlotAllocator, make_plan, new_seq

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111]


def _prefilled(make_executor, handles=(1,), host_pool_tokens: int = 0, capacity: int = 256):
    """An executor with each handle prefilled with PROMPT (one sampled token each)."""
    executor = make_executor(capacity=capacity, host_pool_tokens=host_pool_tokens)
    slots = SlotAllocator(capacity, page_size=4, seed=11)
    plan = make_plan(
        1,
        new_seqs=[new_seq(h) for h in handles],
        extends=[Extend(h, 0, PROMPT, slots.alloc(h, len(PROMPT))) for h in handles],
    )
    assert executor.execute(plan).error == ""
    return executor, slots


def test_kv_report_counts_live_sequences_and_slots(make_executor) -> None:
    executor, slots = _prefilled(make_executor, handles=(1, 2, 3))
    result = executor.execute(make_plan(2, decodes=[(1, int(slots.alloc(1, 1)[0]))], releases=[2]))
    assert result.error == ""
    assert (result.kv.live_seqs, result.kv.seq_slots) == (2, 2 * len(PROMPT) + 1)
    assert result.kv.capacity_tokens == 256
    assert result.kv.device_mem_used_bytes > 0


def test_result_order_is_sampling_extends_then_decodes(make_executor) -> None:
    """Tokens come in plan order (sampling extends, then decodes): swapping two decodes swaps their
    tokens, and the extend that samples nothing (a non-final chunk) has none."""
    results = []
    for order in ((2, 1), (1, 2)):
        executor = make_executor(capacity=256)
        slots = SlotAllocator(256, page_size=4, seed=11)
        prompts = {1: PROMPT, 2: [464, 300, 42, 17, 99, 5]}
        prefill = make_plan(
            1,
            new_seqs=[new_seq(h) for h in prompts],
            extends=[Extend(h, 0, p, slots.alloc(h, len(p))) for h, p in prompts.items()],
        )
        assert executor.execute(prefill).error == ""
        decode_slots = {h: int(slots.alloc(h, 1)[0]) for h in (1, 2)}
        plan = make_plan(
            2,
            new_seqs=[new_seq(5), new_seq(6)],
            extends=[
                Extend(5, 0, PROMPT[:3], slots.alloc(5, 3)),
                Extend(6, 0, PROMPT[:2], slots.alloc(6, 2), False),
            ],
            decodes=[(h, decode_slots[h]) for h in order],
        )
        result = executor.execute(plan)
        assert result.step_id == 2 and result.error == ""
        results.append(result.token_ids.tolist())
    (ext5, tok2, tok1), (same5, first1, then2) = results
    assert tok1 != tok2, "the two prompts were meant to give different next tokens"
    assert (ext5, tok1, tok2) == (same5, first1, then2)


def test_offload_then_restore_gives_identical_logits(make_executor) -> None:
    reference, ref_slots = _prefilled(make_executor)
    moved, _ = _prefilled(make_executor, host_pool_tokens=64)
    table = moved.table.slot_table(1)
    offloaded = moved.execute(make_plan(2, offloads=[KvTransfer(1, table)]))
    assert (offloaded.kv.live_seqs, offloaded.kv.seq_slots, offloaded.kv.host_seqs) == (0, 0, 1)
    # Overwrite the old slots with another sequence before restoring somewhere else.
    other = make_plan(3, new_seqs=[new_seq(9)], extends=[Extend(9, 0, PROMPT[::-1], table)])
    assert moved.execute(other).error == ""
    new_slots = np.arange(200, 200 + len(table), dtype=np.int64)
    restored = moved.execute(make_plan(4, restores=[KvTransfer(1, new_slots)]))
    assert (restored.kv.host_seqs, restored.kv.live_seqs) == (0, 2)
    ours = moved.forward_logits(make_plan(5, decodes=[(1, 250)]))
    expected = reference.forward_logits(make_plan(5, decodes=[(1, int(ref_slots.alloc(1, 1)[0]))]))
    assert torch.equal(ours, expected)


def test_offload_without_host_pool_is_an_error(make_executor) -> None:
    executor, _ = _prefilled(make_executor)
    result = executor.execute(make_plan(2, offloads=[KvTransfer(1, executor.table.slot_table(1))]))
    assert "host pool full" in result.error


@pytest.mark.parametrize(
    ("plan_kwargs", "message"),
    [
        ({"decodes": [(42, 3)]}, "unknown handle 42"),
        ({"extends": [Extend(1, 3, [1, 2], np.array([100, 101]))]}, "starts at 3, worker holds 10"),
        ({"decodes": [(1, 9999)]}, "out of range"),
        ({"releases": [77]}, "unknown handle 77"),
        ({"new_seqs": [new_seq(1)]}, "already live"),
    ],
)
def test_inconsistent_plans_are_answered_with_an_error(make_executor, plan_kwargs, message) -> None:
    executor, _ = _prefilled(make_executor)
    result = executor.execute(make_plan(7, **plan_kwargs))
    assert result.step_id == 7
    assert message in result.error
    assert len(result.token_ids) == 0


def test_decode_before_first_token_is_refused(make_executor) -> None:
    executor = make_executor(capacity=64)
    plan = make_plan(
        1,
        new_seqs=[new_seq(1)],
        extends=[Extend(1, 0, PROMPT[:4], np.arange(4, dtype=np.int64), sample=False)],
    )
    assert executor.execute(plan).error == ""
    assert "before any token" in executor.execute(make_plan(2, decodes=[(1, 10)])).error


def test_released_slots_may_be_reused_by_the_same_plan(make_executor) -> None:
    executor, _ = _prefilled(make_executor)
    old = executor.table.slot_table(1)
    plan = make_plan(2, releases=[1], new_seqs=[new_seq(1)], extends=[Extend(1, 0, PROMPT, old)])
    result = executor.execute(plan)
    assert result.error == ""
    assert (result.kv.live_seqs, result.kv.seq_slots) == (1, len(PROMPT))


def test_a_reset_plan_forgets_every_sequence_first(make_executor) -> None:
    """After a fault of its own the control plane starts over: handles and slots are reused at once."""
    executor, _ = _prefilled(make_executor, handles=(1, 2), host_pool_tokens=64)
    offload = make_plan(2, offloads=[KvTransfer(2, executor.table.slot_table(2).copy())])
    assert executor.execute(offload).error == ""
    slots = SlotAllocator(256, page_size=4, seed=3)
    fresh = make_plan(1, new_seqs=[new_seq(1)], extends=[Extend(1, 0, PROMPT, slots.alloc(1, len(PROMPT)))])
    assert "already live" in executor.execute(fresh).error  # without reset the handle is taken
    result = executor.execute(dataclasses.replace(fresh, reset=True))
    assert result.error == ""
    assert (result.kv.live_seqs, result.kv.host_seqs, result.kv.seq_slots) == (1, 0, len(PROMPT))
