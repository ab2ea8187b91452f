"""The embedded-model builder, run with a few training steps so it stays fast."""

from __future__ import annotations

import pathlib

import pytest
import torch

import stepwise.embedded as embedded
import stepwise.models as models
from data_plane.models.llama import LlamaModel

QUICK = embedded.BuildSpec(train_steps=3, batch_size=2, seq_len=32)


def test_quick_build_is_loadable_by_transformers_and_by_us(tmp_path: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = embedded.build(tmp_path / "model", QUICK)
    assert {*embedded.REQUIRED_FILES, "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id == 0
    assert AutoModelForCausalLM.from_pretrained(str(out)).config.vocab_size == QUICK.vocab_size
    assert LlamaModel.from_dir(out, torch.device("cpu"), torch.float32).config.num_kv_heads == 2
    assert not list(tmp_path.glob("*.tmp-*")), "temporary build directory left behind"


def test_missing_committed_checkpoint_is_built_into_the_user_cache(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = embedded.build
    monkeypatch.setattr(embedded, "EMBEDDED_DIR", tmp_path / "not-committed")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "build", lambda out: real_build(out, QUICK))
    resolved = models.resolve_model("embedded")
    assert resolved == tmp_path / "cache" / "stepwise" / "embedded"
    assert models.resolve_model("embedded") == resolved  # second call reuses the cache
