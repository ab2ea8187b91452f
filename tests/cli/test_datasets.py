"""The bench workloads: lengths in range, ids above the special tokens, deterministic in seed."""

from __future__ import annotations

import pytest

from clients import datasets
from clients.datasets import BenchRequest


def _ids_in_vocab(requests: list[BenchRequest], vocab: int) -> bool:
    return all(3 <= t < vocab for r in requests for t in r.prompt_ids)


def test_random_lengths_lie_between_ratio_times_len_and_len() -> None:
    requests = datasets.random_requests(200, input_len=100, output_len=40, range_ratio=0.25, vocab=50, seed=1)
    prompt = [len(r.prompt_ids) for r in requests]
    output = [r.max_new_tokens for r in requests]
    assert min(prompt) >= 25 and max(prompt) <= 100
    assert min(output) >= 10 and max(output) <= 40
    assert len(set(prompt)) > 20  # drawn, not fixed
    assert _ids_in_vocab(requests, 50)
    assert all(r.group == -1 for r in requests)


def test_random_with_ratio_one_is_fixed_length_and_never_empty() -> None:
    fixed = datasets.random_requests(10, input_len=16, output_len=8, seed=2)
    assert {(len(r.prompt_ids), r.max_new_tokens) for r in fixed} == {(16, 8)}
    tiny = datasets.random_requests(50, input_len=3, output_len=1, range_ratio=0.0, seed=2)
    assert min(len(r.prompt_ids) for r in tiny) >= 1 and {r.max_new_tokens for r in tiny} == {1}


def test_shared_prefix_groups_share_their_system_prompt_and_interleave() -> None:
    requests = datasets.shared_prefix_requests(
        groups=3, prompts_per_group=4, system_prompt_len=20, question_len=5, output_len=7, vocab=100, seed=3
    )
    assert len(requests) == 12 and {r.max_new_tokens for r in requests} == {7}
    assert [r.group for r in requests[:6]] == [0, 1, 2, 0, 1, 2]
    assert all(len(r.prompt_ids) == 25 for r in requests)
    prefixes = {g: {tuple(r.prompt_ids[:20]) for r in requests if r.group == g} for g in range(3)}
    assert all(len(p) == 1 for p in prefixes.values())  # one system prompt per group
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # and different groups differ
    assert len({tuple(r.prompt_ids[20:]) for r in requests}) == 12  # every question its own
    assert _ids_in_vocab(requests, 100)


def test_uniform_lengths_lie_in_the_inclusive_ranges() -> None:
    requests = datasets.uniform_requests(64, prompt_len=(16, 128), output_len=(8, 256), seed=4)
    prompt = [len(r.prompt_ids) for r in requests]
    output = [r.max_new_tokens for r in requests]
    assert len(requests) == 64
    assert min(prompt) >= 16 and max(prompt) <= 128 and min(output) >= 8 and max(output) <= 256
    edges = datasets.uniform_requests(300, prompt_len=(2, 3), output_len=(5, 6), seed=4)
    assert {len(r.prompt_ids) for r in edges} == {2, 3} and {r.max_new_tokens for r in edges} == {5, 6}
    assert _ids_in_vocab(requests, 1000)


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: datasets.random_requests(20, 30, 10, 0.5, seed=seed),
        lambda seed: datasets.shared_prefix_requests(2, 5, 10, 4, 3, seed=seed),
        lambda seed: datasets.uniform_requests(20, (4, 30), (1, 10), seed=seed),
    ],
    ids=["random", "generated-shared-prefix", "uniform"],
)
def test_every_dataset_is_deterministic_in_seed(make) -> None:  # type: ignore[no-untyped-def]
    assert make(7) == make(7)
    assert make(7) != make(8)


def test_a_vocab_with_only_special_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab"):
        datasets.uniform_requests(1, (1, 1), (1, 1), vocab=3)
