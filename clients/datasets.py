"""Synthetic workloads for `stepwise bench`, after SGLang's `bench_serving` datasets.

Every function is deterministic in `seed`. Token ids are drawn from [3, vocab): the ids below 3
are the embedded model's special tokens, and a prompt of random ids must not contain an EOS.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_TOKEN_ID = 3  # ids below this are special tokens (pad, bos, eos) of the embedded model


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    group: int = -1  # shared-prefix group, -1 for none
    rid: str = ""  # the request id sent (a trace's; "": the server names it)
    arrival: float | None = None  # seconds after the start when it is sent (a trace's; None: as paced)
    routing_key: str = ""  # which worker the fleet's router sends it to (a trace's; "": its own choice)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


def _check_vocab(vocab: int) -> None:
    if vocab <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab must be above {FIRST_TOKEN_ID}, got {vocab}")


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 1.0,
    vocab: int = 1000,
    seed: int = 0,
) -> list[BenchRequest]:
    """SGLang's `random`: each length uniform in [max(1, int(len * range_ratio)), len]."""
    _check_vocab(vocab)
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt_len = rng.randint(max(1, int(input_len * range_ratio)), max(1, input_len))
        max_new = rng.randint(max(1, int(output_len * range_ratio)), max(1, output_len))
        requests.append(BenchRequest(_ids(rng, prompt_len, vocab), max_new))
    return requests


def shared_prefix_requests(
    groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    vocab: int = 1000,
    seed: int = 0,
) -> list[BenchRequest]:
    """SGLang's `generated-shared-prefix`: per group one random system prompt, per prompt that
    prefix plus a random question.

    Requests come round-robin across groups (group 0, 1, ..., 0, 1, ...), so that a run with
    more requests in flight than groups has several prompts of a group in flight at once: the
    case the prefix cache must share.
    """
    _check_vocab(vocab)
    rng = random.Random(seed)
    prefixes = [_ids(rng, system_prompt_len, vocab) for _ in range(groups)]
    requests = []
    for _ in range(prompts_per_group):
        for group, prefix in enumerate(prefixes):
            question = _ids(rng, question_len, vocab)
            requests.append(BenchRequest(prefix + question, output_len, group))
    return requests


def uniform_requests(
    num: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int = 1000,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompt and output lengths uniform in the inclusive ranges (the issue's workload:
    64 requests, prompts 16-128, outputs 8-256)."""
    _check_vocab(vocab)
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        ids = _ids(rng, rng.randint(*prompt_len), vocab)
        requests.append(BenchRequest(ids, rng.randint(*output_len)))
    return requests
