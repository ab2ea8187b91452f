"""Batched token sampling: penalties, greedy, temperature, top-k, top-p, min-p, seeded draws.

Order of operations (as transformers' processors and warpers apply them): penalties on the raw
logits, then the logit bias (OpenAI's `logit_bias`), then the grammar mask of a constrained row
(data_plane/constraints.py: every token the grammar does not allow next gets -inf), then
temperature, top-k, top-p and min-p, then one draw. Greedy rows are masked too.

Logprobs (SamplerParams.logprobs > 0 for some row of the step; otherwise none are computed, so a
step that asks for none pays nothing): every row then gets an entry, with the sampled token's
logprob, its `logprobs - 1` top alternatives (most likely first) and the logprobs of its
`token_ids_logprob` ids (an id outside the vocabulary reports -inf). A row's mode decides what they
are the log-softmax of: raw (the default) is the model's logits before penalties and bias; processed
(`processed_logprobs`) is what sampling draws from, after penalties, bias, temperature (none for a
greedy row), top-k, top-p and min-p, with -inf for every filtered token.

Reproducibility: a seeded row's draw uses a uniform number computed from (seed, position of the
token being sampled) by a counter-based hash, not from a shared generator stream. So the same
seed gives the same tokens whatever else is in the batch, and after a retraction and re-prefill.
The draw itself is an inverse-CDF lookup over the filtered distribution, batched for all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from data_plane.constraints import GrammarMasks
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
    logprob_ids: Sequence[np.ndarray] = (),
    grammar_masks: GrammarMasks | None = None,
) -> SampleOutput:
    """Pick one token per row of `logits` ([S, vocab], float32; modified in place by penalties and
    biases).

    `positions[i]` is the position the sampled token will take in its sequence (the seed's counter).
    `logprob_ids[i]` (empty, or one array per row) are row i's token_ids_logprob.
    """
    wants_logprobs = int(cols.logprobs.max(initial=0)) > 0
    # Raw logprobs before penalties and bias, which change `logits` in place.
    logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
    apply_penalties(logits, penalties)
    apply_biases(logits, biases)
    if grammar_masks is not None:
        apply_grammar_masks(logits, grammar_masks)
    if logprobs is not None and cols.processed is not None:
        processed = np.flatnonzero(cols.processed)
        if len(processed):
            index = torch.from_numpy(processed).to(logits.device)
            logprobs[index] = processed_logprobs(logits[index], _subset(cols, processed))
    tokens = logits.argmax(dim=-1)
    stochastic = np.flatnonzero(cols.temperature > 0)
    if len(stochastic):
        uniforms = draw_uniforms(cols.has_seed[stochastic], cols.seed[stochastic], positions[stochastic], rng)
        index = torch.from_numpy(stochastic).to(logits.device)
        tokens[index] = _sample_rows(logits[index], _subset(cols, stochastic), uniforms)
    token_ids = tokens.cpu().numpy().astype(np.int64)
    if logprobs is None:
        return SampleOutput(token_ids, ())
    return SampleOutput(token_ids, _logprob_entries(logprobs, token_ids, cols, logprob_ids))


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


def apply_grammar_masks(logits: torch.Tensor, masks: GrammarMasks) -> None:
    """Set to -inf the logits of every token a constrained row's grammar does not allow next.

    On CPU the bitmask is unpacked by numpy (bit j of word w is token 32·w + j, so the words'
    little-endian bytes unpack with bitorder "little"); on a GPU the words are copied over and
    unpacked there by shifts, so only ceil(vocab / 32) int32 words per row cross the bus.
    """
    vocab = logits.shape[-1]
    index = torch.from_numpy(masks.index).to(logits.device)
    if logits.device.type == "cpu":
        bits = np.unpackbits(masks.words.view(np.uint8), axis=1, count=vocab, bitorder="little")
        allowed = torch.from_numpy(bits.view(np.bool_))
    else:
        words = torch.from_numpy(masks.words).to(logits.device, non_blocking=True)
        shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(masks.index), -1)[:, :vocab].bool()
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))


def _subset(cols: SamplerColumns, index: np.ndarray) -> SamplerColumns:
    return SamplerColumns(
        temperature=cols.temperature[index],
        top_p=cols.top_p[index],
        top_k=cols.top_k[index],
        min_p=cols.min_p[index],
        has_seed=cols.has_seed[index],
        seed=cols.seed[index],
        logprobs=cols.logprobs[index],
        processed=cols.processed[index] if cols.processed is not None else None,
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


def processed_logprobs(logits: torch.Tensor, cols: SamplerColumns) -> torch.Tensor:
    """log_softmax of the logits sampling draws from ([S, vocab], vocab order, -inf where filtered):
    divided by the temperature (not for greedy rows), then top-k, top-p and min-p."""
    temperature = np.where(cols.temperature > 0, cols.temperature, 1.0)
    scale = torch.from_numpy(temperature).to(logits.device, torch.float32)
    sorted_logits, order = (logits / scale[:, None]).sort(dim=-1, descending=True)
    keep = _truncation_mask(sorted_logits, cols)
    sorted_logprobs = torch.log_softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.empty_like(sorted_logprobs).scatter_(1, order, sorted_logprobs)


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
    logprobs: torch.Tensor, token_ids: np.ndarray, cols: SamplerColumns, logprob_ids: Sequence[np.ndarray]
) -> tuple[TokenLogprobs, ...]:
    """One entry per row; rows that did not ask get the sampled token's logprob only."""
    asks = cols.logprobs > 0
    ids_values: list[tuple[float, ...]] = [()] * len(token_ids)
    for i in np.flatnonzero(asks).tolist() if len(logprob_ids) else ():
        if len(logprob_ids[i]):
            ids_values[i] = tuple(ids_logprobs(logprobs[i : i + 1], logprob_ids[i])[0].tolist())
    return logprob_rows(logprobs, token_ids, np.maximum(cols.logprobs - 1, 0), ids_values)


def ids_logprobs(logprobs: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
    """logprobs[:, ids] ([R, len(ids)]), with -inf for ids outside the vocabulary."""
    vocab = logprobs.shape[-1]
    ids = np.asarray(ids, dtype=np.int64)
    valid = (ids >= 0) & (ids < vocab)
    index = torch.from_numpy(np.where(valid, ids, 0)).to(logprobs.device)
    mask = torch.from_numpy(valid).to(logprobs.device)
    return logprobs[:, index].masked_fill(~mask, float("-inf"))


def logprob_rows(
    logprobs: torch.Tensor,
    chosen: np.ndarray,
    top_n: np.ndarray,
    ids_values: Sequence[tuple[float, ...]],
) -> tuple[TokenLogprobs, ...]:
    """TokenLogprobs for each row of `logprobs` ([R, vocab]): the logprob of chosen[i], the top_n[i]
    best alternatives (most likely first), and ids_values[i] (already gathered)."""
    device = logprobs.device
    index = torch.from_numpy(np.asarray(chosen, dtype=np.int64)).to(device)[:, None]
    picked = logprobs.gather(1, index)[:, 0].tolist()
    k = min(int(top_n.max(initial=0)), logprobs.shape[-1])
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        values, indices = _top_k(logprobs, k)
        top_values, top_ids = values.tolist(), indices.tolist()
    entries = []
    for i, logprob in enumerate(picked):
        n = int(top_n[i])
        entries.append(
            TokenLogprobs(
                logprob=float(logprob),
                top_ids=tuple(top_ids[i][:n]) if n else (),
                top_logprobs=tuple(top_values[i][:n]) if n else (),
                ids_logprobs=ids_values[i],
            )
        )
    return tuple(entries)


def _top_k(logprobs: torch.Tensor, k: int) -> tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]:
    """The k largest values per row and their ids, largest first. On CPU numpy's argpartition then a
    sort of the k (about half the time of torch.topk there: 1.6 against 3.1 ms for 256 x 1024, k 20,
    one thread); elsewhere torch.topk."""
    if logprobs.device.type != "cpu" or k >= logprobs.shape[-1]:
        return logprobs.topk(k, dim=-1)
    array = logprobs.numpy()
    ids = np.argpartition(-array, k - 1, axis=1)[:, :k]
    values = np.take_along_axis(array, ids, axis=1)
    order = np.argsort(-values, axis=1, kind="stable")
    return np.take_along_axis(values, order, axis=1), np.take_along_axis(ids, order, axis=1)
