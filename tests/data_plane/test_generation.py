"""Multi-step generation through the executor: greedy equals transformers, seeds are batch-independent."""

from __future__ import annotations

import pathlib

import pytest
import torch

from protos.worker import SamplerParams, sampled_handles
from tests.data_plane.factories import Driver, Extend, SlotAllocator, hf_next_logits, make_plan, new_seq

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


def test_repetition_penalty_greedy_matches_transformers_generate(make_driver, hf_model, prompt_ids) -> None:
    """Penalties count prompt and generated tokens, as RepetitionPenaltyLogitsProcessor does in generate."""
    prompts = {1: prompt_ids[1], 4: prompt_ids[4]}
    samplers = {h: SamplerParams(repetition_penalty=1.8) for h in prompts}
    ours = _generate_all(make_driver(page_size=4), prompts, samplers)
    for handle, prompt in prompts.items():
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, repetition_penalty=1.8
            )
        assert _up_to_eos(ours[handle]) == _up_to_eos(out[0, len(prompt) :].tolist()), f"handle {handle}"


def test_frequency_and_presence_greedy_follow_the_openai_rule(make_driver, hf_model, prompt_ids) -> None:
    """Greedy over transformers' logits - 0.6 * count - 0.9 * (count > 0) of the whole context."""
    prompt = prompt_ids[3]
    params = SamplerParams(frequency_penalty=0.6, presence_penalty=0.9)
    ours = _generate_all(make_driver(), {1: prompt}, {1: params})[1]
    context = list(prompt)
    for _ in range(NEW_TOKENS):
        counts = torch.bincount(torch.tensor(context), minlength=hf_model.config.vocab_size).float()
        penalised = hf_next_logits(hf_model, context) - 0.6 * counts - 0.9 * (counts > 0).float()
        context.append(int(penalised.argmax()))
    assert ours == context[len(prompt) :]


SEEDED_FILTERS = SamplerParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=777)


def test_seeded_request_joining_a_busy_batch_in_chunks_samples_as_alone(make_executor, prompt_ids) -> None:
    """Alone (one prefill, page size 1) vs. arriving at step 3 into decoding neighbours with other
    samplers, its prompt cut in two chunks, on page size 16: the same tokens."""
    alone = _seeded_alone(make_executor(seed=1), prompt_ids[4])
    assert alone == _seeded_in_busy_batch(make_executor(seed=2), prompt_ids, prompt_ids[4])


def _seeded_alone(executor, prompt: list[int]) -> list[int]:
    slots = SlotAllocator(4096, 1, seed=1)
    plan = make_plan(
        1, new_seqs=[new_seq(9, SEEDED_FILTERS)], extends=[Extend(9, 0, prompt, slots.alloc(9, len(prompt)))]
    )
    tokens = [_sampled(executor, plan)[9]]
    for step in range(2, NEW_TOKENS + 1):
        tokens.append(_sampled(executor, make_plan(step, decodes=[(9, int(slots.alloc(9, 1)[0]))]))[9])
    return tokens


def _seeded_in_busy_batch(executor, prompt_ids: dict[int, list[int]], prompt: list[int]) -> list[int]:
    slots = SlotAllocator(4096, 16, seed=5)
    neighbours = {1: SamplerParams(temperature=1.2), 2: SamplerParams(repetition_penalty=1.3), 3: SEEDED}
    plan = make_plan(
        1,
        new_seqs=[new_seq(h, p) for h, p in neighbours.items()],
        extends=[Extend(h, 0, prompt_ids[h], slots.alloc(h, len(prompt_ids[h]))) for h in neighbours],
    )
    _sampled(executor, plan)
    _sampled(executor, make_plan(2, decodes=[(h, int(slots.alloc(h, 1)[0])) for h in (3, 1, 2)]))
    cut = len(prompt) // 2
    first_chunk = Extend(9, 0, prompt[:cut], slots.alloc(9, cut), sample=False)
    plan = make_plan(
        3, new_seqs=[new_seq(9, SEEDED_FILTERS)], extends=[first_chunk], decodes=_decodes(slots, (1, 2, 3))
    )
    _sampled(executor, plan)
    rest = Extend(9, cut, prompt[cut:], slots.alloc(9, len(prompt) - cut))
    tokens = [_sampled(executor, make_plan(4, extends=[rest], decodes=_decodes(slots, (2, 3))))[9]]
    for step in range(5, NEW_TOKENS + 4):
        # Neighbours leave one by one; the batch around handle 9 keeps changing.
        members = [h for h in (1, 2, 3) if h > step - 5] + [9]
        tokens.append(_sampled(executor, make_plan(step, decodes=_decodes(slots, members)))[9])
    return tokens


def _decodes(slots: SlotAllocator, handles) -> list[tuple[int, int]]:
    return [(h, int(slots.alloc(h, 1)[0])) for h in handles]


def _sampled(executor, plan) -> dict[int, int]:
    result = executor.execute(plan)
    assert result.error == "", result.error
    return dict(zip(sampled_handles(plan).tolist(), result.token_ids.tolist(), strict=True))
