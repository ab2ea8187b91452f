"""Prompt scoring's plan side: which flat rows of a step's extends are scored, against which tokens.

An extend entry i with score_lens[i] > 0 scores positions score_starts[i] .. score_starts[i] +
score_lens[i] - 1, all inside its extend [starts[i], starts[i] + lens[i]). Position p is scored
against the token at p + 1: that token is in the entry's token_ids while p + 1 is inside the extend,
else it is next_ids[i] (which must then be >= 0). Numpy only, so the sim backend shares the checks
with the real executor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data_plane.state import PlanError
from protos.worker import ExtendWork


@dataclass(frozen=True, slots=True)
class ScoreRows:
    """The scored rows of a step, entry by entry (entries in plan order, rows in position order)."""

    entries: np.ndarray  # int64 [E]: the extend entries that score
    counts: np.ndarray  # int64 [E]: rows of each (score_lens)
    flat_index: np.ndarray  # int64 [sum(counts)]: each row's index among the step's extend tokens
    targets: np.ndarray  # int64 [sum(counts)]: the token each row is scored against


def score_rows(ext: ExtendWork) -> ScoreRows | None:
    """The step's scored rows; None when no entry scores. PlanError (changing nothing) when the score
    columns are malformed or ask for a row the plan cannot score."""
    n = len(ext.handles)
    columns = (ext.score_starts, ext.score_lens, ext.next_ids)
    if all(len(c) == 0 for c in columns):
        return None
    if any(len(c) != n for c in columns):
        raise PlanError(f"score_starts/score_lens/next_ids must be empty or have one value per extend ({n})")
    lens = ext.score_lens.astype(np.int64)
    if int(lens.min(initial=0)) < 0:
        raise PlanError("an extend entry has a negative score_lens")
    entries = np.flatnonzero(lens > 0)
    if not len(entries):
        return None
    starts = ext.starts.astype(np.int64)[entries]
    ends = starts + ext.lens.astype(np.int64)[entries]
    first = ext.score_starts.astype(np.int64)[entries]
    counts = lens[entries]
    outside = np.flatnonzero((first < starts) | (first + counts > ends))
    if len(outside):
        i = int(entries[outside[0]])
        raise PlanError(
            f"extend {i} (handle {ext.handles[i]}) scores positions [{first[outside[0]]}, "
            f"{first[outside[0]] + counts[outside[0]]}) outside its extend [{starts[outside[0]]}, "
            f"{ends[outside[0]]})"
        )
    next_ids = ext.next_ids.astype(np.int64)[entries]
    at_end = first + counts == ends
    unknown = np.flatnonzero(at_end & (next_ids < 0))
    if len(unknown):
        i = int(entries[unknown[0]])
        raise PlanError(
            f"extend {i} (handle {ext.handles[i]}) scores its last position {ends[unknown[0]] - 1} "
            "but gives no next_ids token after it"
        )
    offsets = (np.cumsum(ext.lens.astype(np.int64)) - ext.lens)[entries]
    local_first = first - starts  # first scored row inside the entry's tokens
    total = int(counts.sum())
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    flat_index = np.repeat(offsets + local_first, counts) + within
    token_ids = ext.token_ids.astype(np.int64)
    # The next token of every row but an entry's extend-final one is the next flat token; that one's
    # index would run into the following entry (or past the array), so it takes next_ids instead.
    last_flat = np.repeat(offsets + (ends - starts) - 1, counts)
    targets = token_ids[np.minimum(flat_index + 1, len(token_ids) - 1)]
    targets = np.where(flat_index == last_flat, np.repeat(next_ids, counts), targets)
    return ScoreRows(entries=entries.astype(np.int64), counts=counts, flat_index=flat_index, targets=targets)
