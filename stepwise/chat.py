"""`stepwise chat`: a conversation in the terminal over the gRPC API, through the model's chat template.

Each turn renders the whole history with the model's template (as the gateway does), streams the
reply, and keeps it in the history. `/reset` starts over, `/exit` or end of input leaves. With no
`--address`, chat starts a control plane and one worker on `--model` itself and stops them at the end.
A turn the server refuses (a history past the model's context, say) is reported in one line and
dropped from the history; the conversation goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any, TextIO

import grpc

from clients.client import (
    Generation,
    StepwiseClient,
    add_connection_arguments,
    apply_response,
    client_from_args,
    generate_request,
)
from clients.errors import RoutineError
from clients.generate import add_sampling_arguments, sampling_from_args
from gateway.chat import ChatTemplate
from gateway.templates import NAMED
from stepwise.models import chat_template

HELP_LINE = "/reset clears the conversation, /exit (or Ctrl-D) leaves"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="embedded",
        help="the model whose chat template renders the conversation: a named model (stepwise models) "
        "or a checkpoint directory; without --address, chat serves it itself",
    )
    add_connection_arguments(parser)
    parser.set_defaults(address=None)
    for action in parser._actions:
        if action.dest == "address":
            action.help = "a running control plane's client address (default: start one on --model)"
    add_sampling_arguments(parser, max_new_tokens=256)
    parser.add_argument("--system", default=None, help="a system message that opens the conversation")
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|NAME",
        help="render the conversation with this chat template instead of the model's: a Jinja file or "
        f"a template shipped with Stepwise ({', '.join(NAMED)})",
    )


class Conversation:
    """The history and the template that renders it."""

    def __init__(self, template: ChatTemplate, system: str | None) -> None:
        self.template = template
        self.opening = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict[str, Any]] = list(self.opening)

    def reset(self) -> None:
        self.messages = list(self.opening)

    def prompt_for(self, user_text: str) -> str:
        """The rendered prompt of the history plus this user turn (kept only once answered)."""
        return self.template.render([*self.messages, {"role": "user", "content": user_text}])

    def answered(self, user_text: str, reply: str) -> None:
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]


async def converse(
    client: StepwiseClient,
    conversation: Conversation,
    sampling: Any,
    stdin: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
) -> int:
    """Read turns from `stdin` until /exit or end of input; the number of turns answered."""
    out.write(f"[chat: {HELP_LINE}]\n")
    turns = 0
    while True:
        out.write("you> ")
        out.flush()
        line = await asyncio.to_thread(stdin.readline)
        if not line:
            out.write("\n")
            return turns
        text = line.strip()
        if text == "/exit":
            return turns
        if text == "/reset":
            conversation.reset()
            out.write("[conversation cleared]\n")
            continue
        if not text or text.startswith("/"):
            out.write(f"[{HELP_LINE}]\n" if text else "")
            continue
        reply = await _turn(client, conversation.prompt_for(text), sampling, out)
        if reply is not None:
            conversation.answered(text, reply)
            turns += 1


async def _turn(client: StepwiseClient, prompt: str, sampling: Any, out: TextIO) -> str | None:
    """Stream one reply; its text, or None when the server refused or cut it short."""
    gen = Generation()
    out.write("assistant> ")
    out.flush()
    try:
        async for response in client.stream(generate_request(prompt, sampling)):
            apply_response(gen, response)
            if response.WhichOneof("event") == "chunk":
                out.write(response.chunk.text)
                out.flush()
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise
        out.write(f"\n[refused: {exc.code().name}: {exc.details()}; this turn is not kept]\n")
        return None
    out.write("\n")
    if gen.finish_reason not in ("stop", "length"):
        message = f" ({gen.finish_message})" if gen.finish_message else ""
        out.write(f"[finish: {gen.finish_reason}{message}; this turn is not kept]\n")
        return None
    return gen.text


def _template(ns: argparse.Namespace, model_dir: Path) -> ChatTemplate:
    flag = "--chat-template" if ns.chat_template is not None else "--model"
    try:
        template = chat_template(ns.model, model_dir, ns.chat_template)
    except (OSError, ValueError) as exc:
        raise RoutineError(f"{flag}: cannot read the chat template: {exc}") from exc
    if template is None:
        raise RoutineError(f"--model: the model in {model_dir} has no chat template")
    return template


async def run(ns: argparse.Namespace, model_dir: Path) -> int:
    conversation = Conversation(_template(ns, model_dir), ns.system)
    # Every sampling flag, --stop and --ignore-eos included (they were parsed and then dropped).
    sampling = sampling_from_args(ns)
    stack = None
    if ns.address is None:
        from stepwise.up import local_stack

        stack = local_stack(model_dir)
    try:
        if stack is not None:
            ns.address = await stack.start()
            print(f"[stepwise: control plane and one worker up at {ns.address}]", flush=True)
        async with client_from_args(ns) as client:
            await client.wait_ready(ns.wait)
            await converse(client, conversation, sampling)
        return 0
    finally:
        if stack is not None:
            stack.stop()
