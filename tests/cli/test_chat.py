"""`stepwise chat`: each turn renders the whole history through the model's template; /reset starts
over; a refused turn is reported and not kept. Spoken to a stand-in control plane, so the test sees
every prompt chat sends. (tests/e2e/test_chat_cli.py runs the real command on a real stack.)"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
from pathlib import Path

from clients.client import StepwiseClient, sampling_params
from gateway.chat import load_template
from protos.stepwise.v1 import generation_pb2 as gen_pb
from stepwise.chat import Conversation, Interrupts, converse
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


class _SlowCall:
    """A Generate call that sends one chunk, then nothing until it is cancelled (or finishes at once
    with `reason`)."""

    def __init__(self, reason: int | None) -> None:
        self.reason, self.cancelled = reason, False

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        chunk = gen_pb.TokenChunk(token_ids=[5], text="Once upon")
        yield gen_pb.GenerateResponse(request_id="r", chunk=chunk)
        if self.reason is None:
            await asyncio.Event().wait()
        usage = gen_pb.Usage(prompt_tokens=3, completion_tokens=1)
        finished = gen_pb.Finished(reason=self.reason, message="max_new_tokens", usage=usage)
        yield gen_pb.GenerateResponse(request_id="r", finished=finished)

    def cancel(self) -> None:
        self.cancelled = True


class _SlowClient:
    def __init__(self, *reasons: int | None) -> None:
        self.calls = [_SlowCall(reason) for reason in reasons]
        self.started = 0

    def stream(self, request: gen_pb.GenerateRequest) -> _SlowCall:
        self.started += 1
        return self.calls[self.started - 1]


async def test_ctrl_c_during_a_reply_cancels_its_call_and_the_prompt_returns() -> None:
    client = _SlowClient(None, gen_pb.FINISH_REASON_LENGTH)
    out, interrupts = io.StringIO(), Interrupts()
    talk = asyncio.ensure_future(
        converse(
            client, _conversation(), sampling_params(), io.StringIO("Tell\nAgain\n/exit\n"), out, interrupts
        )  # type: ignore[arg-type]
    )
    while "Once upon" not in out.getvalue():
        await asyncio.sleep(0.01)
    interrupts.interrupt()  # what SIGINT does
    turns = await asyncio.wait_for(talk, 10)
    assert client.calls[0].cancelled  # the control plane aborts a cancelled call's request
    assert "assistant> Once upon\n[stopped; this turn is not kept]\nyou> " in out.getvalue()
    # The next reply, cut by the limit, ends with a marker and is kept.
    assert "Once upon\n[cut at the token limit (max_new_tokens)" in out.getvalue() and turns == 1


async def test_two_ctrl_c_at_the_prompt_leave() -> None:
    read, write = os.pipe()  # a prompt that waits: nothing is typed
    out, interrupts = io.StringIO(), Interrupts()
    try:
        with os.fdopen(read, closefd=False) as stdin:
            talk = asyncio.ensure_future(
                converse(_SlowClient(), _conversation(), sampling_params(), stdin, out, interrupts)
            )  # type: ignore[arg-type]
            for prompts in (1, 2):
                while out.getvalue().count("you> ") < prompts:
                    await asyncio.sleep(0.01)
                interrupts.interrupt()
            assert await asyncio.wait_for(talk, 10) == 0
    finally:
        os.close(read)
        os.close(write)
    assert out.getvalue().count("Ctrl-C again leaves") == 1
