"""Sampler unit tests on synthetic logits: truncation, penalties, logprobs, seeded uniforms."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from data_plane.sampler import BiasRow, PenaltyRow, apply_penalties, sample, seeded_uniforms
from data_plane.state import SamplerColumns
from protos.worker import SamplerParams

VOCAB = 64
ROWS = 256


def _columns(rows: int, **overrides: object) -> SamplerColumns:
    """Columns for `rows` identical rows; keyword values override the defaults (temperature 1)."""
    values: dict[str, object] = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, logprobs=0)
    values |= overrides
    seed = values["seed"]
    return SamplerColumns(
        temperature=np.full(rows, values["temperature"], dtype=np.float64),
        top_p=np.full(rows, values["top_p"], dtype=np.float64),
        top_k=np.full(rows, values["top_k"], dtype=np.int64),
        min_p=np.full(rows, values["min_p"], dtype=np.float64),
        has_seed=np.full(rows, seed is not None),
        seed=np.full(rows, seed or 0, dtype=np.uint64),
        logprobs=np.full(rows, values["logprobs"], dtype=np.int64),
    )


def _draw(logits: torch.Tensor, seed: int = 0, **overrides: object) -> np.ndarray:
    rows = logits.shape[0]
    out = sample(
        logits.clone(), _columns(rows, **overrides), np.arange(rows), [], np.random.default_rng(seed)
    )
    return out.token_ids


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax(logits: torch.Tensor) -> None:
    assert (_draw(logits, temperature=0.0) == logits.argmax(-1).numpy()).all()


def test_tiny_temperature_is_argmax(logits: torch.Tensor) -> None:
    assert (_draw(logits, temperature=1e-6) == logits.argmax(-1).numpy()).all()


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_leaves_the_k_best(logits: torch.Tensor, k: int) -> None:
    allowed = logits.topk(k, dim=-1).indices.numpy()
    for seed in range(5):
        tokens = _draw(logits, seed=seed, top_k=k, temperature=2.0)
        assert all(t in row for t, row in zip(tokens, allowed, strict=True))


def test_top_p_keeps_the_smallest_nucleus(logits: torch.Tensor) -> None:
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    tokens = _draw(logits, seed=1, top_p=0.5)
    for row, token in enumerate(tokens):
        rank = (order[row] == int(token)).nonzero().item()
        assert mass_before[row, rank] < 0.5


def test_min_p_drops_unlikely_tokens(logits: torch.Tensor) -> None:
    probs = torch.softmax(logits, dim=-1)
    tokens = _draw(logits, seed=2, min_p=0.2)
    chosen = probs[torch.arange(ROWS), torch.from_numpy(tokens)]
    assert (chosen >= 0.2 * probs.max(-1).values).all()


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    counts = np.bincount(_draw(logits, seed=3), minlength=3) / 4000
    assert np.allclose(counts, [0.7, 0.2, 0.1], atol=0.03)


def test_seeded_rows_do_not_depend_on_neighbours(logits: torch.Tensor) -> None:
    cols = _columns(1, seed=42)
    alone = sample(logits[5:6].clone(), cols, np.array([17]), [], np.random.default_rng(0)).token_ids
    many = _columns(ROWS, seed=42)
    positions = np.full(ROWS, 17)
    batch = sample(logits.clone(), many, positions, [], np.random.default_rng(9)).token_ids
    assert batch[5] == alone[0]


def test_seeded_uniforms_are_deterministic_and_spread() -> None:
    seeds = np.full(10000, 7, dtype=np.uint64)
    u = seeded_uniforms(seeds, np.arange(10000))
    assert np.array_equal(u, seeded_uniforms(seeds, np.arange(10000)))
    assert u.min() > 0.0 and u.max() <= 1.0
    assert abs(u.mean() - 0.5) < 0.02


def test_penalties_match_transformers_and_openai_rules() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    history = [3, 3, 5, 9]
    expected_rep = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits[:1].clone())
    ours = logits.clone()
    apply_penalties(
        ours,
        [
            PenaltyRow(0, SamplerParams(repetition_penalty=1.3), history),
            PenaltyRow(1, SamplerParams(frequency_penalty=0.5, presence_penalty=0.25), history),
        ],
    )
    assert torch.allclose(ours[0], expected_rep[0])
    counts = torch.bincount(torch.tensor(history), minlength=VOCAB).float()
    assert torch.allclose(ours[1], logits[1] - 0.5 * counts - 0.25 * (counts > 0).float())


def test_logprobs_report_sampled_and_top_alternatives(logits: torch.Tensor) -> None:
    out = sample(
        logits[:3].clone(),
        _columns(3, logprobs=4, temperature=0.0),
        np.arange(3),
        [],
        np.random.default_rng(),
    )
    reference = torch.log_softmax(logits[:3], dim=-1)
    assert len(out.logprobs) == 3
    for row, entry in enumerate(out.logprobs):
        assert entry.logprob == pytest.approx(reference[row].max().item(), abs=1e-5)
        assert len(entry.top_ids) == 3
        assert entry.top_ids[0] == out.token_ids[row]


def test_logit_bias_forces_bans_and_leaves_other_rows_alone(logits: torch.Tensor) -> None:
    """OpenAI's logit_bias: +100 all but forces a token, -100 bans one, even under greedy; ids past
    the vocabulary are left out; rows without a bias are untouched. Raw logprobs are those of the
    model's logits (before the bias), processed ones those of the biased logits."""
    greedy = logits.argmax(-1).numpy()
    forced = int((greedy[0] + 1) % VOCAB)
    biases = [
        BiasRow(0, np.array([forced, VOCAB + 5]), np.array([100.0, 100.0], dtype=np.float32)),
        BiasRow(1, np.array([greedy[1]]), np.array([-100.0], dtype=np.float32)),
    ]
    cols = _columns(ROWS, temperature=0.0, logprobs=1)
    out = sample(logits.clone(), cols, np.arange(ROWS), [], np.random.default_rng(0), biases)
    assert out.token_ids[0] == forced
    second_best = int(logits[1].topk(2).indices[1])
    assert out.token_ids[1] == second_best
    assert (out.token_ids[2:] == greedy[2:]).all()
    raw = float(torch.log_softmax(logits[0], -1)[forced])
    assert out.logprobs[0].logprob == pytest.approx(raw, abs=1e-5)
    processed = dataclasses.replace(cols, processed=np.ones(ROWS, dtype=bool))
    out = sample(logits.clone(), processed, np.arange(ROWS), [], np.random.default_rng(0), biases)
    biased = logits[0].clone()
    biased[forced] += 100.0
    assert out.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(biased, -1)[forced]), abs=1e-5)
    assert out.logprobs[0].logprob != pytest.approx(raw, abs=1e-3)


