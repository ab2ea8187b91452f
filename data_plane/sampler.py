"""Batched token sampling: penalties, greedy, temperature, top-k, top-p, min-p, seeded draws.

Order of operations (as transformers' processors and warpers apply them): penalties on the raw
logits, then the logit bias (OpenAI's `logit_bias`), then temperature, top-k, top-p and min-p, then
one draw. Logprobs are reported from the penalised and biased logits before temperature and
truncation.

Reproducibility: a seeded row's draw uses a uniform number computed from (seed, position of the
token being sampled) by a counter-based hash, not from a shared generator stream. So the same
seed gives the same tokens whatever else is in the batch, and after a retraction and re-prefill.
The draw itself is an inverse-CDF lookup over the filtered distribution, batched for all rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data_plane.state import SamplerColumns
from protos.worker import SamplerParams, TokenLogprobs

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True, slots=True)
class PenaltyRow:
    """A batch row that uses penalties, with the tokens they count."""

    index: int
    params: SamplerParams
    history: list[int]


@dataclass(frozen=True, slots=True)
class BiasRow:
    """A batch row with a logit bias: `values[j]` is added to the logit of `ids[j]`."""

    index: int
    ids: np.ndarray  # int64
    values: np.ndarray  # float32


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: np.ndarray  # int64 [S]
    # Empty unless some row asked for logprobs; then one entry per row.
    logprobs: tuple[TokenLogprobs, ...]


# Inference mode because the forward's logits are inference tensors: penalties update them in place,
# which torch refuses outside inference mode.
@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    cols: SamplerColumns,
    positions: np.ndarray,
    penalties: list[PenaltyRow],
    rng: np.random.Generator,
    biases: list[BiasRow] | tuple[BiasRow, ...] = (),
) -> SampleOutput:
    """Pick one token per row of `logits` ([S, vocab], float32; modified in place by penalties and
    biases).

    `positions[i]` is the position the sampled token will take in its sequence (the seed's counter).
    """
    apply_penalties(logits, penalties)
    apply_biases(logits, biases)
    wants_logprobs = int(cols.logprobs.max(initial=0)) > 0
    logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
    tokens = logits.argmax(dim=-1)
    stochastic = np.flatnonzero(cols.temperature > 0)
    if len(stochastic):
        uniforms = draw_uniforms(cols.has_seed[stochastic], cols.seed[stochastic], positions[stochastic], rng)
        index = torch.from_numpy(stochastic).to(logits.device)
        tokens[index] = _sample_rows(logits[index], _subset(cols, stochastic), uniforms)
    token_ids = tokens.cpu().numpy().astype(np.int64)
    return SampleOutput(
        token_ids, _logprob_entries(logprobs, token_ids, cols) if logprobs is not None else ()
    )


def apply_penalties(logits: torch.Tensor, rows: list[PenaltyRow]) -> None:
    """Repetition (transformers' divide/multiply rule), then frequency and presence (subtractive)."""
    for row in rows:
        if not row.history:
            continue
        tokens = torch.tensor(row.history, dtype=torch.long, device=logits.device)
        counts = torch.bincount(tokens, minlength=logits.shape[-1]).to(logits.dtype)
        seen = counts > 0
        line = logits[row.index]
        p = row.params
        if p.repetition_penalty != 1.0:
            penalised = torch.where(line < 0, line * p.repetition_penalty, line / p.repetition_penalty)
            line = torch.where(seen, penalised, line)
        line = line - p.frequency_penalty * counts - p.presence_penalty * seen.to(logits.dtype)
        logits[row.index] = line


def apply_biases(logits: torch.Tensor, rows: list[BiasRow] | tuple[BiasRow, ...]) -> None:
    """Add each row's logit bias (OpenAI's logit_bias) to its logits; ids past the vocabulary (the
    control plane checks them, so only from a faulty one) are left out."""
    vocab = logits.shape[-1]
    for row in rows:
        keep = row.ids < vocab
        ids = torch.from_numpy(row.ids[keep]).to(logits.device)
        values = torch.from_numpy(row.values[keep]).to(logits.device, logits.dtype)
        logits[row.index].index_add_(0, ids, values)


def _subset(cols: SamplerColumns, index: np.ndarray) -> SamplerColumns:
    return SamplerColumns(
        temperature=cols.temperature[index],
        top_p=cols.top_p[index],
        top_k=cols.top_k[index],
        min_p=cols.min_p[index],
        has_seed=cols.has_seed[index],
        seed=cols.seed[index],
        logprobs=cols.logprobs[index],
    )


def filtered_probs(logits: torch.Tensor, cols: SamplerColumns) -> torch.Tensor:
    """The distribution a stochastic row draws from ([S, vocab], vocab order, zeros where filtered).

    Rows must have temperature > 0. This is what `sample` draws from after penalties; exposed so
    tests can compare it with transformers' warpers on the same logits.
    """
    probs, order = _sorted_filtered_probs(logits, cols)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def _sorted_filtered_probs(logits: torch.Tensor, cols: SamplerColumns) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 probabilities in descending-logit order, the vocab id at each sorted position)."""
    temperature = torch.from_numpy(cols.temperature).to(logits.device, torch.float32)
    sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    keep = _truncation_mask(sorted_logits, cols)
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1).double()
    return probs, order


def _sample_rows(logits: torch.Tensor, cols: SamplerColumns, uniforms: np.ndarray) -> torch.Tensor:
    device = logits.device
    probs, order = _sorted_filtered_probs(logits, cols)
    cdf = probs.cumsum(dim=-1)
    targets = torch.from_numpy(uniforms).to(device)[:, None] * cdf[:, -1:]
    # u > 0, so the first index whose cdf reaches the target always has positive probability.
    picked = torch.searchsorted(cdf, targets).clamp(max=logits.shape[-1] - 1)
    return order.gather(1, picked)[:, 0]


def _truncation_mask(sorted_logits: torch.Tensor, cols: SamplerColumns) -> torch.Tensor:
    """Which sorted candidates survive top-k, then top-p, then min-p; rank 0 always survives."""
    device = sorted_logits.device
    ranks = torch.arange(sorted_logits.shape[-1], device=device)[None, :]
    top_k = torch.from_numpy(cols.top_k).to(device)[:, None]
    keep = (top_k <= 0) | (ranks < top_k)
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    top_p = torch.from_numpy(cols.top_p).to(device, torch.float32)[:, None]
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (top_p >= 1.0) | (mass_before < top_p)
    min_p = torch.from_numpy(cols.min_p).to(device, torch.float32)[:, None]
    keep &= probs >= min_p * probs[:, :1]
    return keep


def draw_uniforms(
    has_seed: np.ndarray, seeds: np.ndarray, positions: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Uniforms in (0, 1]: hashed from (seed, position) for seeded rows, from `rng` otherwise."""
    seeded = seeded_uniforms(seeds, positions)
    unseeded = 1.0 - rng.random(len(has_seed))
    return np.where(has_seed, seeded, unseeded)


def seeded_uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """A deterministic uniform in (0, 1] per (seed, position) pair (splitmix64 finaliser, 53 bits)."""
    mixed = _splitmix64(seeds.astype(np.uint64) ^ _splitmix64(positions.astype(np.uint64)))
    return ((mixed >> np.uint64(11)).astype(np.float64) + 1.0) / float(2**53)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _logprob_entries(
    logprobs: torch.Tensor, token_ids: np.ndarray, cols: SamplerColumns
) -> tuple[TokenLogprobs, ...]:
    """One entry per row; rows that did not ask get the sampled token's logprob only."""
    top_n = max(0, int(cols.logprobs.max()) - 1)
    chosen = logprobs.gather(1, torch.from_numpy(token_ids).to(logprobs.device)[:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
    entries = []
    for i, logprob in enumerate(chosen):
        n = max(0, int(cols.logprobs[i]) - 1)
        ids = tuple(top_ids[i, :n].tolist()) if top_ids is not None and n else ()
        values = tuple(top_values[i, :n].tolist()) if top_values is not None and n else ()
        entries.append(TokenLogprobs(logprob=float(logprob), top_ids=ids, top_logprobs=values))
    return tuple(entries)
