"""The sim backend: deterministic tokens per (request, position), EOS after the output length."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from data_plane.sim import CostModel, SimExecutor
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


def _new(handle: int, rid: str, prompt_len: int, output_len: int) -> NewSeq:
    return NewSeq(handle, SamplerParams(), request_id=rid, prompt_len=prompt_len, sim_output_len=output_len)


def _prefill(step: int, seqs: list[tuple[int, str, int, int]]) -> StepPlan:
    lens = np.asarray([s[2] for s in seqs], dtype=np.int64)
    return StepPlan(
        step,
        StepKind.PREFILL,
        new_seqs=tuple(_new(*s) for s in seqs),
        extends=ExtendWork(
            handles=np.asarray([s[0] for s in seqs], dtype=np.int64),
            starts=np.zeros(len(seqs), dtype=np.int64),
            lens=lens,
            sample=np.ones(len(seqs), dtype=bool),
            token_ids=np.ones(int(lens.sum()), dtype=np.int64),
            slots=np.arange(int(lens.sum()), dtype=np.int64),
        ),
    )


def _decode(step: int, handles: list[int], first_slot: int) -> StepPlan:
    return StepPlan(
        step,
        StepKind.DECODE,
        decodes=DecodeWork(
            handles=np.asarray(handles, dtype=np.int64),
            slots=np.arange(first_slot, first_slot + len(handles), dtype=np.int64),
        ),
    )


def _run(executor: SimExecutor, seqs: list[tuple[int, str, int, int]], steps: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {s[0]: [] for s in seqs}
    plans = [_prefill(1, seqs)]
    plans += [_decode(step + 2, [s[0] for s in seqs], 1000 + step * 10) for step in range(steps)]
    for plan in plans:
        result = executor.execute(plan)
        assert not result.error, result.error
        for h, t in zip(sampled_handles(plan).tolist(), result.token_ids.tolist(), strict=True):
            out[h].append(t)
    return out


def test_tokens_depend_on_request_and_position_not_on_the_batch() -> None:
    alone = _run(SimExecutor(4096, 1000, 0), [(1, "a", 5, 100)], 6)[1]
    batched = _run(SimExecutor(4096, 1000, 0), [(7, "b", 3, 100), (9, "a", 5, 100)], 6)[9]
    assert alone == batched
    assert 0 not in alone


def test_eos_after_the_output_length() -> None:
    tokens = _run(SimExecutor(4096, 1000, eos_token_id=0), [(1, "a", 4, 3)], 5)[1]
    assert 0 not in tokens[:3]
    assert tokens[3] == 0


def test_decodes_past_eos_keep_producing_tokens() -> None:
    """Under overlap the control plane learns of a finish a step late and decodes once more."""
    tokens = _run(SimExecutor(4096, 1000, eos_token_id=0), [(1, "a", 4, 2)], 8)[1]
    assert tokens[2] == 0
    assert len(tokens) == 9 and 0 not in tokens[3:]
    assert all(3 <= t < 1000 for t in tokens[3:])


def test_tokens_depend_on_the_seed() -> None:
    seqs = [(1, "a", 5, 100)]
    one, two = (_run(SimExecutor(4096, 1000, 0, seed=seed), seqs, 6) for seed in (1, 2))
    assert one != two


def test_kv_report_tracks_slot_tables() -> None:
    executor = SimExecutor(4096, 1000, 0)
    executor.execute(_prefill(1, [(1, "a", 4, 10), (2, "b", 6, 10)]))
    result = executor.execute(_decode(2, [1, 2], 100))
    assert (result.kv.live_seqs, result.kv.seq_slots) == (2, 12)
    result = executor.execute(StepPlan(3, StepKind.DECODE, releases=np.asarray([1], dtype=np.int64)))
    assert (result.kv.live_seqs, result.kv.seq_slots) == (1, 7)
    moved = KvTransfer(2, np.arange(7, dtype=np.int64))
    result = executor.execute(StepPlan(4, StepKind.DECODE, offloads=(moved,)))
    assert (result.kv.live_seqs, result.kv.seq_slots, result.kv.host_seqs) == (0, 0, 1)
    result = executor.execute(StepPlan(5, StepKind.DECODE, restores=(moved,)))
    assert (result.kv.live_seqs, result.kv.seq_slots, result.kv.host_seqs) == (1, 7, 0)
    result = executor.execute(
        StepPlan(6, StepKind.DECODE, offloads=(moved,), releases=np.asarray([2], np.int64))
    )
    assert "2" in result.error  # released before the offload: nothing left to offload


def test_cost_model() -> None:
    cost = CostModel.parse("0.01,0.001,0.0001")
    assert cost.step_seconds(10, 100) == pytest.approx(0.01 + 0.01 + 0.01)
    with pytest.raises(ValueError, match="--sim-cost"):
        CostModel.parse("1,2")


def test_cost_model_decode_row_term() -> None:
    """The fourth term prices a decode row beyond a prefill token; three terms mean d = 0, and a
    model's spec reads back to itself."""
    assert CostModel.parse("0.01,0.001,0.0001") == CostModel.parse("0.01,0.001,0.0001,0")
    cost = CostModel.parse("0.01,0.001,0.0001,-0.0005")
    assert cost.step_seconds(10, 100, decode_rows=4) == pytest.approx(0.01 + 0.01 + 0.01 - 0.002)
    assert CostModel.parse(cost.spec()) == cost
    for bad in ("0.01,0.001,0.0001,-0.002", "0.01,0.001,0.0001,nan", "1,2,3,4,5", "-1,0,0"):
        with pytest.raises(ValueError, match="--sim-cost"):
            CostModel.parse(bad)


