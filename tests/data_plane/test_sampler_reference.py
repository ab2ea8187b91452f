"""The sampler against transformers' logits processors and warpers on the same logits.

Truncation: our filtered distribution (temperature, then top-k, top-p, min-p, as generate orders
them) equals softmax of transformers' warped scores, row by row, with rows of different settings
in one batch. Penalties: repetition equals RepetitionPenaltyLogitsProcessor; frequency and
presence (no transformers processor) equal the OpenAI rule logits - f * count - p * (count > 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_plane.sampler import PenaltyRow, apply_penalties, filtered_probs, sample
from data_plane.state import SamplerColumns
from protos.worker import SamplerParams

VOCAB = 97
# (temperature, top_k, top_p, min_p): one row each, all in the same batch.
SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.15),
    (0.5, 20, 0.9, 0.05),
    (2.0, 1, 1.0, 0.0),
    (1.0, 40, 0.3, 0.0),
    (0.9, 0, 0.95, 0.3),
]


def _columns(settings: list[tuple[float, int, float, float]]) -> SamplerColumns:
    n = len(settings)
    return SamplerColumns(
        temperature=np.array([s[0] for s in settings], dtype=np.float64),
        top_k=np.array([s[1] for s in settings], dtype=np.int64),
        top_p=np.array([s[2] for s in settings], dtype=np.float64),
        min_p=np.array([s[3] for s in settings], dtype=np.float64),
        has_seed=np.ones(n, dtype=bool),
        seed=np.arange(n, dtype=np.uint64),
        logprobs=np.zeros(n, dtype=np.int64),
    )


def _transformers_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """softmax of one row after transformers' warpers, in the order generate() applies them."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k > 0 else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p > 0.0 else []
    scores = row[None].clone()
    for warper in warpers:
        scores = warper(torch.zeros(1, 1, dtype=torch.long), scores)
    return torch.softmax(scores, dim=-1)[0]


@pytest.mark.parametrize("seed", range(4))
def test_truncation_matches_transformers_warpers(seed: int) -> None:
    logits = torch.randn(len(SETTINGS), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    ours = filtered_probs(logits.clone(), _columns(SETTINGS)).float()
    for i, setting in enumerate(SETTINGS):
        expected = _transformers_probs(logits[i], *setting)
        assert torch.equal(ours[i] > 0, expected > 0), f"row {i} {setting}: different kept sets"
        assert torch.allclose(ours[i], expected, atol=1e-6), f"row {i} {setting}"


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    probs = torch.softmax(logits, dim=-1)
    for top_p in (0.1, 0.5, 0.9):
        kept = filtered_probs(logits.clone(), _columns([(1.0, 0, top_p, 0.0)] * 64)) > 0
        mass = (probs * kept).sum(-1)
        smallest_kept = probs.masked_fill(~kept, 2.0).min(-1).values
        assert (mass >= top_p - 1e-6).all(), "kept set falls short of p"
        assert (mass - smallest_kept < top_p).all(), "kept set is not minimal"


def test_draws_stay_inside_the_filtered_support() -> None:
    logits = torch.randn(len(SETTINGS), VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    cols = _columns(SETTINGS)
    support = filtered_probs(logits.clone(), cols) > 0
    for position in range(200):
        positions = np.full(len(SETTINGS), position)
        tokens = sample(logits.clone(), cols, positions, [], np.random.default_rng()).token_ids
        assert support[np.arange(len(SETTINGS)), tokens].all(), f"position {position}"


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    generator = torch.Generator().manual_seed(int(penalty * 10))
    logits = torch.randn(3, VOCAB, generator=generator) * 2
    histories = [[1, 1, 2, 50], [96, 0, 0, 0, 7], list(range(0, VOCAB, 3))]
    rows = [PenaltyRow(i, SamplerParams(repetition_penalty=penalty), h) for i, h in enumerate(histories)]
    ours = logits.clone()
    apply_penalties(ours, rows)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for i, history in enumerate(histories):
        expected = processor(torch.tensor([history]), logits[i : i + 1].clone())[0]
        assert torch.allclose(ours[i], expected, atol=1e-6), f"history {i}"


def test_all_penalties_together_follow_transformers_then_openai() -> None:
    """Repetition first (transformers' rule), then frequency and presence on the result."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    history = [4, 4, 4, 9, 9, 30]
    params = SamplerParams(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.7)
    ours = logits.clone()
    apply_penalties(ours, [PenaltyRow(0, params, history)])
    repeated = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([history]), logits.clone())[0]
    counts = torch.bincount(torch.tensor(history), minlength=VOCAB).float()
    expected = repeated - 0.4 * counts - 0.7 * (counts > 0).float()
    assert torch.allclose(ours[0], expected, atol=1e-6)


def test_rows_without_penalties_are_untouched() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    ours = logits.clone()
    apply_penalties(ours, [PenaltyRow(1, SamplerParams(presence_penalty=1.0), [3, 4])])
    assert torch.equal(ours[0], logits[0]) and torch.equal(ours[2], logits[2])
    assert not torch.equal(ours[1], logits[1])
