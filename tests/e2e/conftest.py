"""End-to-end fixtures: real processes on 127.0.0.1 with ephemeral ports, always stopped."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from stepwise.embedded import resolve_model
from stepwise.up import Stack

# --strict-invariants: the KV pool invariants are checked after every step; a violation ends the run.
CONTROL_BASE = [
    "--host",
    "127.0.0.1",
    "--port",
    "0",
    "--worker-port",
    "0",
    "--log-level",
    "warning",
    "--strict-invariants",
]
WORKER_BASE = ["--log-level", "warning"]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model("embedded")


@functools.cache
def reference_model(model_dir: Path):  # type: ignore[no-untyped-def]
    """transformers' own model on the same checkpoint (float32, CPU), loaded once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_greedy(
    model_dir: Path, prompt_ids: Sequence[int], max_new_tokens: int, eos: set[int], ignore_eos: bool = False
) -> list[int]:
    """Greedy tokens transformers' generate() produces for this prompt alone, EOS not included."""
    import copy

    import torch

    model = reference_model(model_dir)
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens = False, max_new_tokens
    config.pad_token_id = min(eos) if eos else 0
    if ignore_eos:
        # None falls back to the model's EOS; an id no token has never stops (transformers warns).
        config.eos_token_id = -1
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            generation_config=config,
        )
    tokens = out[0, len(prompt_ids) :].tolist()
    if ignore_eos:
        return tokens
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


StackFactory = Callable[..., "AsyncIterator[Stack]"]


@pytest.fixture
async def start_stack() -> AsyncIterator[Callable[..., object]]:
    """`stack = await start_stack(control_flags, worker_flags, workers=1)`; all stopped at teardown."""
    stacks: list[Stack] = []

    async def start(control: Sequence[str] = (), worker: Sequence[str] = (), workers: int = 1) -> Stack:
        stack = Stack([*CONTROL_BASE, *control], [*WORKER_BASE, *worker], workers)
        stacks.append(stack)
        await stack.start(timeout=120)
        return stack

    try:
        yield start
    finally:
        for stack in stacks:
            stack.stop()