def test_sim_step_time_charges_decode_rows() -> None:
    """A step's forward_s is the model's: d counts each decode row once."""
    executor = SimExecutor(4096, 1000, 0, CostModel(0.0, 0.0, 0.0, 0.5))
    assert executor.execute(_prefill(1, [(1, "a", 5, 100), (2, "b", 3, 100)])).forward_s == 0.0
    assert executor.execute(_decode(2, [1, 2], 0)).forward_s == pytest.approx(1.0)


def test_bad_plan_is_an_error_result() -> None:
    result = SimExecutor(4096, 1000, 0).execute(_decode(1, [42], 0))
    assert "42" in result.error


def test_a_reset_plan_forgets_every_sequence_first() -> None:
    executor = SimExecutor(4096, 1000, 0)
    assert executor.execute(_prefill(1, [(1, "a", 5, 100), (2, "b", 3, 100)])).error == ""
    again = _prefill(1, [(1, "c", 4, 100)])
    assert "already live" in executor.execute(again).error
    result = executor.execute(dataclasses.replace(again, reset=True))
    assert result.error == "" and result.kv.live_seqs == 1


def test_a_restore_names_the_length_the_sequence_continues_from() -> None:
    """Under overlap a retraction offloads only the committed positions: one fewer than the table
    held when the retracted sequence's last decode was still in flight. The restore names them, and
    the re-prefill continues from there."""
    sim = SimExecutor(capacity=4096, vocab_size=500, eos_token_id=0)
    assert not sim.execute(_prefill(1, [(1, "r", 4, 50)])).error
    assert not sim.execute(_decode(2, [1], 100)).error  # the table holds 5 positions now
    offload = StepPlan(3, StepKind.DECODE, offloads=(KvTransfer(1, np.arange(4, dtype=np.int64)),))
    assert not sim.execute(offload).error
    restore = StepPlan(
        4,
        StepKind.PREFILL,
        restores=(KvTransfer(1, np.arange(200, 204, dtype=np.int64)),),
        extends=ExtendWork(
            handles=np.asarray([1], dtype=np.int64),
            starts=np.asarray([4], dtype=np.int64),
            lens=np.asarray([2], dtype=np.int64),
            sample=np.ones(1, dtype=bool),
            token_ids=np.ones(2, dtype=np.int64),
            slots=np.arange(204, 206, dtype=np.int64),
        ),
    )
    result = sim.execute(restore)
    assert not result.error, result.error
    assert result.kv.seq_slots == 6 and result.kv.host_seqs == 0


