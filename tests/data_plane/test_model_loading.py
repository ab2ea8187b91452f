"""The embedded checkpoint and our loader: formats we accept, things we refuse."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_plane.executor import Executor
from data_plane.kv_pool import KvPool
from data_plane.models.llama import LlamaModel
from data_plane.models.loader import ModelLoadError, model_fingerprint, read_model_config, weight_files
from stepwise.embedded import EMBEDDED_DIR
from stepwise.models import resolve_model
from tests.data_plane.factories import Extend, SlotAllocator, hf_next_logits, make_plan, new_seq

CPU = torch.device("cpu")
PROMPT = [17, 300, 42, 999, 5, 64, 128]


def _our_next_logits(
    model_dir: pathlib.Path, tokens: list[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Logits for the token after `tokens` from our model, via a one-sequence executor."""
    model = LlamaModel.from_dir(model_dir, CPU, dtype)
    executor = Executor(model, KvPool(model.config, 256, dtype, CPU))
    slots = SlotAllocator(256)
    plan = make_plan(1, new_seqs=[new_seq(1)], extends=[Extend(1, 0, tokens, slots.alloc(1, len(tokens)))])
    return executor.forward_logits(plan)[0]


def _copy_checkpoint(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir: pathlib.Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_embedded_resolves_to_committed_checkpoint() -> None:
    assert resolve_model("embedded") == EMBEDDED_DIR


def test_resolve_model_rejects_missing_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_embedded_loads_with_transformers(model_dir: pathlib.Path, hf_model) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.eos_token == "<|endoftext|>"
    assert len(tokenizer) == hf_model.config.vocab_size == 1024
    text = "The baker stood on the step and looked at the sky."
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert hf_model.config.tie_word_embeddings


def test_our_config_matches_checkpoint(model_dir: pathlib.Path) -> None:
    config = read_model_config(model_dir)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (4, 4, 2, 32)
    assert config.eos_token_ids == (0,)
    assert config.rope.rope_type == "default"


def test_fingerprint_is_stable_and_sensitive(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    copy = _copy_checkpoint(model_dir, tmp_path / "m")
    assert model_fingerprint(copy) == model_fingerprint(model_dir)
    _edit_config(copy, rms_norm_eps=1e-5)
    assert model_fingerprint(copy) != model_fingerprint(model_dir)


def test_sharded_untied_checkpoint_loads_identically(
    model_dir: pathlib.Path, hf_model, tmp_path: pathlib.Path
) -> None:
    """Two shards plus an index, with an explicit lm_head, give the same logits."""
    out = tmp_path / "sharded"
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(out / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _edit_config(out, tie_word_embeddings=False)
    assert [p.name for p in weight_files(out)] == sorted(shards)
    diff = (_our_next_logits(out, PROMPT) - hf_next_logits(hf_model, PROMPT)).abs().max().item()
    assert diff < 1e-4


def test_llama3_rope_scaling_matches_transformers(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    out = _copy_checkpoint(model_dir, tmp_path / "m")
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    _edit_config(out, rope_parameters=rope)
    assert read_model_config(out).rope.factor == 8.0
    reference = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = PROMPT * 12  # long enough for the scaled low frequencies to matter
    diff = (_our_next_logits(out, tokens) - hf_next_logits(reference, tokens)).abs().max().item()
    assert diff < 1e-4


def test_unsupported_architecture_is_refused_by_name(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = _copy_checkpoint(model_dir, tmp_path / "m")
    _edit_config(out, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        read_model_config(out)


def test_missing_weights_are_refused_by_name(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = _copy_checkpoint(model_dir, tmp_path / "m")
    (out / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        LlamaModel.from_dir(out, CPU, torch.float32)


def test_bfloat16_logits_stay_close(model_dir: pathlib.Path, hf_model) -> None:
    ours = _our_next_logits(model_dir, PROMPT, torch.bfloat16).float()
    reference = hf_next_logits(hf_model, PROMPT)
    assert ours.argmax() == reference.argmax()
    assert (ours - reference).abs().max().item() < 0.5
