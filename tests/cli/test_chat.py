"""`stepwise chat`: each turn renders the whole history through the model's template; /reset starts
over; a refused turn is reported and not kept. Spoken to a stand-in control plane, so the test sees
every prompt chat sends. (tests/e2e/test_chat_cli.py runs the real command on a real stack.)"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

from clients.client import StepwiseClient, sampling_params
from gateway.chat import load_template
from stepwise.chat import Conversation, converse
from stepwise.models import resolve_model
from tests.cli.fake_server import CANNED_TEXT, serve_fake
from tests.cli.runner import run_cli
from tests.cli.test_errors import assert_one_line


def _conversation(system: str | None = None) -> Conversation:
    template = load_template(resolve_model("embedded"))
    assert template is not None
    return Conversation(template, system)


async def _chat(lines: str, conversation: Conversation, refuse_every: int = 0) -> tuple[list[str], str, int]:
    out = io.StringIO()
    async with serve_fake(refuse_every=refuse_every) as fake, StepwiseClient(fake.address) as client:
        turns = await converse(
            client, conversation, sampling_params(max_new_tokens=8), io.StringIO(lines), out
        )
        return fake.prompts, out.getvalue(), turns


async def test_each_turn_sends_the_history_and_reset_forgets_it() -> None:
    conversation = _conversation(system="Be brief.")
    prompts, out, turns = await _chat("Hi\nHow are you?\n/reset\nAgain\n", conversation)
    render = conversation.template.render
    system = {"role": "system", "content": "Be brief."}
    first = [system, {"role": "user", "content": "Hi"}]
    assert prompts == [
        render(first),
        render(
            [
                *first,
                {"role": "assistant", "content": CANNED_TEXT},
                {"role": "user", "content": "How are you?"},
            ]
        ),
        render([system, {"role": "user", "content": "Again"}]),
    ]
    assert turns == 3 and out.count(f"assistant> {CANNED_TEXT}\n") == 3 and "[conversation cleared]" in out


async def test_a_refused_turn_is_reported_and_not_kept() -> None:
    conversation = _conversation()
    prompts, out, turns = await _chat("one\ntwo\nthree\n/exit\nnever read\n", conversation, refuse_every=2)
    assert "[refused: RESOURCE_EXHAUSTED: the queue is full; this turn is not kept]" in out
    assert len(prompts) == 3 and turns == 2
    assert "two" not in prompts[2] and "one" in prompts[2] and "three" in prompts[2]


async def test_unknown_slash_commands_and_blank_lines_send_nothing() -> None:
    prompts, out, turns = await _chat("\n/help\n", _conversation())
    assert prompts == [] and turns == 0 and "/reset clears the conversation" in out


def test_no_server_at_the_address_is_one_line() -> None:
    result = run_cli(["chat", "--address", "127.0.0.1:1", "--wait", "1"])
    assert_one_line(result.returncode, result.stderr, "127.0.0.1:1", "no control plane serving")


def test_a_model_without_a_chat_template_is_one_line(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(resolve_model("embedded"), model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    fields = json.loads((model / "tokenizer_config.json").read_text())
    fields.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(fields))
    result = run_cli(["chat", "--model", str(model), "--address", "127.0.0.1:1"])
    assert_one_line(result.returncode, result.stderr, "--model", "has no chat template")


def test_every_sampling_flag_reaches_the_request() -> None:
    """chat parses generate's sampling flags; --stop and --ignore-eos were parsed and then dropped."""
    import argparse

    from clients.generate import sampling_from_args
    from stepwise import chat

    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    flags = ["--stop", "END", "--ignore-eos", "--temperature", "0.5", "--top-k", "3", "--seed", "9"]
    sampling = sampling_from_args(parser.parse_args(flags))
    assert list(sampling.stop) == ["END"] and sampling.ignore_eos
    assert (sampling.temperature, sampling.top_k, sampling.seed, sampling.max_new_tokens) == (0.5, 3, 9, 256)