def _asking(handle: int, rid: str, prompt_len: int, logprobs: int, ids: tuple[int, ...] = ()) -> NewSeq:
    sampler = SamplerParams(logprobs=logprobs, token_ids_logprob=ids)
    return NewSeq(handle, sampler, request_id=rid, prompt_len=prompt_len, sim_output_len=100)


def test_logprobs_one_entry_per_sampled_token_when_any_row_asks() -> None:
    """All mass on the picked token: logprob 0.0, that token as the one alternative, token ids 0.0
    for it and -inf for others; a row that did not ask gets the logprob alone."""
    executor = SimExecutor(4096, 1000, 0)
    plan = dataclasses.replace(
        _prefill(1, [(1, "a", 4, 100), (2, "b", 3, 100)]),
        new_seqs=(_new(1, "a", 4, 100), _asking(2, "b", 3, logprobs=5, ids=(7, 8))),
    )
    result = executor.execute(plan)
    assert not result.error, result.error
    quiet, asking = result.logprobs
    assert quiet.logprob == 0.0 and quiet.top_ids == () and quiet.ids_logprobs == ()
    token = int(result.token_ids[1])
    assert asking.logprob == 0.0 and asking.top_ids == (token,) and asking.top_logprobs == (0.0,)
    assert asking.ids_logprobs == tuple(0.0 if i == token else float("-inf") for i in (7, 8))
    decode = executor.execute(_decode(2, [1, 2], 500))
    assert len(decode.logprobs) == 2
    assert executor.execute(_decode(3, [1], 600)).logprobs == ()  # the only asking row is not in it


def test_prompt_scores_one_row_per_scored_position() -> None:
    """Entry 1 scores positions 1..4 of its 5-token extend: rows point at the next prompt token, the
    last at next_ids; entry 0 scores nothing; a bad column is an error result."""
    executor = SimExecutor(4096, 1000, 0)
    base = _prefill(1, [(1, "a", 3, 100), (2, "b", 5, 100)])
    ext = dataclasses.replace(
        base.extends,
        token_ids=np.array([1, 1, 1, 10, 11, 12, 13, 14], dtype=np.int64),
        sample=np.array([True, False]),
        score_starts=np.array([0, 1], dtype=np.int32),
        score_lens=np.array([0, 4], dtype=np.int32),
        next_ids=np.array([-1, 15], dtype=np.int32),
    )
    new_seqs = (_new(1, "a", 3, 100), _asking(2, "b", 5, logprobs=2, ids=(12, 3)))
    bad = dataclasses.replace(ext, next_ids=np.array([-1, -1], dtype=np.int32))
    assert (
        "next_ids"
        in SimExecutor(4096, 1000, 0).execute(dataclasses.replace(base, new_seqs=new_seqs, extends=bad)).error
    )
    result = executor.execute(dataclasses.replace(base, new_seqs=new_seqs, extends=ext))
    assert not result.error, result.error
    (scores,) = result.prompt_scores
    assert scores.entry == 1
    assert [row.top_ids for row in scores.rows] == [(12,), (13,), (14,), (15,)]
    assert all(row.logprob == 0.0 for row in scores.rows)
    assert scores.rows[0].ids_logprobs == (0.0, float("-inf"))
    assert result.logprobs == ()  # the sampled row (entry 0) did not ask


def test_a_few_rows_get_the_tokens_the_vectorised_rule_gives() -> None:
    """A step of a few rows hashes in plain ints (_few_tokens): the same tokens as the numpy rule,
    EOS at each output length and the EOS id itself never drawn included."""
    rng = np.random.default_rng(5)
    for vocab in (7, 50, 32000):
        executor = SimExecutor(100_000, vocab, eos_token_id=4, seed=3)
        seqs = [(h, f"r{h}", int(rng.integers(1, 40)), int(rng.integers(1, 9))) for h in range(1, 30)]
        executor.execute(_prefill(1, seqs))
        table, seen = executor.table, set()
        for _ in range(12):
            rows = table.rows(np.asarray([s[0] for s in seqs], dtype=np.int64))
            few, many = executor._few_tokens(rows), executor._many_tokens(rows)
            assert few.dtype == many.dtype and few.tolist() == many.tolist()
            seen.update(many.tolist())
            table.advance(rows, 1)
        assert 4 in seen  # each sequence reached its output length
