"""Logprobs from the executor against transformers' LlamaForCausalLM on the same weights (float32).

Sampled tokens: raw logprobs are the log-softmax of transformers' logits at that position, with the
top alternatives and token_ids_logprob; processed ones that of its logits after temperature and the
top-k filter. Prompt scoring: each scored row equals transformers' log_softmax(logits[p])[ids[p+1]]
and its top-k, in one extend and split over two chunks (the first chunk's last row scored against
next_ids). Bad score columns are refused before any state changes. A 2,000-token prompt at a 32,000
vocabulary is scored with bounded memory.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from data_plane.executor import SCORE_SLICE_BYTES, Executor, score_slice_rows
from data_plane.kv_pool import KvPool
from data_plane.models.llama import LlamaModel
from protos.worker import ExtendWork, PromptScores, SamplerParams, StepPlan, StepResult, TokenLogprobs
from tests.data_plane.factories import Extend, SlotAllocator, hf_next_logits, make_plan, new_seq
from tests.data_plane.families import COMMON

TOLERANCE = 1e-4
VOCAB = 1024  # the embedded model's


def _tokens(rng: np.random.Generator, n: int, vocab: int = VOCAB) -> list[int]:
    return rng.integers(1, vocab, size=n).tolist()


def _check_entry(
    entry: TokenLogprobs, reference: torch.Tensor, token: int, n: int, ids: Sequence[int]
) -> None:
    """`entry` against `reference` (one position's log-softmax [vocab]) for `token`, n - 1 top, ids."""
    assert entry.logprob == pytest.approx(float(reference[token]), abs=TOLERANCE)
    top = reference.topk(n - 1) if n > 1 else None
    if top is None:
        assert entry.top_ids == () and entry.top_logprobs == ()
    else:
        assert list(entry.top_ids) == top.indices.tolist()
        assert np.allclose(entry.top_logprobs, top.values.numpy(), atol=TOLERANCE)
    assert len(entry.ids_logprobs) == len(ids)
    assert np.allclose(entry.ids_logprobs, reference[list(ids)].numpy(), atol=TOLERANCE)


def _with_scores(
    plan: StepPlan, starts: Sequence[int], lens: Sequence[int], next_ids: Sequence[int]
) -> StepPlan:
    ext = plan.extends
    scored = ExtendWork(
        handles=ext.handles,
        starts=ext.starts,
        lens=ext.lens,
        sample=ext.sample,
        token_ids=ext.token_ids,
        slots=ext.slots,
        score_starts=np.asarray(starts, dtype=np.int32),
        score_lens=np.asarray(lens, dtype=np.int32),
        next_ids=np.asarray(next_ids, dtype=np.int32),
    )
    return StepPlan(plan.step_id, plan.kind, new_seqs=plan.new_seqs, extends=scored, decodes=plan.decodes)


def _ok(result: StepResult) -> StepResult:
    assert result.error == "", result.error
    return result


def _hf_prompt_logprobs(hf_model, tokens: Sequence[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([list(tokens)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


# ---- sampled tokens ---------------------------------------------------------------------------


SAMPLERS = {
    1: SamplerParams(logprobs=5, token_ids_logprob=(3, 700, 12)),  # greedy
    2: SamplerParams(temperature=0.8, seed=7, logprobs=3, token_ids_logprob=(5,)),  # seeded
    3: SamplerParams(),  # asks for nothing: the sampled token's logprob only
    4: SamplerParams(temperature=1.0, seed=11, top_k=40, logprobs=1),
    # Penalties and bias change what is sampled, not the raw logprobs.
    5: SamplerParams(presence_penalty=1.5, logit_bias=((7, 3.0),), logprobs=3, token_ids_logprob=(7,)),
}


def test_sampled_logprobs_are_transformers_raw_log_softmax(make_executor, hf_model) -> None:
    """Greedy and seeded rows (one with top-k, whose raw logprobs ignore the filter; one with
    penalties and a bias, which raw logprobs ignore too) over a prefill and three decodes: every
    sampled row has an entry, equal to transformers' log-softmax."""
    rng = np.random.default_rng(0)
    executor = make_executor()
    slots = SlotAllocator(4096, 4, seed=1)
    prompts = {h: _tokens(rng, 6 + h) for h in SAMPLERS}
    plan = make_plan(
        1,
        extends=[Extend(h, 0, p, slots.alloc(h, len(p))) for h, p in prompts.items()],
        new_seqs=[new_seq(h, s) for h, s in SAMPLERS.items()],
    )
    tokens = {h: list(p) for h, p in prompts.items()}
    for step in range(4):
        if step:
            plan = make_plan(step + 1, decodes=[(h, int(slots.alloc(h, 1)[0])) for h in SAMPLERS])
        result = _ok(executor.execute(plan))
        assert len(result.logprobs) == len(SAMPLERS)
        for (h, params), token, entry in zip(
            SAMPLERS.items(), result.token_ids.tolist(), result.logprobs, strict=True
        ):
            reference = torch.log_softmax(hf_next_logits(hf_model, tokens[h]), dim=-1)
            ids = params.token_ids_logprob if params.logprobs else ()
            _check_entry(entry, reference, token, max(params.logprobs, 1), ids)
            tokens[h].append(token)


def test_processed_logprobs_follow_temperature_and_top_k(make_executor, hf_model) -> None:
    """Processed mode: log_softmax of transformers' logits / temperature with the top-k filter
    (-inf outside it); a greedy row is filtered but not scaled."""
    rng = np.random.default_rng(1)
    executor = make_executor()
    slots = SlotAllocator(4096, 1, seed=2)
    samplers = {
        1: SamplerParams(
            temperature=0.7, top_k=10, seed=3, logprobs=12, token_ids_logprob=(9,), processed_logprobs=True
        ),
        2: SamplerParams(top_k=4, logprobs=6, processed_logprobs=True),
    }
    prompts = {h: _tokens(rng, 9) for h in samplers}
    plan = make_plan(
        1,
        extends=[Extend(h, 0, p, slots.alloc(h, len(p))) for h, p in prompts.items()],
        new_seqs=[new_seq(h, s) for h, s in samplers.items()],
    )
    tokens = {h: list(p) for h, p in prompts.items()}
    for step in range(3):
        if step:
            plan = make_plan(step + 1, decodes=[(h, int(slots.alloc(h, 1)[0])) for h in samplers])
        result = _ok(executor.execute(plan))
        for (h, params), token, entry in zip(
            samplers.items(), result.token_ids.tolist(), result.logprobs, strict=True
        ):
            logits = hf_next_logits(hf_model, tokens[h]) / (params.temperature or 1.0)
            top = logits.topk(params.top_k)
            filtered = torch.full_like(logits, float("-inf")).scatter(0, top.indices, top.values)
            expected = torch.log_softmax(filtered, dim=-1)
            assert token in top.indices.tolist()
            assert entry.logprob == pytest.approx(float(expected[token]), abs=TOLERANCE)
            k = params.top_k
            assert list(entry.top_ids[:k]) == top.indices.tolist()
            assert np.allclose(entry.top_logprobs[:k], expected[top.indices].numpy(), atol=TOLERANCE)
            assert all(v == float("-inf") for v in entry.top_logprobs[k:])
            assert np.allclose(
                entry.ids_logprobs, expected[list(params.token_ids_logprob)].numpy(), atol=TOLERANCE
            )
            tokens[h].append(token)


# ---- prompt scoring ---------------------------------------------------------------------------

SCORER = SamplerParams(logprobs=4, token_ids_logprob=(1, 2, 1000))


def _check_scores(scores: PromptScores, reference: torch.Tensor, tokens: Sequence[int], first: int) -> None:
    for j, row in enumerate(scores.rows):
        p = first + j
        _check_entry(row, reference[p], tokens[p + 1], SCORER.logprobs, SCORER.token_ids_logprob)


def test_prompt_scoring_in_one_extend_matches_transformers(make_executor, hf_model) -> None:
    """Entry 1 of two scores positions 5..38 of its 40-token prompt (the last one, whose next token
    is the one sampled, is not asked); entry 0 scores nothing and gets no PromptScores."""
    rng = np.random.default_rng(2)
    executor = make_executor()
    slots = SlotAllocator(4096, 4, seed=3)
    other, prompt = _tokens(rng, 11), _tokens(rng, 40)
    plan = make_plan(
        1,
        extends=[Extend(1, 0, other, slots.alloc(1, 11)), Extend(2, 0, prompt, slots.alloc(2, 40))],
        new_seqs=[new_seq(1), new_seq(2, SCORER)],
    )
    result = _ok(executor.execute(_with_scores(plan, [0, 5], [0, 34], [-1, -1])))
    assert [s.entry for s in result.prompt_scores] == [1]
    assert len(result.prompt_scores[0].rows) == 34
    _check_scores(result.prompt_scores[0], _hf_prompt_logprobs(hf_model, prompt), prompt, 5)
    # Sampling is unchanged by the scoring next to it.
    assert result.token_ids[1] == int(hf_next_logits(hf_model, prompt).argmax())


def test_prompt_scoring_over_two_chunks_uses_next_ids(make_executor, hf_model) -> None:
    """Chunk one (positions 0..19, not sampling) scores 3..19: row 19 is scored against next_ids,
    the first token of chunk two, which scores 20..38."""
    rng = np.random.default_rng(3)
    executor = make_executor()
    slots = SlotAllocator(4096, 4, seed=4)
    prompt = _tokens(rng, 40)
    reference = _hf_prompt_logprobs(hf_model, prompt)
    first = make_plan(
        1,
        extends=[Extend(1, 0, prompt[:20], slots.alloc(1, 20), sample=False)],
        new_seqs=[new_seq(1, SCORER)],
    )
    one = _ok(executor.execute(_with_scores(first, [3], [17], [prompt[20]])))
    assert len(one.token_ids) == 0 and len(one.prompt_scores[0].rows) == 17
    _check_scores(one.prompt_scores[0], reference, prompt, 3)
    second = make_plan(2, extends=[Extend(1, 20, prompt[20:], slots.alloc(1, 20))])
    two = _ok(executor.execute(_with_scores(second, [20], [19], [-1])))
    _check_scores(two.prompt_scores[0], reference, prompt, 20)


def test_no_score_columns_no_prompt_scores(make_executor) -> None:
    executor = make_executor()
    plan = make_plan(1, extends=[Extend(1, 0, [5, 6, 7], np.arange(3))], new_seqs=[new_seq(1, SCORER)])
    assert _ok(executor.execute(plan)).prompt_scores == ()


@pytest.mark.parametrize(
    ("starts", "lens", "next_ids", "message"),
    [
        ([0], [2], [], "empty or have one value per extend"),
        ([0], [-1], [-1], "negative score_lens"),
        ([2], [4], [-1], "outside its extend"),  # runs past the extend's end
        ([4], [1], [-1], "outside its extend"),  # score_starts after the extend
        ([-1], [2], [-1], "outside its extend"),  # starts before the extend (in the cached part)
        ([1], [2], [-1], "gives no next_ids token"),  # the last position, nothing after it
    ],
)
def test_bad_score_columns_are_plan_errors_before_any_change(
    make_executor, starts: list[int], lens: list[int], next_ids: list[int], message: str
) -> None:
    executor = make_executor()
    good = make_plan(
        1, extends=[Extend(1, 0, [5, 6, 7], np.arange(3), sample=False)], new_seqs=[new_seq(1, SCORER)]
    )
    _ok(executor.execute(good))
    plan = make_plan(2, extends=[Extend(1, 3, [8, 9, 10], np.arange(3, 6))])
    bad = executor.execute(_with_scores(plan, [s + 3 for s in starts], lens, next_ids))
    assert message in bad.error
    assert executor.table.slot_table(1).tolist() == [0, 1, 2]  # nothing appended
    fixed = _ok(executor.execute(_with_scores(plan, [3], [2], [-1])))
    assert len(fixed.prompt_scores[0].rows) == 2


# ---- bounded memory ---------------------------------------------------------------------------

BIG_VOCAB, LONG_PROMPT, HIDDEN = 32_000, 2_000, 64


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    """A tiny random Llama with a 32,000-token vocabulary, saved by transformers, loaded by ours."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    settings = {
        **COMMON,
        "vocab_size": BIG_VOCAB,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**settings), dtype=torch.float32)
    out = tmp_path_factory.mktemp("big_vocab")
    model.save_pretrained(str(out))
    return LlamaModel.from_dir(out, torch.device("cpu"), torch.float32)


def _peak_bytes_in(trace: pathlib.Path, region: str) -> int:
    """Peak of CPU bytes allocated and not yet freed inside `region`, relative to its start, from the
    profiler's time-ordered allocation ([memory]: +bytes) and free (-bytes) events."""
    events = json.loads(trace.read_text())["traceEvents"]
    (span,) = [e for e in events if e.get("name") == region and e.get("ph") == "X"]
    start, end = span["ts"], span["ts"] + span["dur"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    held = peak = 0
    for event in memory:
        if start <= event["ts"] <= end and event["args"].get("Device Type", 0) == 0:
            held += int(event["args"]["Bytes"])
            peak = max(peak, held)
    return peak


def test_scoring_a_long_prompt_keeps_memory_bounded(
    big_vocab_model: LlamaModel, tmp_path: pathlib.Path
) -> None:
    """Measured: every CPU allocation torch makes while the executor scores (the profiler's
    allocation/free events inside a region around Executor._score_prompts: LM head slices, their
    log-softmax, top-k and gathers), for all 1,999 scorable rows of a 2,000-token prompt at a 32,000
    vocabulary. Whole, those logits would be 2000 * 32000 * 4 bytes = 256 MB; the peak must stay
    under two slice budgets (a slice's logits and their log-softmax) plus the rows' [P, hidden]
    states and 4 MiB of small tensors (measured: 33.5 MB). The rows must also have come in more
    than one slice."""
    executor = Executor(
        big_vocab_model, KvPool(big_vocab_model.config, 2048, torch.float32, torch.device("cpu"))
    )
    original, slices = executor.score_slice, []

    def counting_slice(*args, **kwargs):  # type: ignore[no-untyped-def]
        slices.append(len(args[1]))
        return original(*args, **kwargs)

    executor.score_slice = counting_slice  # type: ignore[method-assign]
    score_prompts = executor._score_prompts

    def profiled(*args, **kwargs):  # type: ignore[no-untyped-def]
        with torch.profiler.record_function("prompt_scores"):
            return score_prompts(*args, **kwargs)

    executor._score_prompts = profiled  # type: ignore[method-assign]
    prompt = _tokens(np.random.default_rng(4), LONG_PROMPT, BIG_VOCAB)
    plan = make_plan(
        1,
        extends=[Extend(1, 0, prompt, np.arange(LONG_PROMPT))],
        new_seqs=[new_seq(1, SamplerParams(logprobs=5))],
    )
    plan = _with_scores(plan, [0], [LONG_PROMPT - 1], [-1])
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        result = _ok(executor.execute(plan))
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    rows = result.prompt_scores[0].rows
    assert len(rows) == LONG_PROMPT - 1 and all(len(r.top_ids) == 4 for r in rows)
    assert len(slices) > 1 and max(slices) == score_slice_rows(BIG_VOCAB)
    peak = _peak_bytes_in(tmp_path / "trace.json", "prompt_scores")
    bound = 2 * SCORE_SLICE_BYTES + LONG_PROMPT * HIDDEN * 4 + 4 * 2**20
    assert 0 < peak < bound, f"peak {peak} bytes, bound {bound}"
    assert peak < LONG_PROMPT * BIG_VOCAB * 4 // 4  # a quarter of the whole logits, whatever the budget
