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
import os
import signal
import sys
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TextIO, TypeVar

import grpc

from clients.client import (
    CONNECTION_FLAGS,
    Generation,
    StepwiseClient,
    apply_response,
    client_from_args,
    generate_request,
)
from clients.errors import RoutineError
from clients.generate import add_sampling_arguments, sampling_from_args
from flagtypes.table import Flag, Flags
from gateway.chat import ChatTemplate
from gateway.templates import NAMED
from stepwise.models import chat_template

HELP_LINE = "/reset clears the conversation, /exit (or Ctrl-D) leaves; Ctrl-C stops a reply"
LEAVE_LINE = "Ctrl-C again leaves; /exit or Ctrl-D too"
T = TypeVar("T")


_MODEL = Flags(
    None,
    (
        Flag(
            "--model",
            default="embedded",
            help="the model whose chat template renders the conversation: a named model (stepwise models) "
            "or a checkpoint directory; without --address, chat serves it itself",
        ),
    ),
)
# Without --address, chat starts a control plane of its own.
_CONNECTION = CONNECTION_FLAGS.replace(
    "--address", default=None, help="a running control plane's client address (default: start one on --model)"
)
_CONVERSATION = Flags(
    None,
    (
        Flag("--system", help="a system message that opens the conversation"),
        Flag(
            "--chat-template",
            metavar="FILE|NAME",
            help="render the conversation with this chat template instead of the model's: a Jinja file or "
            f"a template shipped with Stepwise ({', '.join(NAMED)})",
        ),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _MODEL.add_to(parser)
    _CONNECTION.add_to(parser)
    add_sampling_arguments(parser, max_new_tokens=256)
    _CONVERSATION.add_to(parser)


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


class Interrupted(Exception):
    """Ctrl-C arrived while a read or a reply was under way (it was cancelled)."""


class Interrupts:
    """Ctrl-C as a person means it in a conversation: it cancels what is under way (the reply being
    streamed, or the wait for a line) instead of ending the process. `run` raises Interrupted for a
    cancelled step; `install` takes SIGINT over while the conversation runs."""

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self._fired = False

    def install(self) -> bool:
        """Take SIGINT over (False where the loop cannot: not the main thread, not Unix)."""
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self.interrupt)
        except (NotImplementedError, RuntimeError, ValueError):
            return False
        return True

    def uninstall(self) -> None:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)

    def interrupt(self) -> None:
        if self._task is not None and not self._task.done():
            self._fired = True
            self._task.cancel()

    async def run(self, step: Coroutine[Any, Any, T]) -> T:
        self._task, self._fired = asyncio.ensure_future(step), False
        try:
            return await self._task
        except asyncio.CancelledError:
            if not self._fired:
                raise  # cancelled from outside, not by Ctrl-C
            raise Interrupted from None
        finally:
            self._task = None


