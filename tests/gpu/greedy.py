"""Greedy tokens of our Executor next to transformers' `generate`, shared by the CUDA tests and the report.

A divergence is allowed only at a genuine near-tie: at the first differing position, transformers'
own logits for the two tokens are within LOGITS_TOLERANCE, so rounding may break the tie either
way (tests/gpu/test_cuda_bf16.py explains the bfloat16 tolerance).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tests.data_plane.factories import Driver

LOGITS_TOLERANCE = 0.125


@dataclass(frozen=True, slots=True)
class GreedyComparison:
    """One prompt's new tokens on both sides and, if they differ, how close the first split was."""

    handle: int
    prompt_len: int
    ours: list[int]
    theirs: list[int]
    first_divergence: int | None  # index into the new tokens; None when equal
    tie_gap: float | None  # |transformers' logit(ours) - logit(theirs)| at that index

    @property
    def equal(self) -> bool:
        return self.first_divergence is None

    @property
    def ok(self) -> bool:
        """Equal, or split at a near-tie that rounding may break either way."""
        return self.tie_gap is None or self.tie_gap < LOGITS_TOLERANCE


def reference_next_logits(reference: Any, tokens: Sequence[int]) -> torch.Tensor:
    """transformers' float32 logits on the CPU for the token after `tokens` (full recompute)."""
    with torch.no_grad():
        ids = torch.tensor([list(tokens)], device=reference.device)
        return reference(input_ids=ids).logits[0, -1].float().cpu()


def reference_greedy(reference: Any, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """transformers' `generate(do_sample=False)` for exactly `new_tokens` tokens (no early stop)."""
    with torch.no_grad():
        ids = torch.tensor([list(prompt)], device=reference.device)
        out = reference.generate(ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return out[0, len(prompt) :].tolist()


def compare_greedy(
    driver: Driver, reference: Any, prompts: Mapping[int, Sequence[int]], new_tokens: int
) -> list[GreedyComparison]:
    """Prefill every prompt in one batch, decode them together, and compare each with transformers."""
    driver.prefill(dict(prompts))
    for _ in range(new_tokens - 1):
        driver.decode(list(prompts))
    return [
        _compare(handle, prompt, driver.tokens[handle][len(prompt) :], reference, new_tokens)
        for handle, prompt in prompts.items()
    ]


def _compare(
    handle: int, prompt: Sequence[int], ours: list[int], reference: Any, new_tokens: int
) -> GreedyComparison:
    theirs = reference_greedy(reference, prompt, new_tokens)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    gap = None
    if first is not None:
        logits = reference_next_logits(reference, [*prompt, *theirs[:first]])
        gap = abs(logits[ours[first]].item() - logits[theirs[first]].item())
    return GreedyComparison(handle, len(prompt), ours, theirs, first, gap)