def test_raw_logprobs_come_before_penalties_and_processed_ones_after(logits: torch.Tensor) -> None:
    """Penalties change the logits in place: raw logprobs must be taken before, processed after."""
    params = SamplerParams(presence_penalty=100.0)
    history = logits[0].topk(3).indices.tolist()
    penalties = [PenaltyRow(0, params, history)]
    cols = _columns(1, temperature=0.0, logprobs=2)
    raw = sample(logits[:1].clone(), cols, np.arange(1), penalties, np.random.default_rng(0))
    token = int(raw.token_ids[0])
    assert token not in history  # the penalty moved the argmax
    assert raw.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[token]), abs=1e-5)
    assert raw.logprobs[0].top_ids[0] == history[0]  # raw: the unpenalised best
    cols = dataclasses.replace(cols, processed=np.ones(1, dtype=bool))
    out = sample(logits[:1].clone(), cols, np.arange(1), penalties, np.random.default_rng(0))
    penalised = logits[0].clone()
    apply_penalties(penalised[None], penalties)
    expected = torch.log_softmax(penalised, -1)
    assert out.logprobs[0].logprob == pytest.approx(float(expected[token]), abs=1e-5)
    assert out.logprobs[0].top_ids == (token,)


def test_processed_logprobs_are_minus_inf_outside_top_k_and_tempered(logits: torch.Tensor) -> None:
    cols = dataclasses.replace(
        _columns(4, temperature=0.5, top_k=5, logprobs=8, seed=3), processed=np.ones(4, dtype=bool)
    )
    ids = [np.array([int(logits[i].argmin()), int(logits[i].argmax()), VOCAB + 1]) for i in range(4)]
    out = sample(logits[:4].clone(), cols, np.arange(4), [], np.random.default_rng(0), logprob_ids=ids)
    for i, entry in enumerate(out.logprobs):
        scaled = logits[i] / 0.5
        top = scaled.topk(5)
        filtered = torch.full_like(scaled, float("-inf")).scatter(0, top.indices, top.values)
        expected = torch.log_softmax(filtered, -1)
        assert int(out.token_ids[i]) in top.indices.tolist()
        assert entry.logprob == pytest.approx(float(expected[int(out.token_ids[i])]), abs=1e-5)
        assert list(entry.top_ids[:5]) == top.indices.tolist()
        assert np.allclose(entry.top_logprobs[:5], expected[top.indices].numpy(), atol=1e-5)
        assert all(v == float("-inf") for v in entry.top_logprobs[5:])
        assert entry.ids_logprobs[0] == float("-inf")
        assert entry.ids_logprobs[1] == pytest.approx(float(expected.max()), abs=1e-5)
        assert entry.ids_logprobs[2] == float("-inf")  # outside the vocabulary


def test_no_logprobs_asked_means_no_entries(logits: torch.Tensor) -> None:
    out = sample(logits.clone(), _columns(ROWS), np.arange(ROWS), [], np.random.default_rng(0))
    assert out.logprobs == ()


def test_rows_that_did_not_ask_get_the_sampled_logprob_only(logits: torch.Tensor) -> None:
    cols = _columns(2, temperature=0.0)
    cols = dataclasses.replace(cols, logprobs=np.array([0, 3]))
    ids = [np.zeros(0, np.int64), np.array([1, 2])]
    out = sample(logits[:2].clone(), cols, np.arange(2), [], np.random.default_rng(0), logprob_ids=ids)
    assert out.logprobs[0].top_ids == () and out.logprobs[0].ids_logprobs == ()
    assert len(out.logprobs[1].top_ids) == 2
    reference = torch.log_softmax(logits[1], -1)
    assert np.allclose(out.logprobs[1].ids_logprobs, reference[[1, 2]].numpy(), atol=1e-5)
