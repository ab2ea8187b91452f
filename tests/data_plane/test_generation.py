"""Multi-step generation through the executor: greedy equals transformers, seeds are batch-independent."""

from __future__ import annotations

import pathlib

import pytest
import torch

from data_plane.messages import SamplerParams
from tests.data_plane.factories import Driver

PROMPTS = (
    "The baker",
    "In the winter there was snow. It came",
    "A computer is a machine that",
    "The children of the village went to school in a long low building at the end of the",
)
NEW_TOKENS = 12
EOS = 0


@pytest.fixture(scope="module")
def prompt_ids(model_dir: pathlib.Path) -> dict[int, list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return {handle: tokenizer(text).input_ids for handle, text in enumerate(PROMPTS, start=1)}


def _up_to_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def _generate_all(
    driver: Driver, prompts: dict[int, list[int]], samplers=None, steps: int = NEW_TOKENS
) -> dict:
    driver.prefill(prompts, samplers)
    for _ in range(steps - 1):
        driver.decode(list(prompts))
    return {h: driver.tokens[h][len(p) :] for h, p in prompts.items()}


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_transformers_generate(make_driver, hf_model, prompt_ids, page_size: int) -> None:
    ours = _generate_all(make_driver(page_size=page_size, seed=page_size), prompt_ids)
    for handle, prompt in prompt_ids.items():
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS)
        expected = out[0, len(prompt) :].tolist()
        assert _up_to_eos(ours[handle]) == _up_to_eos(expected), f"handle {handle}"


SEEDED = SamplerParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234)


def test_seeded_sampling_ignores_batch_makeup(make_driver, prompt_ids) -> None:
    alone = _generate_all(make_driver(seed=1), {7: prompt_ids[2]}, {7: SEEDED})
    others = {h: p for h, p in prompt_ids.items() if h != 2}
    mixed_samplers = {
        7: SEEDED,
        1: SamplerParams(temperature=0.7),
        3: SamplerParams(temperature=1.3, seed=99),
    }
    batched = _generate_all(make_driver(page_size=4, seed=2), {**others, 7: prompt_ids[2]}, mixed_samplers)
    assert batched[7] == alone[7]


def test_seeded_sampling_survives_retraction(make_driver, prompt_ids) -> None:
    """Re-prefilling prompt + tokens so far (as after a retraction) continues the same stream."""
    full = _generate_all(make_driver(seed=3), {1: prompt_ids[1]}, {1: SEEDED})[1]
    first = _generate_all(make_driver(seed=4), {1: prompt_ids[1]}, {1: SEEDED}, steps=5)[1]
    resumed_prompt = prompt_ids[1] + first
    rest = _generate_all(make_driver(seed=5), {1: resumed_prompt}, {1: SEEDED}, steps=NEW_TOKENS - 5)[1]
    assert first + rest == full


def test_different_seeds_differ(make_driver, prompt_ids) -> None:
    samplers = {1: SamplerParams(temperature=1.5, seed=1), 2: SamplerParams(temperature=1.5, seed=2)}
    out = _generate_all(make_driver(), {1: prompt_ids[4], 2: prompt_ids[4]}, samplers)
    assert out[1] != out[2]


def test_tiny_temperature_equals_greedy(make_driver, prompt_ids) -> None:
    greedy = _generate_all(make_driver(), {1: prompt_ids[3]})
    cold = _generate_all(make_driver(), {1: prompt_ids[3]}, {1: SamplerParams(temperature=1e-5)})
    assert cold == greedy
