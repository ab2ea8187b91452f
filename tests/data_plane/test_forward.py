"""Our paged, ragged forward against transformers' LlamaForCausalLM on the embedded checkpoint."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.data_plane.factories import Extend, SlotAllocator, hf_next_logits, make_plan, new_seq

FLOAT32_TOLERANCE = 1e-4


def _random_tokens(rng: np.random.Generator, n: int, vocab: int = 1024) -> list[int]:
    return rng.integers(1, vocab, size=n).tolist()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_step_matches_transformers(make_executor, hf_model, page_size: int) -> None:
    """One step with fresh prompts, a cached-prefix prompt, a second chunk and several decodes."""
    rng = np.random.default_rng(page_size)
    executor = make_executor(capacity=2048)
    slots = SlotAllocator(2048, page_size, seed=page_size)
    prompts = {1: _random_tokens(rng, 12), 2: _random_tokens(rng, 7), 3: _random_tokens(rng, 5)}
    chunked = _random_tokens(rng, 20)
    step1 = make_plan(
        1,
        extends=[
            *(Extend(h, 0, p, slots.alloc(h, len(p))) for h, p in prompts.items()),
            Extend(4, 0, chunked[:8], slots.alloc(4, 8), sample=False),
        ],
        new_seqs=[new_seq(h) for h in (1, 2, 3, 4)],
    )
    first = executor.execute(step1)
    assert first.error == ""
    assert len(first.token_ids) == 3  # the non-final chunk of handle 4 samples nothing
    tokens = {h: [*p, t] for (h, p), t in zip(prompts.items(), first.token_ids.tolist(), strict=True)}

    # Handle 5 reuses handle 1's first 8 slots as its cached prefix (same 8 tokens).
    shared_prefix = executor.table.slot_table(1)[:8]
    tail5 = _random_tokens(rng, 6)
    fresh6 = _random_tokens(rng, 9)
    step2 = make_plan(
        2,
        new_seqs=[new_seq(5, prefix_slots=shared_prefix), new_seq(6)],
        extends=[
            Extend(5, 8, tail5, slots.alloc(5, 6)),
            Extend(4, 8, chunked[8:], slots.alloc(4, 12)),
            Extend(6, 0, fresh6, slots.alloc(6, 9)),
        ],
        decodes=[(h, int(slots.alloc(h, 1)[0])) for h in (3, 1, 2)],
    )
    ours = executor.forward_logits(step2)
    contexts = [prompts[1][:8] + tail5, chunked, fresh6, tokens[3], tokens[1], tokens[2]]
    reference = torch.stack([hf_next_logits(hf_model, ctx) for ctx in contexts])
    diff = (ours - reference).abs().max().item()
    assert diff < FLOAT32_TOLERANCE, f"max abs logits diff {diff}"


def test_long_prompt_in_chunks_matches_single_forward(make_executor, hf_model) -> None:
    """Three chunks of one prompt, in three steps, give the logits of one full forward."""
    rng = np.random.default_rng(7)
    prompt = _random_tokens(rng, 90)
    executor = make_executor(capacity=1024)
    slots = SlotAllocator(1024, 4, seed=3)
    cuts = [0, 30, 61, 90]
    logits = None
    for step, (a, b) in enumerate(itertools.pairwise(cuts), start=1):
        last = b == len(prompt)
        plan = make_plan(
            step,
            new_seqs=[new_seq(9)] if a == 0 else [],
            extends=[Extend(9, a, prompt[a:b], slots.alloc(9, b - a), sample=last)],
        )
        logits = executor.forward_logits(plan)
    assert logits is not None
    assert (logits[0] - hf_next_logits(hf_model, prompt)).abs().max().item() < FLOAT32_TOLERANCE


def test_only_sampling_rows_get_logits(make_executor) -> None:
    executor = make_executor(capacity=256)
    slots = SlotAllocator(256)
    plan = make_plan(
        1,
        new_seqs=[new_seq(1), new_seq(2)],
        extends=[
            Extend(1, 0, [5, 6, 7], slots.alloc(1, 3), sample=False),
            Extend(2, 0, [8, 9], slots.alloc(2, 2)),
        ],
    )
    assert executor.forward_logits(plan).shape == (1, 1024)