class Lines:
    """Lines of input, read without a thread where the input is a terminal or a pipe, so a Ctrl-C
    at the prompt can cancel the wait (a thread blocked in readline could not be)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._buffer = b""
        self._eof = False
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None  # an in-memory stream (tests)

    async def readline(self) -> str:
        if self._fd is None:
            return await asyncio.to_thread(self.stream.readline)
        while b"\n" not in self._buffer and not self._eof:
            if not await self._wait_readable():
                return await asyncio.to_thread(self.stream.readline)  # a regular file
            chunk = os.read(self._fd, 65536)
            self._eof = not chunk
            self._buffer += chunk
        line, newline, self._buffer = self._buffer.partition(b"\n")
        return (line + newline).decode(errors="replace")

    async def _wait_readable(self) -> bool:
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()
        assert self._fd is not None
        try:
            loop.add_reader(self._fd, _resolve, readable)
        except (OSError, ValueError):  # epoll refuses a regular file
            self._fd = None
            return False
        try:
            await readable
        finally:
            loop.remove_reader(self._fd)
        return True


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def converse(
    client: StepwiseClient,
    conversation: Conversation,
    sampling: Any,
    stdin: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
    interrupts: Interrupts | None = None,
) -> int:
    """Read turns from `stdin` until /exit, end of input or two Ctrl-C in a row at the prompt; the
    number of turns answered. A Ctrl-C during a reply stops it (the request is aborted) and the
    prompt returns; with `interrupts`, SIGINT is taken over meanwhile."""
    interrupts = interrupts or Interrupts()
    installed = interrupts.install()
    try:
        return await _converse(client, conversation, sampling, Lines(stdin), out, interrupts)
    finally:
        if installed:
            interrupts.uninstall()


async def _converse(
    client: StepwiseClient,
    conversation: Conversation,
    sampling: Any,
    lines: Lines,
    out: TextIO,
    interrupts: Interrupts,
) -> int:
    out.write(f"[chat: {HELP_LINE}]\n")
    turns, interrupted = 0, False
    while True:
        out.write("you> ")
        out.flush()
        try:
            line = await interrupts.run(lines.readline())
        except Interrupted:
            if interrupted:
                out.write("\n")
                return turns
            interrupted = True
            out.write(f"\n[{LEAVE_LINE}]\n")
            continue
        interrupted = False
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
        try:
            reply = await interrupts.run(_turn(client, conversation.prompt_for(text), sampling, out))
        except Interrupted:
            out.write("\n[stopped; this turn is not kept]\n")
            continue
        if reply is not None:
            conversation.answered(text, reply)
            turns += 1


async def _turn(client: StepwiseClient, prompt: str, sampling: Any, out: TextIO) -> str | None:
    """Stream one reply; its text, or None when the server refused or cut it short. Cancelled (a
    Ctrl-C), it cancels the call: the control plane aborts the request and frees its KV."""
    gen = Generation()
    out.write("assistant> ")
    out.flush()
    call = client.stream(generate_request(prompt, sampling))
    try:
        async for response in call:
            apply_response(gen, response)
            if response.WhichOneof("event") == "chunk":
                out.write(response.chunk.text)
                out.flush()
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise
        out.write(f"\n[refused: {exc.code().name}: {exc.details()}; this turn is not kept]\n")
        return None
    except asyncio.CancelledError:
        cancel = getattr(call, "cancel", None)  # a gRPC call; cancelling it aborts the request
        if cancel is not None:
            cancel()
        raise
    out.write("\n")
    if gen.finish_reason == "length":
        # A reply cut mid-sentence must not pass for a whole one.
        out.write(
            f"[cut at the token limit ({gen.finish_message or 'length'}); --max-new-tokens allows more]\n"
        )
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
    stack, log_path = None, None
    if ns.address is None:
        from stepwise.up import local_stack

        # The servers' output goes to a file: a warning printed into the conversation reads as the
        # model's; the file is kept only when it says something.
        handle, name = tempfile.mkstemp(prefix="stepwise-chat-", suffix=".log")
        os.close(handle)
        log_path = Path(name)
        stack = local_stack(model_dir, log_path)
    try:
        if stack is not None:
            try:
                ns.address = await stack.start()
            except (RuntimeError, TimeoutError) as exc:
                raise RoutineError(f"{exc}; its output: {log_path}") from exc
            print(f"[stepwise: control plane and one worker up at {ns.address}]", flush=True)
        async with client_from_args(ns) as client:
            await client.wait_ready(ns.wait)
            await converse(client, conversation, sampling)
        return 0
    finally:
        if stack is not None:
            stack.stop()
        _keep_if_said_something(log_path)


def _keep_if_said_something(log_path: Path | None) -> None:
    if log_path is None or not log_path.exists():
        return
    if log_path.stat().st_size == 0:
        log_path.unlink()
    else:
        print(f"[stepwise: the servers' log: {log_path}]", file=sys.stderr)
